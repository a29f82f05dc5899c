"""`CheckpointStore`: per-role files per step, committed by a manifest.

    RUN_DIR/ckpt/step_00000120/actor_rollout.h5   one file per role, written by the role itself
    RUN_DIR/ckpt/step_00000120/critic.h5
    RUN_DIR/ckpt/step_00000120/inflight.h5        a pipelined run's batches generated ahead (inflight.py)
    RUN_DIR/ckpt/step_00000120/MANIFEST.json      written last by the driver: the step counts only now
    RUN_DIR/ckpt/LATEST                           "step_00000120", updated after the manifest

Every file is written under a temporary name, fsynced and renamed (role files: hpcrl/checkpoint/
format.py), so a crash at any moment leaves the previous committed step intact; `check` looks at a
step's manifest and file sizes, `verify` also at every checksum (a block at a time), and
`latest_good` walks back past a damaged one. A resuming run reads no role file in the driver: each
role checks its own as it loads it (hpcrl/checkpoint/commit.py). Frozen roles are
written once; later manifests point to that file. Every path a manifest names is taken only where it
stays inside ckpt/ (`path`): a manifest changed to name /etc/passwd or ../../x is refused, not followed.
"""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpcrl.checkpoint.format import FORMAT_VERSION, verify_role_file
from hpcrl.checkpoint.inflight import (FILE, is_pickled, pickled_problem, read_inflight, refuse_pickled,
                                       write_inflight)
from hpcrl.files import atomic_write_text, confined, free_bytes
from hpcrl.run_dir import RunDir

log = logging.getLogger("hpcrl.checkpoint")


