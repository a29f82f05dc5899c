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

Every wait has a deadline (hpcrl/controller/deadline.py: learned per kind of call from the run):
ranks that have not answered a call by then are hung; their Python threads' stacks go to their
roles' logs and `describe()`, and they take the path of a dead process (rebuilt with their state,
the call made again); past `restart_limit`, RoleHung. A stop request (`stop_when`) seen while a call
runs past its slowest recent time abandons it (CallAbandoned): the driver commits its last step
boundary instead (`roll_back` gives a group the state it had there).
With `standby=True` every rank has an idle process beside it (torch imported, and what the
roles' warm_up imports: a model's code; nothing reserved) that takes its place, so a rebuild pays no
process start and no imports; `"auto"`: where the processes run on CUDA devices.

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

from hpcrl.controller.batch import Batch
from hpcrl.controller.deadline import CallDeadlines, DeadlinePolicy
from hpcrl.controller.dispatch import DispatchMode, registered_methods
from hpcrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hpcrl.controller.stacks import hung_stacks
from hpcrl.controller.worker import WorkerHost

log = logging.getLogger("hpcrl.controller")

WorkerSpec = tuple[type, tuple, dict]   # (worker class, init args, init kwargs)


class RoleRestartLimit(RuntimeError):
    """A role died more often than its restart limit allows; the run cannot go on."""


class RoleHung(RoleRestartLimit):
    """Ranks of a role missed a call's deadline once more than the restart limit allows: the driver
    stops at its last step boundary, committed (role, call and ranks in the message)."""

    def __init__(self, message: str, role: str, method: str, ranks: list[int]):
        super().__init__(message)
        self.role, self.method, self.ranks = role, method, ranks


class CallAbandoned(RuntimeError):
    """A stop was asked for (signal, deadline, cancel) while a call ran past the time its kind
    takes: the call is given up, its processes left busy; the driver commits its last step boundary."""


class RoleStateLost(RuntimeError):
    """A rebuilt role's state could not be had (it went with its node): the run stops, to resume
    every role from the newest committed step rather than mix states."""


