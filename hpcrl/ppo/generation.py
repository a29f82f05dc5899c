"""A step's batch in the making, and the weights it is generated with: the pipelining bookkeeping
of the built-in loop (hpcrl/ppo/loop.py).

    Lookahead    the batches generated ahead of the step in training (`train.rollout.max_staleness`
                 with `pipeline: one_step_off`, none otherwise), each with the scoring that needs no
                 trained weights issued as soon as it exists
    WeightSync   the actor's weights to the engine that generates: the rollout role's (sent as a
                 future its next generation waits behind; by CUDA IPC, a collective group or Ray's
                 object store) or the actor's own, and again after either role is rebuilt or resized
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable

import numpy as np

from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch
from hpcrl.controller.device_weights import shares_gpu
from hpcrl.controller.weight_transport import Rendezvous, Ticket, backend_for, node_address
from hpcrl.ppo.config import RolloutSettings


@dataclasses.dataclass
class Generation:
    """One step's batch in the making: its generation (a future until collected, or a Batch read
    back from a checkpoint) and the scores issued on it as soon as it was generated."""
    step: int
    generated: object             # GroupFuture or Batch
    scored: list                  # GroupFutures of weight-free roles on it

    def collect(self) -> Batch:
        batch = self.generated if isinstance(self.generated, Batch) else self.generated.result()
        for f in self.scored:
            batch = batch.union(f.result())
        self.generated, self.scored = batch, []
        return batch


class Lookahead:
    """The batches of the steps after the one in training, `lead` of them, generated from `dataset`
    by `generate` (prompts -> a future of the batch, or the batch: multi-turn episodes are made on
    the driver, turn by turn); `early`: the scoring methods issued on each as soon as it is generated."""

    def __init__(self, dataset, generate: Callable, early: list, n_samples: int, lead: int, total_steps: int):
        self.dataset, self.generate, self.early = dataset, generate, early
        self.n_samples, self.lead, self.total_steps = n_samples, lead, total_steps
        self.ahead: deque[Generation] = deque()
        self.issued = 0                   # the last step whose generation was issued

    def resume(self, step: int, inflight: list[Batch]) -> None:
        """Continue after `step` with the batches a checkpoint kept (generated before it was taken)."""
        self.ahead.extend(Generation(b.meta["step"], b, []) for b in inflight)
        self.issued = step + len(inflight)

    def take(self, step: int) -> Generation:
        """This step's batch in the making, after issuing the next `lead` ones, so the rollout never waits."""
        while self.issued < min(step + self.lead, self.total_steps):
            self.issued += 1
            self.ahead.append(self._generate(self.issued))
        return self.ahead.popleft()

    def steps(self) -> list[int]:
        """The steps whose batches are being generated ahead."""
        return [g.step for g in self.ahead]

    def collect(self) -> list[Batch]:
        """The batches generated ahead, waited for (a checkpoint keeps them: a resumed run could not
        make them again)."""
        return [g.collect() for g in self.ahead]

    def held(self) -> Callable[[], list[Batch]]:
        """collect() of the batches generated ahead now, to call later (a stop that commits this step
        boundary after the next step began)."""
        ahead = list(self.ahead)
        return lambda: [g.collect() for g in ahead]

    def refill(self, step: int, draw: int) -> Generation:
        """One more batch for `step` (dynamic sampling's refill number `draw`), from the next prompts;
        its groups numbered after those of the batches before it."""
        return self._generate(step, draw)

    def _generate(self, step: int, draw: int = 0) -> Generation:
        prompts = self.dataset.next_batch()
        if self.n_samples > 1:
            groups = len(prompts)
            prompts = prompts.repeat(self.n_samples)
            prompts["group"] = np.repeat(np.arange(groups) + draw * groups, self.n_samples)
        prompts.meta.update(step=step, **({"draw": draw} if draw else {}))
        generated = self.generate(prompts)
        return Generation(step, generated, [m.future(generated) for m in self.early])


