"""`WorkerGroup`: the driver's handle on one role's workers.

    critic_wg = WorkerGroup(ResourcePool.for_role("critic"), Critic, init_kwargs={...}, log_dir=run/"logs")
    values = critic_wg.compute_values(batch)                 # blocks; DP split + concat
    fut = actor_wg.generate_sequences.future(prompts)        # returns at once
    ref_wg.compute_ref_log_prob(fut)                         # refs go rank to rank, not via the driver

`WorkerGroup.colocated(pool, {"actor": ..., "ref": ...})` puts several roles in one process per
rank and still returns one WorkerGroup per role, so training code does not change with layout.

When a worker process dies, the call that saw it rebuilds every process of that group (their
torch.distributed group is broken anyway) in the same placement group, puts each role's state
back (its `on_restore` hooks: the role's newest snapshot or checkpoint, or nothing: the workers
start from their init), makes again the state-changing calls (`@register(changes_state=True)`)
that returned since that state was taken, runs the `on_restart` hooks, and retries. So a rebuilt
role holds exactly the state it had, and the run goes on as if nothing happened. Roles in other
groups are untouched. More than `restart_limit` rebuilds in an hour fail the run.
With `standby=True` every rank has an idle process beside it (torch imported, nothing reserved)
that takes its place, so a rebuild pays no process start and no torch import.

An elastic group (a role whose worker class sets `elastic = True`: frozen scorers, the rollout)
follows its nodes: `follow_nodes()` at a step boundary gives ranks to nodes that joined (a
satellite job of `hpcrl scale`) and drops those of nodes that left, and a call that loses a rank
because its satellite node left shrinks the group and calls again, instead of a rebuild. Ranks
that stay keep their processes; the next call's data is split over the new world size.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hpcrl.controller.dispatch import DispatchMode, registered_methods
from hpcrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hpcrl.controller.worker import WorkerHost

log = logging.getLogger("hpcrl.controller")

WorkerSpec = tuple[type, tuple, dict]   # (worker class, init args, init kwargs)


class RoleRestartLimit(RuntimeError):
    """A role died more often than its restart limit allows; the run cannot go on."""


class RoleStateLost(RuntimeError):
    """A rebuilt role's state could not be had (it went with its node): the run stops, to resume
    every role from the newest committed step rather than mix states."""


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
        self.state_hooks: list[Callable[[], None]] = []     # each role's state back, after a rebuild
        self.restore_hooks: list[Callable[[], None]] = []   # then, once the state is back
        # the state-changing calls that returned since their role's state was last taken (snapshot,
        # checkpoint), numbered in the order they were issued (the order a process runs them): a
        # rebuild makes them again
        self.calls_since: list[tuple[int, GroupFuture]] = []
        self.calls_issued = 0
        self.held: dict[WorkerGroup, int] = {}    # role -> the calls its restorable state holds (forget_calls)
        self.listeners: list[Callable[[], None]] = []   # told when state or last_error changes
        self.resize_listeners: list[Callable[[dict], None]] = []   # told what each resize did
        self.pgs = pool.placement_groups(pool.nodes, len(workers))
        self.keep_standby = standby
        self.retired: set[str] = set()   # actor ids replaced by a rebuild: errors from them are old news
        self.unplaceable: set[str] = set()   # nodes that joined but could not take the group's processes
        self._form([self._host(r) for r in range(pool.world_size)], fresh=set(range(pool.world_size)))
        self._set_state("alive")

    @property
    def elastic(self) -> bool:
        """Ranks may join and leave between calls: one role whose worker class says so (no state of
        its own beyond its __init__ and the group's restore hooks)."""
        return len(self.workers) == 1 and all(getattr(cls, "elastic", False) for cls, _, _ in self.workers.values())

    def _set_state(self, state: str, error: str | None = None) -> None:
        self.state, self.last_error = state, error or self.last_error
        for listener in self.listeners:
            listener()

    def _host(self, rank: int, standby: bool = False):
        """A new idle host process for `rank`: in the rank's bundle, or (standby) beside it on its
        node reserving nothing until it takes the rank over."""
        node, bundle = self.pool.node_of(rank), self.pool.bundle(len(self.workers))
        place = ({"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False)}
                 if standby else
                 {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                  "scheduling_strategy": PlacementGroupSchedulingStrategy(
                      self.pgs[node.node_id], placement_group_bundle_index=rank % self.pool.processes_per_node)})
        return ray.remote(WorkerHost).options(max_restarts=0, **place).remote(list(self.workers), self.log_dir)

    def _form(self, hosts: list, fresh: set[int], gpu_ids: list | None = None) -> None:
        """Make `hosts` the group, rank = position: the `fresh` ones build the roles' workers, the
        others (kept through a resize) join the new torch.distributed group as they are."""
        n, threads = len(hosts), int(self.pool.bundle(len(self.workers))["CPU"])
        master = ray.get(hosts[0].rendezvous.remote())
        done = ray.get([h.setup.remote(r, n, master, self.workers, threads, gpu_ids[r] if gpu_ids else None,
                                       self.dist_timeout_s) if r in fresh else
                        h.regroup.remote(r, n, master, self.dist_timeout_s) for r, h in enumerate(hosts)])
        self.actors, self.pids, self.gpu_ids = hosts, [d[0] for d in done], [d[1] for d in done]
        self._replace_standby()

    def _replace_standby(self) -> None:
        for a in getattr(self, "standby", []):
            ray.kill(a, no_restart=True)
        self.standby = [self._host(r, standby=True) for r in range(len(self.actors))] if self.keep_standby else []

    def owns(self, actor_id: str | None) -> int | None:
        for rank, a in enumerate(self.actors):
            if actor_id and a._actor_id.hex() == actor_id:
                return rank
        return None

    def _retire(self, actors: list) -> None:
        for a in actors:
            self.retired.add(a._actor_id.hex())
            ray.kill(a, no_restart=True)

    def lost(self, rank: int, method: str, reason: str) -> None:
        """Rank `rank` died during `method`. A satellite's rank whose node has left shrinks an elastic
        group (the run goes on without that node); any other death rebuilds the group in place."""
        node = self.pool.node_of(rank)
        if self.elastic and node.leaves and _node_gone(node.node_id):
            time.sleep(1.0)    # satellites cancelled together leave together: take them all at once
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            gone = [n for n in self.pool.nodes if n.node_id not in alive]
            self.resize(replace(self.pool, nodes=[n for n in self.pool.nodes if n.node_id in alive]),
                        "; ".join(f"{n.origin} left ({n.name})" for n in gone) + f" during {method}")
        else:
            self.rebuild(f"rank {rank} died during {method}: {reason}")

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
        self._retire(self.actors)
        ranks = set(range(len(self.actors)))
        if self.standby:
            hosts, self.standby = self.standby, []
            self._form(hosts, ranks, self.gpu_ids)
        else:
            self._form([self._host(r) for r in ranks], ranks)
        self._restore()
        self._set_state("alive")
        log.warning("role %s: rebuilt in %.2f s", self.name, time.monotonic() - t0)

    def resize(self, pool: ResourcePool, why: str) -> dict:
        """The group on the nodes of `pool`: ranks on nodes that left end, nodes that joined get new
        ranks (built from the roles' __init__, then the restore hooks run on the whole group), the
        others keep their processes and state; ranks are laid out node by node again."""
        if pool.processes_per_node != self.pool.processes_per_node:
            raise ResourcePoolError(f"role {self.name}: {pool.processes_per_node} processes per node on the new nodes, "
                                    f"{self.pool.processes_per_node} on the group's (GPUs per node differ)")
        t0, before = time.monotonic(), len(self.actors)
        ranks_of: dict[str, list] = {}
        for r, a in enumerate(self.actors):
            ranks_of.setdefault(self.pool.node_of(r).node_id, []).append(a)
        staying = {n.node_id for n in pool.nodes}
        joining = [n for n in pool.nodes if n.node_id not in ranks_of]
        # a node that cannot take its processes soon is refused, and the group stays as it was
        self.pgs.update(pool.placement_groups(joining, len(self.workers), timeout_s=30) if joining else {})
        self._set_state("resizing")
        for node in self.pool.nodes:
            if node.node_id not in staying:
                self._retire(ranks_of.pop(node.node_id))
                ray.util.remove_placement_group(self.pgs.pop(node.node_id))
        self.pool, hosts, fresh = pool, [], set()
        for node in pool.nodes:
            for kept in ranks_of.get(node.node_id) or [None] * pool.processes_per_node:
                if kept is None:
                    fresh.add(len(hosts))
                hosts.append(kept or self._host(len(hosts)))
        self._form(hosts, fresh)
        self._restore()
        info = {"from": before, "to": len(hosts), "why": why, "seconds": round(time.monotonic() - t0, 2),
                "nodes": [f"{n.name} ({n.origin})" for n in pool.nodes]}
        self._set_state("alive")
        log.info("role %s: %s; %d -> %d ranks in %.2f s", self.name, why, before, len(hosts), info["seconds"])
        for listener in self.resize_listeners:
            listener(info)
        return info

    def _restore(self) -> None:
        """New processes: each role's state back, the state-changing calls made since then made
        again, in order, then the hooks that wait for the state (weights to a rollout)."""
        for hook in self.state_hooks:
            hook()
        for _, call in sorted(self.calls_since, key=lambda c: c[0]):
            GroupFuture(call.method, call.args, call.kwargs, again=True).result()
        for hook in self.restore_hooks:
            hook()

    def shutdown(self) -> None:
        for a in self.actors + self.standby:
            ray.kill(a, no_restart=True)
        for pg in self.pgs.values():
            ray.util.remove_placement_group(pg)


def follow_nodes(groups) -> None:
    """Every elastic group among `groups` follows its nodes, from one look at the cluster."""
    elastic = [wg for wg in groups if wg.elastic]
    if elastic:
        nodes = ray.nodes()
        for wg in elastic:
            wg.follow_nodes(nodes)


def _node_gone(node_id: str, timeout_s: float = 30.0) -> bool:
    """Whether a node whose process just died has left the Ray cluster: a node that stops says so
    at once, a lost one after Ray's health checks give up on it (within the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return True
        time.sleep(0.2)
    return False


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

    @property
    def elastic(self) -> bool:
        """Whether ranks may join and leave while the run goes on (the worker class's `elastic`)."""
        return self._hosts.elastic

    def follow_nodes(self, ray_nodes: list[dict] | None = None) -> dict | None:
        """An elastic group, resized to the nodes that carry its role now (a satellite joined or
        left); what changed (hosts.resize's record), or None when nothing did. A node whose
        processes cannot be placed is left out (ResourcePoolError says so) until it leaves."""
        h = self._hosts
        pool = ResourcePool.for_role(h.pool.role, h.pool.processes_per_node, h.pool.max_colocate_count, ray_nodes,
                                     h.pool.uses_gpus)
        pool.nodes = [n for n in pool.nodes if n.node_id not in h.unplaceable]
        before, now = {n.node_id: n for n in h.pool.nodes}, {n.node_id: n for n in pool.nodes}
        if before.keys() == now.keys():
            return None
        joined = [n for i, n in now.items() if i not in before]
        why = "; ".join([f"{n.origin} joined ({n.name})" for n in joined] +
                        [f"{n.origin} left ({n.name})" for i, n in before.items() if i not in now])
        try:
            return h.resize(pool, why)
        except ResourcePoolError:
            h.unplaceable.update(n.node_id for n in joined)
            raise

    def on_resize(self, listener: Callable[[dict], None]) -> None:
        """Call listener with what each resize did: from, to (world sizes), why, seconds, nodes."""
        self._hosts.resize_listeners.append(listener)

    def shares_processes_with(self, other: WorkerGroup) -> bool:
        """Colocated with `other`: their calls run one after the other in the same processes."""
        return self._hosts is other._hosts

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self._hosts.actors])

    def on_restore(self, hook: Callable[[], None]) -> None:
        """Run hook to put this role's state back in its rebuilt processes (a snapshot, a checkpoint);
        the state-changing calls that returned since that state was taken are made again after it."""
        self._hosts.state_hooks.append(hook)

    def on_restart(self, hook: Callable[[], None]) -> None:
        """Run hook after this group's processes were rebuilt and their state is back."""
        self._hosts.restore_hooks.append(hook)

    def calls_issued(self) -> int:
        """How many state-changing calls this group's processes have been given: the position to
        give forget_calls once a snapshot or checkpoint taken now holds their effect."""
        return self._hosts.calls_issued

    def forget_calls(self, upto: int) -> None:
        """This role's state, taken at position `upto` (calls_issued()), holds the effect of its
        state-changing calls up to there: a rebuild that restores that state need not make them again."""
        h = self._hosts
        h.held[self] = max(upto, h.held.get(self, 0))
        h.calls_since = [(n, c) for n, c in h.calls_since if n > upto or c.method.wg is not self]

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call listener when the group starts or finishes a rebuild, or one of its calls fails."""
        self._hosts.listeners.append(listener)

    def describe(self) -> dict:
        """Where the ranks run and how the group fares, from what the driver already knows (no Ray call)."""
        h = self._hosts
        return {"world_size": self.world_size, "state": h.state, "restarts": h.restarts_total,
                "last_error": h.last_error, "process": h.name, "elastic": h.elastic,
                "ranks": [{"rank": r, "node_ip": h.pool.node_of(r).ip, "node": h.pool.node_of(r).name,
                           "origin": h.pool.node_of(r).origin, "pid": pid} for r, pid in enumerate(h.pids)]}

    def shutdown(self) -> None:
        self._hosts.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role}, {self.worker_cls.__name__}, world_size={self.world_size})"


class GroupMethod:
    def __init__(self, wg: WorkerGroup, name: str, mode: DispatchMode):
        self.wg, self.name, self.mode = wg, name, mode
        fn = getattr(wg.worker_cls, name)
        self.changes_state, self.keeps = fn.__hpcrl_changes_state__, fn.__hpcrl_keeps__

    def __call__(self, *args, **kwargs):
        return self.future(*args, **kwargs).result()

    def future(self, *args, **kwargs) -> GroupFuture:
        return GroupFuture(self, args, kwargs)

    def issue(self, args, kwargs) -> tuple[list, list]:
        """The ranks' result refs, and (a `keeps` method) their kept refs."""
        actors = self.wg._hosts.actors
        per_rank = self.mode.split(len(actors), args, kwargs)
        refs = [actors[r].execute.options(num_returns=2 if self.keeps else 1).remote(self.wg.role, self.name, *a, **k)
                for r, call in enumerate(per_rank) if call is not None for a, k in [call]]
        return ([r for r, _ in refs], [k for _, k in refs]) if self.keeps else (refs, [])


class GroupFuture:
    """The ranks' object refs of one group call. `.result()` collects (rebuilding the group and
    calling again if one of its processes died); passed to another group's call it is sent as refs.
    `kept`: a `keeps` method's kept refs, one per rank. again: the call is made again after a rebuild
    (it was kept once already)."""

    def __init__(self, method: GroupMethod, args: tuple, kwargs: dict, again: bool = False):
        self.method, self.args, self.kwargs = method, args, kwargs
        self.number = None          # a state-changing call's place among its processes' calls, until it is kept
        if method.changes_state and not again:
            hosts = method.wg._hosts
            hosts.calls_issued += 1
            self.number = hosts.calls_issued
        self.refs, self.kept = method.issue(args, kwargs)

    def result(self) -> Any:
        while True:
            try:
                out = self.method.mode.collect(ray.get(self.refs))
                hosts = self.method.wg._hosts
                if self.number is not None and self.number > hosts.held.get(self.method.wg, 0):
                    hosts.calls_since.append((self.number, self))    # until a snapshot or checkpoint holds it
                self.number = None
                return out
            except RayActorError as e:
                self.recover(e)
            except RayTaskError as e:    # the role's own code raised: the run stops; say where first
                if (died := self._rank_that_died()) is not None:
                    self.recover(died)
                    continue
                hosts = self.method.wg._hosts
                hosts._set_state(hosts.state, f"{self.method.name}: {_last_line(e)}")
                raise

    def _rank_that_died(self, grace_s: float = 10.0) -> RayActorError | None:
        """A rank whose process died, among this call's: its peers in a collective then fail with
        errors of their own (gloo's "Connection reset by peer"), which may arrive first. The death,
        not their errors, is what happened; Ray says so within a second or two."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                return e
            except RayTaskError:
                pass
        return None

    def recover(self, error: RayActorError) -> None:
        """Rebuild whichever group lost the process named by error (ours or an input's), call again."""
        hosts = self.method.wg._hosts
        rank = hosts.owns(error.actor_id)
        if rank is not None:
            hosts.lost(rank, self.method.name, _reason(error))
        elif error.actor_id not in hosts.retired and not self._recover_inputs(error):
            raise error
        self.refs, self.kept = self.method.issue(self.args, self.kwargs)

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
    """A role's error in one line: its own type and message's last line (not Ray's wrapping)."""
    cause = getattr(error, "cause", None) or error
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1]}" if lines else type(cause).__name__


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