class CheckpointStore:
    def __init__(self, run_dir: Path, keep_last: int = 3, keep_every: int = 0):
        self.root = RunDir(run_dir).ckpt
        self.keep_last, self.keep_every = keep_last, keep_every

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def role_path(self, step: int, role: str) -> Path:
        return self.step_dir(step) / f"{role}.h5"

    def path(self, relative: str, step: int) -> Path:
        """A file step's manifest names (relative to ckpt/); UnsafePath where it leads out of ckpt/."""
        return confined(self.root, relative, f"{self.step_dir(step) / 'MANIFEST.json'}")

    def write_inflight(self, step: int, batches: list) -> dict | None:
        """The batches generated ahead of `step`, for its manifest (None: there are none)."""
        if not batches:
            return None
        path = self.step_dir(step) / FILE
        return {"path": str(path.relative_to(self.root)), **write_inflight(path, batches)}

    def read_inflight(self, manifest: dict) -> list:
        """The batches generated ahead of the manifest's step; DamagedFile where a checksum fails,
        PickledInflight where an earlier hpcrl pickled them."""
        info = manifest.get("inflight")
        if not info:
            return []
        path = self.path(info["path"], manifest["step"])
        if is_pickled(info):
            raise refuse_pickled(path, self.root.parent)
        return read_inflight(path)

    def files(self, manifest: dict) -> dict[str, dict]:
        """What the manifest's step is made of: role -> its file info, and "in-flight batches" where it has them."""
        return {**manifest["roles"], **({"in-flight batches": manifest["inflight"]} if manifest.get("inflight") else {})}

    def commit(self, step: int, files: dict[str, dict], driver_state: dict, inflight: dict | None = None) -> Path:
        """The step exists from here on. files: role -> {"path" (relative to ckpt/), "bytes", ...};
        inflight: what write_inflight returned."""
        manifest = {"format_version": FORMAT_VERSION, "step": step, "time": time.time(), "roles": files,
                    "driver": driver_state, **({"inflight": inflight} if inflight else {})}
        path = self.step_dir(step) / "MANIFEST.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(manifest, indent=1))
        atomic_write_text(self.root / "LATEST", path.parent.name + "\n")
        self.prune()
        return path

    def committed_steps(self) -> list[int]:
        return sorted(int(d.name.removeprefix("step_")) for d in self.root.glob("step_*")
                      if (d / "MANIFEST.json").exists())

    def manifest(self, step: int) -> dict:
        return json.loads((self.step_dir(step) / "MANIFEST.json").read_text())

    def check(self, step: int) -> list[str]:
        """What is wrong with a step without reading its role files (empty: good as far as that goes):
        the manifest, each role file there at the size it says, the batches generated ahead."""
        try:
            m = self.manifest(step)
        except (OSError, ValueError) as e:
            return [f"step {step}: manifest unreadable ({e})"]
        problems = []
        for role, info in self.files(m).items():
            path = self.path(info["path"], step)
            if not path.exists():
                problems.append(f"{role}: {path.name} missing")
            elif path.stat().st_size != info["bytes"]:
                problems.append(f"{info['path']}: {path.stat().st_size} bytes, the manifest says {info['bytes']}")
        return problems

    def verify(self, step: int) -> list[str]:
        """What is wrong with a step (empty: good): check(), then every role file's checksums, the files
        at once, each read a block at a time (a multi-GB step in little memory)."""
        problems = self.check(step)
        if problems:
            return problems
        files = self.files(self.manifest(step))

        def verify(info: dict) -> str | None:
            path = self.path(info["path"], step)
            return pickled_problem(path, info) if is_pickled(info) else verify_role_file(path)
        with ThreadPoolExecutor(max(1, len(files))) as pool:     # zlib runs beside the reads of the others
            found = pool.map(lambda item: (item[0], verify(item[1])), files.items())
            return [f"{role}: {problem}" for role, problem in found if problem]

    def refused_write(self, why: str, step: int) -> str:
        """What to tell a user whose run directory refused a write (a full disk) during `step`."""
        if not self.root.parent.exists():
            return (f"the run directory {self.root.parent} is gone (deleted, moved, or its filesystem unmounted) "
                    f"during step {step}: {why}; what it held is where it went, if anywhere: put it back and "
                    "continue with `hpcrl submit SPEC --resume`, or submit again")
        try:
            steps = self.committed_steps()
            last = steps[-1] if steps else None
            fresh = [info["bytes"] for info in self.manifest(last)["roles"].values()
                     if info["path"].startswith(self.step_dir(last).name + "/")] if last else []
        except (OSError, ValueError):
            last, fresh = None, []
        free = free_bytes(self.root)
        parts = [f"the run directory {self.root.parent} refused a write during step {step}: {why}"]
        if free is not None:
            parts.append(f"{free / 1e6:.1f} MB are free on {self.root}")
        if fresh:
            parts.append(f"a checkpoint of this run takes about {sum(fresh) / 1e6:.1f} MB (step {last}'s did)")
        if last is not None:
            parts.append(f"the committed checkpoints are intact, the newest is step {last}: make room (or lower "
                         "keep_last), then continue from it with `hpcrl submit SPEC --resume`")
        else:
            parts.append("no checkpoint was committed yet: make room, then submit again")
        return "; ".join(parts)

    def latest_good(self) -> tuple[int, dict] | None:
        """The newest step that verifies, warning about each newer one that does not."""
        for step in reversed(self.committed_steps()):
            problems = self.verify(step)
            if not problems:
                return step, self.manifest(step)
            log.warning("checkpoint step %d is unusable (%s); trying an older one", step, "; ".join(problems))
        return None

    def prune(self) -> None:
        """Keep the newest keep_last steps, every keep_every-th step, and every file a kept manifest
        uses (a frozen role's file stays where it was first written)."""
        steps = self.committed_steps()
        keep = set(steps[-self.keep_last:]) if self.keep_last else set(steps)
        keep |= {s for s in steps if self.keep_every and s % self.keep_every == 0}
        used = {self.root / info["path"] for s in keep for info in self.manifest(s)["roles"].values()}
        for s in set(steps) - keep:
            d = self.step_dir(s)
            (d / "MANIFEST.json").unlink()
            for f in d.iterdir():
                if f not in used:
                    f.unlink()
            if not any(d.iterdir()):
                d.rmdir()
