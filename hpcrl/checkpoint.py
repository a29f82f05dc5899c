"""`CheckpointStore`: per-role HDF5 files per step, committed by a manifest.

    RUN_DIR/ckpt/step_00000120/actor_rollout.h5   one file per role, written by the role itself
    RUN_DIR/ckpt/step_00000120/critic.h5
    RUN_DIR/ckpt/step_00000120/MANIFEST.json      written last by the driver: the step counts only now
    RUN_DIR/ckpt/LATEST                           "step_00000120", updated after the manifest

Every file is written under a temporary name, flushed, fsynced, renamed, and its directory
fsynced, so a crash at any moment leaves the previous committed step intact. A role file holds
one dataset per tensor (named by its path in the state, dtype kept; bfloat16 as its 16 bits),
the structure around the tensors as JSON, and a CRC32 per dataset, so `verify` notices a flipped
byte and `latest_good` walks back past it. Frozen roles are written once; later manifests point
to that file.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hpcrl.util import atomic_write_text, replace_durably

FORMAT_VERSION = 1
log = logging.getLogger("hpcrl.checkpoint")


# ---------------------------------------------------------------- one role's file
def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]):
    """The JSON skeleton of obj, each tensor replaced by {"__t__": its dataset name}."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {"__t__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(obj)
        return {"__np__": path}
    if isinstance(obj, dict):
        return {"__d__": [[_flatten(k, f"{path}/k{i}", tensors), _flatten(v, f"{path}/{_key(k, i)}", tensors)]
                          for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.dtype):      # megatron's optimizer state is keyed by dtype
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(f"checkpoint: cannot store {type(obj).__name__} at {path}")


def _key(k, i: int) -> str:
    return str(k).replace("/", "|") if isinstance(k, (str, int)) else f"item{i}"


def _unflatten(node: Any, read):
    if isinstance(node, dict):
        if "__t__" in node:
            return read(node["__t__"])
        if "__np__" in node:
            return read(node["__np__"]).numpy()
        if "__dtype__" in node:
            return getattr(torch, node["__dtype__"])
        if "__tuple__" in node:
            return tuple(_unflatten(v, read) for v in node["__tuple__"])
        return {_unflatten(k, read): _unflatten(v, read) for k, v in node["__d__"]}
    if isinstance(node, list):
        return [_unflatten(v, read) for v in node]
    return node


def _as_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).removeprefix("torch.")


def crc32(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)


def snapshot(state: dict) -> dict:
    """A CPU copy of every tensor in state, so training may go on while it is written."""
    return _unflatten(_flatten(state, "", tensors := {}), lambda p: tensors[p].detach().to("cpu", copy=True))


def tensor_arrays(state: dict) -> tuple[Any, dict[str, tuple[np.ndarray, str]]]:
    """(the JSON skeleton, {dataset name: (array, hpcrl dtype)}) of a state: what a role file holds."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "", tensors)
    return skeleton, {name: _as_array(t) for name, t in tensors.items()}


def file_attrs(skeleton, attrs: dict) -> dict:
    """The attributes of a role file, the same whichever path writes it."""
    from hpcrl import __version__

    return {"skeleton": json.dumps(skeleton), "format_version": FORMAT_VERSION, "hpcrl_version": __version__, **attrs}


def write_role_file(path: Path, state: dict, attrs: dict) -> dict:
    """Atomically write one role's state; returns {"bytes", "datasets"} for the manifest.

    Checksums run on a second thread while h5py writes (zlib releases the GIL, h5py does not),
    so they cost no wall time on a host with a spare core."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    skeleton, arrays = tensor_arrays(state)
    with ThreadPoolExecutor(1, thread_name_prefix="hpcrl-crc") as pool:
        crcs = {name: pool.submit(crc32, arr) for name, (arr, _) in arrays.items()}
        with h5py.File(tmp, "w") as f:
            for name, (arr, dtype) in arrays.items():
                f.create_dataset(dataset_name(name), data=arr).attrs["dtype"] = dtype
            for name, crc in crcs.items():
                f[dataset_name(name)].attrs["crc32"] = crc.result()
            f.attrs.update(file_attrs(skeleton, attrs))
            f.flush()
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    replace_durably(tmp, path)
    return {"bytes": path.stat().st_size, "datasets": len(arrays)}


def dataset_name(name: str) -> str:
    return name.lstrip("/") or "root"


def read_role_file(path: Path) -> tuple[dict, dict]:
    """(state, attrs); raises ValueError when a dataset's checksum does not match.

    Each dataset's checksum runs on a second thread while the next one is read."""
    import h5py

    with h5py.File(path, "r") as f, ThreadPoolExecutor(1, thread_name_prefix="hpcrl-crc") as pool:
        checks = []

        def read(name: str) -> torch.Tensor:
            ds = f[dataset_name(name)]
            arr = np.asarray(ds[()])  # a 0-d dataset reads as a numpy scalar
            checks.append((name, int(ds.attrs["crc32"]), pool.submit(crc32, arr)))
            t = torch.from_numpy(arr)
            return t.view(torch.bfloat16) if ds.attrs["dtype"] == "bfloat16" else t
        state = _unflatten(json.loads(f.attrs["skeleton"]), read)
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items() if k != "skeleton"}
        for name, expected, crc in checks:
            if crc.result() != expected:
                raise ValueError(f"{path}: dataset {name} fails its checksum")
    return state, attrs


def verify_role_file(path: Path) -> str | None:
    """None if every dataset reads back with its checksum; else what is wrong."""
    try:
        read_role_file(path)
    except FileNotFoundError:
        return f"{path.name} missing"
    except Exception as e:  # noqa: BLE001 - h5py raises many kinds for a damaged file
        return f"{path.name}: {e}"
    return None


def rng_state() -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- the driver's side
class CheckpointStore:
    def __init__(self, run_dir: Path, keep_last: int = 3, keep_every: int = 0):
        self.root = Path(run_dir) / "ckpt"
        self.keep_last, self.keep_every = keep_last, keep_every

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def role_path(self, step: int, role: str) -> Path:
        return self.step_dir(step) / f"{role}.h5"

    def commit(self, step: int, files: dict[str, dict], driver_state: dict) -> Path:
        """The step exists from here on. files: role -> {"path" (relative to ckpt/), "bytes", ...}."""
        manifest = {"format_version": FORMAT_VERSION, "step": step, "time": time.time(), "roles": files,
                    "driver": driver_state}
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

    def verify(self, step: int) -> list[str]:
        """What is wrong with a step (empty: good): manifest, every role file and its checksums."""
        try:
            m = self.manifest(step)
        except (OSError, ValueError) as e:
            return [f"step {step}: manifest unreadable ({e})"]
        problems = []
        for role, info in m["roles"].items():
            path = self.root / info["path"]
            if path.exists() and path.stat().st_size != info["bytes"]:
                problems.append(f"{info['path']}: {path.stat().st_size} bytes, the manifest says {info['bytes']}")
                continue
            problem = verify_role_file(path)
            if problem:
                problems.append(f"{role}: {problem}")
        return problems

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


class AsyncWriter:
    """Runs one write at a time on a background thread; `wait()` before the next save and before
    exit. What it writes must already be a copy (`snapshot`) or staged, as training goes on."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._result: dict | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], dict]) -> None:
        self.wait()

        def run():
            try:
                self._result = write()
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e
        self._thread = threading.Thread(target=run, name="hpcrl-ckpt", daemon=False)
        self._thread.start()

    def wait(self) -> dict | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result
