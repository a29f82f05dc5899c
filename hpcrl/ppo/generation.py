"""A step's batch in the making, and the weights it is generated with: the pipelining bookkeeping
of the built-in loop (hpcrl/ppo/loop.py).

    Lookahead    the batches generated ahead of the step in training (`train.rollout.max_staleness`
                 with `pipeline: one_step_off`, none otherwise), each with the scoring that needs no
                 trained weights issued as soon as it exists
    WeightSync   the actor's weights to the engine that generates: the rollout role's (sent as a
                 future its next generation waits behind) or the actor's own, and again after that
                 role is rebuilt or resized
"""
from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch


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
    by `generator`; `early`: the scoring methods issued on each as soon as it is generated."""

    def __init__(self, dataset, generator: WorkerGroup, early: list, n_samples: int, lead: int, total_steps: int):
        self.dataset, self.generator, self.early = dataset, generator, early
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

    def _generate(self, step: int) -> Generation:
        prompts = self.dataset.next_batch()
        if self.n_samples > 1:
            groups = len(prompts)
            prompts = prompts.repeat(self.n_samples)
            prompts["group"] = np.repeat(np.arange(groups), self.n_samples)
        prompts.meta["step"] = step
        generated = self.generator.generate_sequences.future(prompts)
        return Generation(step, generated, [m.future(generated) for m in self.early])


class WeightSync:
    """The actor's weights to the generating engine. `version`: the step whose actor update made
    the weights the engine has (0: the initial ones)."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup | None, version: int = 0):
        self.actor, self.rollout, self.version = actor, rollout, version
        self.sampling = rollout.sampling_dtype() if rollout else None
        # where the rollout's ranks run: on the GPU of the actor's rank 0 the weights stay on the
        # device. Asked again only when the rollout is rebuilt or resized: asked at every send, it
        # would wait behind the generation in flight on the rollout's processes (pipelined steps)
        self.rollout_at = rollout.placement() if rollout else None
        self.pending = None

    def send(self, version: int, wait: bool = True) -> None:
        """The weights of step `version` to the engine; to the rollout role without `wait`, they are
        on their way (its next generation waits behind them) until `arrived`."""
        self.version = version
        if self.rollout is None:
            self.actor.sync_rollout_weights(version)
            return
        self.pending = self.rollout.load_weights.future(self.actor.export_weights.future(self.sampling, self.rollout_at),
                                                        version)
        if wait:
            self.arrived()

    def arrived(self) -> None:
        """Back once the weights sent last are in the engine."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def resend(self) -> None:
        """The current weights again, after the generating role was rebuilt or resized (it may now
        run elsewhere), or after a resume."""
        if self.rollout:
            self.rollout_at = self.rollout.placement()
        self.send(self.version)
