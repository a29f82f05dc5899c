"""The driver's half of a checkpoint: every role writes its own file (hpcrl/checkpoint/role.py),
then the step is committed with a manifest once all have succeeded; resume loads every role from
the newest step that verifies."""
from __future__ import annotations

import time

from hpcrl.checkpoint.store import CheckpointStore


class RoleCheckpoints:
    """Saves, commits and resumes the roles of one run (`groups`: role -> WorkerGroup); frozen roles
    are written once, and a rebuilt role gets its file from the newest committed step."""

    def __init__(self, store: CheckpointStore, groups: dict, background: bool,
                 on_commit=lambda step, nbytes, seconds: None):
        self.store, self.groups, self.background, self.on_commit = store, groups, background, on_commit
        self.frozen = {r: wg.worker_cls.frozen for r, wg in groups.items()}
        self.written: dict[str, dict] = {}          # frozen role -> its one file
        self.pending: tuple | None = None           # a background save not committed yet
        for role, wg in groups.items():
            wg.on_restart(lambda role=role: self.restore_role(role))

    def save(self, step: int, driver_state: dict, background: bool = False, inflight: list = ()) -> None:
        """inflight: the batches a pipelined run generated ahead of `step` (hpcrl/checkpoint/inflight.py)."""
        self.finish()
        t0 = time.perf_counter()
        ahead = self.store.write_inflight(step, list(inflight))
        background = background and self.background
        files, futures = {}, {}
        for role, wg in self.groups.items():
            if self.frozen[role] and role in self.written:
                files[role] = self.written[role]
                continue
            path = self.store.role_path(step, role)
            futures[role] = (path, wg.save_checkpoint.future(str(path), step, background and not self.frozen[role]))
        for role, (path, fut) in futures.items():
            files[role] = {"path": str(path.relative_to(self.store.root)), **fut.result()[0]}
            if self.frozen[role]:
                self.written[role] = files[role]
        self.pending = (step, files, driver_state, ahead, t0, set(futures))
        if not background:
            self.finish()

    def finish(self) -> None:
        """Wait for background writes, then commit the step."""
        if self.pending is None:
            return
        step, files, driver_state, ahead, t0, fresh = self.pending
        for role, info in files.items():
            if info.pop("pending", False):
                info.update(self.groups[role].finish_checkpoint())
        self.store.commit(step, files, driver_state, ahead)
        self.pending = None
        self.on_commit(step, sum(files[r]["bytes"] for r in fresh), time.perf_counter() - t0)

    def resume(self) -> tuple[int, dict, int, list] | None:
        """Load every role from the newest good step: (step, the driver's state, bytes read, the
        batches generated ahead of it), or None."""
        found = self.store.latest_good()
        if found is None:
            return None
        step, manifest = found
        futures = [self.groups[r].load_checkpoint.future(str(self.store.root / info["path"]))
                   for r, info in manifest["roles"].items() if r in self.groups]
        for f in futures:
            f.result()
        self.written = {r: info for r, info in manifest["roles"].items() if self.frozen.get(r)}
        return (step, manifest["driver"], sum(info["bytes"] for r, info in manifest["roles"].items() if r in self.groups),
                self.store.read_inflight(manifest))

    def restore_role(self, role: str) -> None:
        """After a role was rebuilt: its file from the newest committed step, if there is one."""
        steps = self.store.committed_steps()
        if steps:
            info = self.store.manifest(steps[-1])["roles"].get(role)
            if info:
                self.groups[role].load_checkpoint(str(self.store.root / info["path"]))
