"""`WorkerGroup`: the driver's handle on one role's workers.

    critic_wg = WorkerGroup(ResourcePool.for_role("critic"), Critic, init_kwargs={...}, log_dir=run/"logs")
    values = critic_wg.compute_values(batch)                 # blocks; DP split + concat
    fut = actor_wg.generate_sequences.future(prompts)        # returns at once
    ref_wg.compute_ref_log_prob(fut)                         # refs go rank to rank, not via the driver

`WorkerGroup.colocated(pool, {"actor": ..., "ref": ...})` puts several roles in one process per
rank and still returns one WorkerGroup per role, so training code does not change with layout.

When a worker process dies, the call that saw it rebuilds every process of that group (their
torch.distributed group is broken anyway) in the same placement group, runs the group's restore
hooks (a role's checkpoint, or nothing: the workers start from their init), and retries. Roles
in other groups are untouched. More than `restart_limit` rebuilds in an hour fail the run.
With `standby=True` every rank has an idle process beside it (torch imported, nothing reserved)
that takes its place, so a rebuild pays no process start and no torch import.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hpcrl.controller.dispatch import DispatchMode, registered_methods
from hpcrl.controller.resource_pool import ResourcePool
from hpcrl.controller.worker import WorkerHost

log = logging.getLogger("hpcrl.controller")

WorkerSpec = tuple[type, tuple, dict]   # (worker class, init args, init kwargs)


class RoleRestartLimit(RuntimeError):
    """A role died more often than its restart limit allows; the run cannot go on."""


class _HostSet:
    """The actor processes behind one WorkerGroup, or behind several colocated ones."""

    def __init__(self, pool: ResourcePool, workers: dict[str, WorkerSpec], log_dir, restart_limit: int,
                 dist_timeout_s: float, standby: bool):
        if len(workers) > pool.max_colocate_count:
            raise ValueError(f"{len(workers)} roles {list(workers)} in one process, but the pool of role "
                             f"{pool.role!r} allows max_colocate_count={pool.max_colocate_count}")
        self.pool, self.workers, self.log_dir = pool, workers, str(log_dir) if log_dir else None
        self.name = "+".join(workers)
        self.restart_limit, self.dist_timeout_s = restart_limit, dist_timeout_s
        self.restarts: deque[float] = deque()
        self.restarts_total, self.state, self.last_error = 0, "starting", None
        self.restore_hooks: list[Callable[[], None]] = []
        self.listeners: list[Callable[[], None]] = []   # told when state or last_error changes
        self.pg = pool.placement_group(len(workers))
        self.keep_standby = standby
        self.retired: set[str] = set()   # actor ids replaced by a rebuild: errors from them are old news
        self._start(self._hosts(standby=False))
        self._set_state("alive")

    def _set_state(self, state: str, error: str | None = None) -> None:
        self.state, self.last_error = state, error or self.last_error
        for listener in self.listeners:
            listener()

    def _hosts(self, standby: bool) -> list:
        """New idle host processes, one per rank: in the rank's bundle, or (standby) beside it on
        its node reserving nothing until it takes the rank over."""
        host = ray.remote(WorkerHost)
        bundle, n, ppn = self.pool.bundle(len(self.workers)), self.pool.world_size, self.pool.processes_per_node
        return [host.options(
            max_restarts=0, **({"num_cpus": 0, "resources": {f"node:{self.pool.node_ips[r // ppn]}": 0.0001}} if standby else {
                "num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)}),
        ).remote(list(self.workers), self.log_dir) for r in range(n)]

    def _start(self, hosts: list, gpu_ids: list | None = None) -> None:
        n, threads = len(hosts), int(self.pool.bundle(len(self.workers))["CPU"])
        master = ray.get(hosts[0].rendezvous.remote())
        done = ray.get([h.setup.remote(r, n, master, self.workers, threads, gpu_ids[r] if gpu_ids else None,
                                       self.dist_timeout_s) for r, h in enumerate(hosts)])
        self.actors, self.pids, self.gpu_ids = hosts, [d[0] for d in done], [d[1] for d in done]
        self.standby = self._hosts(standby=True) if self.keep_standby else []

    def owns(self, actor_id: str | None) -> int | None:
        for rank, a in enumerate(self.actors):
            if actor_id and a._actor_id.hex() == actor_id:
                return rank
        return None

    def rebuild(self, why: str) -> None:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > 3600:
            self.restarts.popleft()
        if len(self.restarts) >= self.restart_limit:
            raise RoleRestartLimit(f"role {self.name}: {why}; it was already rebuilt {len(self.restarts)} times "
                                   f"in the last hour (restart_limit={self.restart_limit}), so the run stops here")
        self.restarts.append(now)
        self.restarts_total += 1
        self._set_state("restarting", why)
        log.warning("role %s: %s; rebuilding it (restart %d of %d allowed per hour)",
                    self.name, why, len(self.restarts), self.restart_limit)
        t0 = time.monotonic()
        for a in self.actors:
            self.retired.add(a._actor_id.hex())
            ray.kill(a, no_restart=True)
        if self.standby:
            self._start(self.standby, self.gpu_ids)
        else:
            self._start(self._hosts(standby=False))
        for hook in self.restore_hooks:
            hook()
        self._set_state("alive")
        log.warning("role %s: rebuilt in %.2f s", self.name, time.monotonic() - t0)

    def shutdown(self) -> None:
        for a in self.actors + self.standby:
            ray.kill(a, no_restart=True)
        ray.util.remove_placement_group(self.pg)


class WorkerGroup:
    def __init__(self, pool: ResourcePool, worker_cls: type, init_args: tuple = (), init_kwargs: dict | None = None,
                 *, role: str | None = None, log_dir=None, restart_limit: int = 3, dist_timeout_s: float = 600.0,
                 standby: bool = False, _hosts: _HostSet | None = None):
        self.role = role or pool.role
        self.worker_cls = worker_cls
        self._hosts = _hosts or _HostSet(pool, {self.role: (worker_cls, tuple(init_args), dict(init_kwargs or {}))},
                                         log_dir, restart_limit, dist_timeout_s, standby)
        for name, mode in registered_methods(worker_cls).items():
            setattr(self, name, GroupMethod(self, name, mode))

    @classmethod
    def colocated(cls, pool: ResourcePool, workers: dict[str, WorkerSpec], *, log_dir=None, restart_limit: int = 3,
                  dist_timeout_s: float = 600.0, standby: bool = False) -> dict[str, WorkerGroup]:
        """Several roles in one process per rank; one WorkerGroup per role, as if they were apart."""
        workers = {role: (c, tuple(a), dict(k)) for role, (c, a, k) in workers.items()}
        hosts = _HostSet(pool, workers, log_dir, restart_limit, dist_timeout_s, standby)
        return {role: cls(pool, c, role=role, _hosts=hosts) for role, (c, _, _) in workers.items()}

    @property
    def world_size(self) -> int:
        return len(self._hosts.actors)

    def shares_processes_with(self, other: WorkerGroup) -> bool:
        """Colocated with `other`: their calls run one after the other in the same processes."""
        return self._hosts is other._hosts

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self._hosts.actors])

    def on_restart(self, hook: Callable[[], None]) -> None:
        """Run hook after this group's processes were rebuilt (to load the role's checkpoint)."""
        self._hosts.restore_hooks.append(hook)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call listener when the group starts or finishes a rebuild, or one of its calls fails."""
        self._hosts.listeners.append(listener)

    def describe(self) -> dict:
        """Where the ranks run and how the group fares, from what the driver already knows (no Ray call)."""
        h = self._hosts
        ppn = h.pool.processes_per_node
        return {"world_size": self.world_size, "state": h.state, "restarts": h.restarts_total,
                "last_error": h.last_error, "process": h.name,
                "ranks": [{"rank": r, "node_ip": h.pool.node_ips[r // ppn], "pid": pid} for r, pid in enumerate(h.pids)]}

    def shutdown(self) -> None:
        self._hosts.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role}, {self.worker_cls.__name__}, world_size={self.world_size})"


class GroupMethod:
    def __init__(self, wg: WorkerGroup, name: str, mode: DispatchMode):
        self.wg, self.name, self.mode = wg, name, mode

    def __call__(self, *args, **kwargs):
        return self.future(*args, **kwargs).result()

    def future(self, *args, **kwargs) -> GroupFuture:
        return GroupFuture(self, args, kwargs)

    def issue(self, args, kwargs) -> list:
        actors = self.wg._hosts.actors
        per_rank = self.mode.split(len(actors), args, kwargs)
        return [actors[r].execute.remote(self.wg.role, self.name, *a, **k)
                for r, call in enumerate(per_rank) if call is not None for a, k in [call]]


class GroupFuture:
    """The ranks' object refs of one group call. `.result()` collects (rebuilding the group and
    calling again if one of its processes died); passed to another group's call it is sent as refs."""

    def __init__(self, method: GroupMethod, args: tuple, kwargs: dict):
        self.method, self.args, self.kwargs = method, args, kwargs
        self.refs = method.issue(args, kwargs)

    def result(self) -> Any:
        while True:
            try:
                return self.method.mode.collect(ray.get(self.refs))
            except RayActorError as e:
                self.recover(e)
            except RayTaskError as e:    # the role's own code raised: the run stops; say where first
                hosts = self.method.wg._hosts
                hosts._set_state(hosts.state, f"{self.method.name}: {_last_line(e)}")
                raise

    def recover(self, error: RayActorError) -> None:
        """Rebuild whichever group lost the process named by error (ours or an input's), call again."""
        hosts = self.method.wg._hosts
        rank = hosts.owns(error.actor_id)
        if rank is not None:
            hosts.rebuild(f"rank {rank} died during {self.method.name}: {_reason(error)}")
        elif error.actor_id not in hosts.retired and not self._recover_inputs(error):
            raise error
        self.refs = self.method.issue(self.args, self.kwargs)

    def _recover_inputs(self, error: RayActorError) -> bool:
        return any(isinstance(a, GroupFuture) and a._recover_if_ours(error) for a in (*self.args, *self.kwargs.values()))

    def _recover_if_ours(self, error: RayActorError) -> bool:
        hosts = self.method.wg._hosts
        if hosts.owns(error.actor_id) is None and error.actor_id not in hosts.retired and not self._recover_inputs(error):
            return False
        self.recover(error)
        return True

    def whole(self):
        if self.method.mode.rank_zero or (len(self.refs) == 1 and not self.method.mode.concatenates):
            return self.refs[0]
        return _collect.remote(self.method.mode.collect, *self.refs)

    def shards(self, n: int) -> list:
        if self.method.mode.concatenates and len(self.refs) == n:
            return list(self.refs)
        refs = _rechunk.options(num_returns=n).remote(n, self.method.mode.collect, *self.refs)
        return [refs] if n == 1 else list(refs)


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _reason(error: RayActorError) -> str:
    text = str(error).strip().splitlines()
    return next((line.strip() for line in text if "died" in line or "exit" in line.lower()), text[0] if text else "")


@ray.remote(num_cpus=0)
def _collect(collect, *parts):
    return collect(list(parts))


@ray.remote(num_cpus=0)
def _rechunk(n, collect, *parts):
    chunks = collect(list(parts)).chunk(n)
    return chunks[0] if n == 1 else tuple(chunks)