class WeightSync:
    """The actor's weights to the generating engine. `version`: the step whose actor update made
    the weights the engine has (0: the initial ones). With a rollout role, `settings`
    (train.rollout) choose the route (`weight_transport`), and `said` hears which one the weights
    take each time it is chosen: at the start, and after either role was rebuilt or resized."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup | None, settings: RolloutSettings,
                 said: Callable[[dict], None] = lambda route: None, version: int = 0):
        self.actor, self.rollout, self.version = actor, rollout, version
        self.transport, self.timeout_s, self.said = settings.weight_transport, settings.weight_sync_timeout, said
        self.sampling = rollout.sampling_dtype() if rollout else None
        self.rendezvous: Rendezvous | None = None     # the driver's store, made at the first collective route
        self.ticket: Ticket | None = None
        self.pending: list = []
        if rollout:
            self.connect()

    def connect(self) -> None:
        """Choose the route from where the ranks run, and form the group when it is the collective:
        at the start and after a rebuild or resize, when the rollout's ranks are idle. Asked at
        every send, it would wait behind the generation in flight (pipelined steps)."""
        t0 = time.perf_counter()
        self.rollout_at = self.rollout.placement()
        sender = self.actor.placement()
        if self.transport == "auto" and shares_gpu(sender, self.rollout_at):
            self.route = "cuda_ipc"
        elif self.transport == "object_store" or any((r.host, r.pid) == (sender.host, sender.pid) for r in self.rollout_at):
            self.route = "object_store"     # also where the two roles share processes: one process is one rank
        else:
            self.route = "collective"
        backend = backend_for([sender, *self.rollout_at]) if self.route == "collective" else None
        self.ticket = None
        if backend:
            self.rendezvous = self.rendezvous or Rendezvous(node_address())
            ranks = [(self.actor.role, self.actor.describe()["ranks"][0])] + \
                [(self.rollout.role, r) for r in self.rollout.describe()["ranks"]]
            self.ticket = self.rendezvous.ticket([f"{role} rank {r['rank']} ({r['node']})" for role, r in ranks],
                                                 backend, self.timeout_s)
            joins = [self.rollout.join_weight_group.future(self.ticket), self.actor.join_weight_group.future(self.ticket)]
            for join in joins:
                join.result()
        self.said({"path": self.route, "backend": backend, "receivers": len(self.rollout_at),
                   "seconds": round(time.perf_counter() - t0, 3)})

    def send(self, version: int, wait: bool = True) -> None:
        """The weights of step `version` to the engine; to the rollout role without `wait`, they are
        on their way (its next generation waits behind them) until `arrived`."""
        self.version = version
        if self.rollout is None:
            self.actor.sync_rollout_weights(version)
            return
        if self.route == "collective":
            # both at once: the sender's broadcast waits for the receivers
            self.pending = [self.rollout.receive_weights.future(self.ticket, version),
                            self.actor.send_weights.future(self.sampling, self.ticket)]
        else:
            to = self.rollout_at if self.route == "cuda_ipc" else ()
            self.pending = [self.rollout.load_weights.future(self.actor.export_weights.future(self.sampling, to), version)]
        if wait:
            self.arrived()

    def arrived(self) -> None:
        """Back once the weights sent last are in the engine. A transfer broken by a rank that died
        is made again by the rebuild's `resend`; one broken otherwise (a timeout) fails the run."""
        pending, self.pending, ticket = self.pending, [], self.ticket
        outcomes = [f.result() for f in pending]      # a lost process: its role is rebuilt, and resends
        said = [*outcomes[0], *outcomes[1:]] if outcomes else []     # the rollout's ranks', the sender's
        broken = [o for o in said if isinstance(o, str) and o.startswith("broken")]
        if broken and self.ticket is ticket:
            raise RuntimeError(f"weights of step {self.version} to the rollout role: {'; '.join(broken)}")

    def resend(self) -> None:
        """The current weights again, after either role was rebuilt or resized (they may now run
        elsewhere, and a group is re-formed)."""
        if self.rollout:
            self.connect()
        self.send(self.version)