class _HostSet:
    """The actor processes behind one WorkerGroup, or behind several colocated ones."""

    def __init__(self, pool: ResourcePool, workers: dict[str, WorkerSpec], log_dir, restart_limit: int,
                 dist_timeout_s: float, standby: bool | str, deadlines: DeadlinePolicy | None = None):
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
        self.deadlines = CallDeadlines(deadlines)
        self.stop_check: Callable[[], str | None] = lambda: None   # why to give up a slow call, or None
        self.last_hang: dict | None = None
        self.busy = False          # a call was abandoned or hung past the limit: its processes may still run it
        self.hang_listeners: list[Callable[[dict], None]] = []       # told of each missed deadline
        self.deadline_listeners: list[Callable[[str, float], None]] = []   # told of each learned deadline
        self.resize_listeners: list[Callable[[dict], None]] = []   # told what each resize did
        self.pgs = pool.placement_groups(pool.nodes, len(workers))
        self.standby_setting = standby
        self.devices: list[str] = []
        self.standby: list = []
        self.standby_warm: list = []     # each standby's warm-up, as a future
        self.standby_started = False     # start_standby: after the run's start, not competing with it
        self.standby_rehearsed = False   # whether the standby processes were given their ranks' layer calls
        self.last_restore: dict = {}     # _restore's parts, seconds
        self.retired: set[str] = set()   # actor ids replaced by a rebuild: errors from them are old news
        self.unplaceable: set[str] = set()   # nodes that joined but could not take the group's processes
        self._form([self._host(r) for r in range(pool.world_size)], fresh=set(range(pool.world_size)))
        self._set_state("alive")

    @property
    def elastic(self) -> bool:
        """Ranks may join and leave between calls: one role whose worker class says so (no state of
        its own beyond its __init__ and the group's restore hooks)."""
        return len(self.workers) == 1 and all(getattr(cls, "elastic", False) for cls, _, _ in self.workers.values())

    @property
    def keep_standby(self) -> bool:
        """Whether the ranks keep standby processes; "auto": where they run on CUDA devices, whose
        rebuild costs most (a model's imports, torch.compile's), not on CPUs (nor a test cluster's
        GPUs that are only Slurm's count)."""
        if self.standby_setting == "auto":
            return any(d.startswith("cuda") for d in self.devices)
        return bool(self.standby_setting)

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
        try:
            master = self._formed([hosts[0].rendezvous.remote()], "rendezvous")[0]
            done = self._formed([h.setup.remote(r, n, master, self.workers, threads, gpu_ids[r] if gpu_ids else None,
                                                self.dist_timeout_s) if r in fresh else
                                 h.regroup.remote(r, n, master, self.dist_timeout_s) for r, h in enumerate(hosts)], "setup")
        except RoleHung:
            self._retire(hosts)      # stuck starting: they would hold their resources until the job ends
            raise
        self.actors, self.pids, self.gpu_ids, self.devices = hosts, *map(list, zip(*done))
        self.deadlines.new_processes()
        self._replace_standby()

    def _formed(self, refs: list, step: str) -> list:
        """The answers of a formation step (rank = position), within train.deadlines.first: a rank
        that does not answer (stuck in its __init__, a rendezvous that never completes) fails the start."""
        kind = f"{self.name}.{step}"
        pending = self.await_ranks(refs, list(range(len(refs))), kind, time.monotonic(), stoppable=False)
        if pending:
            raise RoleHung(f"role {self.name}: ranks {pending} did not finish {step} within "
                           f"{self.deadlines.deadline(kind):.0f} s (train.deadlines.first)", self.name, step, pending)
        return ray.get(refs)

    def await_ranks(self, refs: list, ranks: list[int], kind: str, since: float, stoppable: bool = True) -> list[int]:
        """Wait until every ref is ready (a value or an error), at most the deadline of `kind` from
        `since` (time.monotonic()): the ranks still pending then, or [] when all answered in time. A
        stop request raises CallAbandoned once the call runs past its stop grace (stoppable calls)."""
        deadline = self.deadlines.deadline(kind)
        while True:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=POLL_S, fetch_local=False)
            if not pending:
                return []
            waited = time.monotonic() - since
            late = [ranks[refs.index(p)] for p in pending]
            if stoppable and (reason := self.stop_check()) and waited > self.deadlines.stop_grace(kind):
                self.busy = True
                raise CallAbandoned(f"{reason}: {kind} of ranks {late} had run {waited:.0f} s (longer than its "
                                    f"calls take), so it was given up")
            if waited > deadline:
                return late

    def called(self, kind: str, seconds: float) -> None:
        """A call of `kind` answered after `seconds`: learned from, and a new deadline said."""
        if (learned := self.deadlines.took(kind, seconds)) is not None:
            for listener in self.deadline_listeners:
                listener(kind, learned)

    def hung(self, ranks: list[int], kind: str, waited: float) -> None:
        """`ranks` missed the deadline of a call of `kind`: their stacks recorded, then the group
        rebuilt as for a dead process (RoleHung past the restart limit, the processes left as they are)."""
        deadline = self.deadlines.deadline(kind)
        stacks = hung_stacks({r: (self.pool.node_of(r).node_id, self.pids[r]) for r in ranks}, self.log_dir,
                             list(self.workers), f"{kind} missed its deadline of {deadline:.0f} s")
        self.last_hang = {"time": round(time.time(), 3), "call": kind, "ranks": ranks, "deadline_s": round(deadline, 1),
                          "waited_s": round(waited, 1), "stacks": {str(r): text[-STACKS_KEPT:] for r, text in stacks.items()}}
        for listener in self.hang_listeners:
            listener(self.last_hang)
        try:
            self.rebuild(f"ranks {ranks} did not answer {kind} within its deadline of {deadline:.0f} s")
        except RoleRestartLimit as e:
            self.busy = True
            raise RoleHung(str(e), self.name, kind, ranks) from None

    def start_standby(self) -> None:
        """Called after each step. The standby processes, once the run has started (their imports would
        slow its start down: on a GPU node through Slurm, beside the roles' own imports and compiles);
        a step later, once the ranks have called their compiled layers, each standby rehearses its
        rank's calls (WorkerHost.rehearse)."""
        if not self.keep_standby:
            return
        if not self.standby_started:
            self.standby_started = True
            self._replace_standby()
        elif self.standby and not self.standby_rehearsed:
            self.standby_rehearsed = True
            # queued behind each one's warm-up; the rank answers between its calls
            self.standby_warm = [host.rehearse.remote(self.gpu_ids[r], self.devices[r],
                                                      self.actors[r].layer_calls.remote()).future()
                                 for r, host in enumerate(self.standby)]

    def _replace_standby(self) -> None:
        if not self.standby_started:
            return
        for a in self.standby:
            ray.kill(a, no_restart=True)
        self.standby = [self._host(r, standby=True) for r in range(len(self.actors))] if self.keep_standby else []
        self.standby_rehearsed = False
        # meanwhile, idle: nothing waits for it; whether each is warm is read from its future, no Ray call
        self.standby_warm = [host.warm.remote(self.workers).future() for host in self.standby]

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
        self.busy = False
        self._set_state("restarting", why)
        log.warning("role %s: %s; rebuilding it (restart %d of %d allowed per hour)",
                    self.name, why, len(self.restarts), self.restart_limit)
        t0 = time.monotonic()
        self._retire(self.actors)
        ranks = set(range(len(self.actors)))
        if self.standby:
            hosts, self.standby, self.standby_warm = self.standby, [], []
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

    def _restore(self, then: bool = True) -> None:
        """New processes: each role's state back, the state-changing calls made since then made
        again, in order, then (then=True) the hooks that wait for the state (weights to a rollout).
        How long each part took: last_restore."""
        t0 = time.monotonic()
        for hook in self.state_hooks:
            hook()
        t1 = time.monotonic()
        calls = sorted(self.calls_since, key=lambda c: c[0])
        for _, call in calls:
            GroupFuture(call.method, call.args, call.kwargs, again=True).result()
        t2 = time.monotonic()
        if then:
            for hook in self.restore_hooks:
                hook()
        self.last_restore = {"state": round(t1 - t0, 3), "replay": round(t2 - t1, 3), "calls": len(calls),
                             "after": round(time.monotonic() - t2, 3)}

    def roll_back(self, upto: dict) -> None:
        """New processes holding each role's state as it was when its calls_issued() was upto[role's
        WorkerGroup] (a step boundary): its snapshot or checkpoint, then its calls up to there. For a
        stop that commits that boundary; not counted as a restart, no restart hooks (nothing follows)."""
        log.warning("role %s: going back to its state of the last step boundary", self.name)
        self.calls_since = [(n, c) for n, c in self.calls_since if n <= upto.get(c.method.wg, n)]
        self._retire(self.actors)
        self._form([self._host(r) for r in range(len(self.actors))], set(range(len(self.actors))))
        self._restore(then=False)
        self.busy = False

    def replay_size(self) -> tuple[int, int]:
        """The calls kept to make again after a rebuild, and the bytes of their Batch arguments."""
        return len(self.calls_since), sum(_nbytes(a) for _, c in self.calls_since for a in (*c.args, *c.kwargs.values()))

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
                 standby: bool | str = False, deadlines: DeadlinePolicy | None = None, _hosts: _HostSet | None = None):
        self.role = role or pool.role
        self.worker_cls = worker_cls
        self._hosts = _hosts or _HostSet(pool, {self.role: (worker_cls, tuple(init_args), dict(init_kwargs or {}))},
                                         log_dir, restart_limit, dist_timeout_s, standby, deadlines)
        for name, mode in registered_methods(worker_cls).items():
            setattr(self, name, GroupMethod(self, name, mode))

    @classmethod
    def colocated(cls, pool: ResourcePool, workers: dict[str, WorkerSpec], *, log_dir=None, restart_limit: int = 3,
                  dist_timeout_s: float = 600.0, standby: bool | str = False,
                  deadlines: DeadlinePolicy | None = None) -> dict[str, WorkerGroup]:
        """Several roles in one process per rank; one WorkerGroup per role, as if they were apart."""
        workers = {role: (c, tuple(a), dict(k)) for role, (c, a, k) in workers.items()}
        hosts = _HostSet(pool, workers, log_dir, restart_limit, dist_timeout_s, standby, deadlines)
        return {role: cls(pool, c, role=role, _hosts=hosts) for role, (c, _, _) in workers.items()}

    @property
    def world_size(self) -> int:
        return len(self._hosts.actors)

    @property
    def on_cuda(self) -> bool:
        """Whether its ranks run on CUDA devices (not a test cluster's GPUs that are only Slurm's count)."""
        return any(d.startswith("cuda") for d in self._hosts.devices)

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

    def start_standby(self) -> None:
        """Start the standby processes (`standby`), once the run's start is over: RunContext.end_step
        calls it after the first step."""
        self._hosts.start_standby()

    def startup(self) -> list[dict]:
        """Per rank, how its process started: {"started": Unix time, "phases": [(phase, ended, took), ...]}
        (hpcrl.controller.startup), this role's phases only."""
        return [{"started": s["started"], "phases": s["phases"].get(self.role, [])}
                for s in ray.get([a.startup.remote() for a in self._hosts.actors])]

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

    def stop_when(self, check: Callable[[], str | None]) -> None:
        """check() says why to stop (StopRequest.check), or None: a call of this group's processes
        then running past its stop grace is given up (CallAbandoned)."""
        self._hosts.stop_check = check

    def on_hang(self, listener: Callable[[dict], None]) -> None:
        """Call listener with each missed deadline: time, call, ranks, deadline_s, waited_s, stacks."""
        self._hosts.hang_listeners.append(listener)

    def on_deadline(self, listener: Callable[[str, float], None]) -> None:
        """Call listener(kind, seconds) when a kind of call's learned deadline is first known or has changed."""
        self._hosts.deadline_listeners.append(listener)

    def busy(self) -> bool:
        """A call of its processes was given up (a stop, or a hang past the restart limit): they may
        still be running it, and hold a state past the last one the driver knows."""
        return self._hosts.busy

    def roll_back(self, upto: dict[WorkerGroup, int]) -> None:
        """See _HostSet.roll_back: each role sharing these processes back to its position in `upto`."""
        self._hosts.roll_back(upto)

    def replay_size(self) -> tuple[int, int]:
        """(calls, bytes) kept to make again after a rebuild, until a snapshot or checkpoint holds them."""
        return self._hosts.replay_size()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call listener when the group starts or finishes a rebuild, or one of its calls fails."""
        self._hosts.listeners.append(listener)

    def describe(self) -> dict:
        """Where the ranks run and how the group fares, from what the driver already knows (no Ray call)."""
        h = self._hosts
        return {"world_size": self.world_size, "state": h.state, "restarts": h.restarts_total,
                "last_error": h.last_error, "process": h.name, "elastic": h.elastic, "last_hang": h.last_hang,
                "last_restore": h.last_restore,
                "standby": {"processes": len(h.standby),
                            "ready": sum(f.done() and not f.exception() for f in h.standby_warm)},
                "deadlines": h.deadlines.describe(),
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

    def issue(self, args, kwargs) -> tuple[list, list, list[int]]:
        """The ranks' result refs, (a `keeps` method) their kept refs, and the ranks called."""
        actors = self.wg._hosts.actors
        per_rank = self.mode.split(len(actors), args, kwargs)
        ranks = [r for r, call in enumerate(per_rank) if call is not None]
        refs = [actors[r].execute.options(num_returns=2 if self.keeps else 1).remote(self.wg.role, self.name, *a, **k)
                for r in ranks for a, k in [per_rank[r]]]
        return ([r for r, _ in refs], [k for _, k in refs], ranks) if self.keeps else (refs, [], ranks)


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
        self.kind = f"{method.wg.role}.{method.name}"
        self._issue()

    def _issue(self) -> None:
        self.refs, self.kept, self.ranks = self.method.issue(self.args, self.kwargs)
        self.since = time.monotonic()
        self.issues = getattr(self, "issues", 0) + 1
        self.inputs_at = [a.issues for a in self._inputs()]    # input futures made again since are followed

    def _inputs(self) -> list[GroupFuture]:
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, GroupFuture)]

    def wait(self) -> bool:
        """Until every rank has answered (a value or an error), its inputs first: ranks past the
        call's deadline are hung (their group rebuilt, the call made again: see _HostSet.hung).
        Whether it had to wait (False: all there already)."""
        hosts = self.method.wg._hosts
        if any([a.wait() for a in self._inputs()]):
            self.since = max(self.since, time.monotonic())   # it could not start before its inputs were there
        if [a.issues for a in self._inputs()] != self.inputs_at:
            self._issue()          # an input was made again (its group hung): the call follows it
        if not ray.wait(self.refs, num_returns=len(self.refs), timeout=0, fetch_local=False)[1]:
            return False
        while pending := hosts.await_ranks(self.refs, self.ranks, self.kind, self.since):
            hosts.hung(pending, self.kind, time.monotonic() - self.since)
            self._issue()
        return True

    def result(self) -> Any:
        while True:
            try:
                self.wait()
                out = self.method.mode.collect(ray.get(self.refs))
                # (after a rebuild of its group, the call is a cold one again: marked, not learned from)
                self.method.wg._hosts.called(self.kind, time.monotonic() - self.since)
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
        self._issue()

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


POLL_S = 0.5          # how often a wait looks at the deadline and the stop request
STACKS_KEPT = 8000    # characters of each rank's stacks in describe() (the log has them whole)


def _nbytes(value) -> int:
    if isinstance(value, Batch):
        return sum(t.numel() * t.element_size() for t in value.tensors.values()) + sum(a.nbytes for a in value.arrays.values())
    return 0


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
