"""A step's batch in the making, and the weights it is generated with: the pipelining bookkeeping
of the built-in loop (hpcrl/ppo/loop.py).

    Lookahead    the batches generated ahead of the step in training (`train.rollout.max_staleness`
                 with `pipeline: one_step_off`, none otherwise), each with the scoring that needs no
                 trained weights issued as soon as it exists
    Producer     `pipeline: async`: the same buffer, filled by a thread that gives the rollout its
                 next batch the moment it has finished the one before, so it samples with the
                 newest weights and never waits for an update while the buffer has room
    SegmentedProducer  the same with `partial_rollout: continue`: the thread's calls go a segment
                 of tokens at a time, responses not finished going on in the next call beside new
                 prompts (hpcrl/ppo/partial_rollouts.py), and whole groups make the batches
    WeightSync   the actor's weights to the engine that generates: the rollout role's (sent as a
                 future its next generation waits behind; by CUDA IPC, a collective group or Ray's
                 object store) or the actor's own, and again after either role is rebuilt or resized
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import ray

from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch
from hpcrl.controller.device_weights import shares_gpu
from hpcrl.controller.weight_transport import Rendezvous, Ticket, backend_for, node_address
from hpcrl.ppo.config import RolloutSettings
from hpcrl.ppo.partial_rollouts import Row, absorb, continuation, rows_of, to_batch


@dataclasses.dataclass
class Generation:
    """One step's batch in the making: its generation (a future until collected, or a Batch read
    back from a checkpoint) and the scores issued on it as soon as it was generated."""
    step: int
    generated: object             # GroupFuture or Batch
    scored: list                  # GroupFutures of weight-free roles on it
    seconds: float | None = None  # from given to the rollout to generated (pipeline: async), where known

    def collect(self) -> Batch:
        batch = self.generated if isinstance(self.generated, Batch) else self.generated.result()
        for f in self.scored:
            batch = batch.union(f.result())
        self.generated, self.scored = batch, []
        return batch


def next_prompts(dataset, n_samples: int, block: int) -> Batch:
    """The dataset's next prompts, each repeated n_samples times with its group number, numbered
    from block × (prompts per batch) so that batches drawn for one step have distinct groups."""
    prompts = dataset.next_batch()
    if n_samples > 1:
        groups = len(prompts)
        prompts = prompts.repeat(n_samples)
        prompts["group"] = np.repeat(np.arange(groups) + block * groups, n_samples)
    return prompts


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

    def held(self) -> Callable[[], list[Batch]]:
        """The batches generated ahead now, to collect later (a checkpoint keeps them: a resumed run
        could not make them again; a stop that commits this step boundary after the next step began)."""
        ahead = list(self.ahead)
        return lambda: [g.collect() for g in ahead]

    def refill(self, step: int, draw: int) -> Generation:
        """One more batch for `step` (dynamic sampling's refill number `draw`), from the next prompts;
        its groups numbered after those of the batches before it."""
        return self._generate(step, draw)

    def _generate(self, step: int, draw: int = 0) -> Generation:
        prompts = next_prompts(self.dataset, self.n_samples, draw)
        prompts.meta.update(step=step, **({"draw": draw} if draw else {}))
        generated = self.generate(prompts)
        return Generation(step, generated, [m.future(generated) for m in self.early])


class VersionThroughput:
    """The rollout's throughput per version of the weights (`throughput/rollout_tokens_per_s`): the response
    tokens it sampled with the newest version it has used, over the seconds of its calls with it so far."""

    def __init__(self):
        self.sampled: dict[int, list] = {}      # version -> [tokens, seconds]

    def add(self, version: int, tokens: int, seconds: float) -> None:
        counts = self.sampled.setdefault(version, [0, 0.0])
        counts[0] += tokens
        counts[1] += seconds

    def said(self) -> dict:
        """The newest version's figure so far (its calls may go on); the older versions forgotten."""
        if not self.sampled:
            return {}
        version = max(self.sampled)
        self.sampled = {version: self.sampled[version]}
        tokens, seconds = self.sampled[version]
        return {"throughput/rollout_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
                "throughput/rollout_version": version}


class Producer:
    """`pipeline: async`: the rollout generates one batch after another into a buffer the trainer
    takes its batches from. The driver's thread draws the prompts, `bound` batches ahead of the one
    in training, and issues the scoring that needs no trained weights (`early`) on each batch once
    it is generated; a thread of its own gives the rollout the next drawn batch the moment the one
    before is generated. The rollout runs its calls in the order they come, so the weights the
    actor sent meanwhile are loaded first: each batch samples with the newest weights there are, and
    none waits for an update while the buffer has room (`timing/rollout_idle`: the time it did).

    The staleness bound holds at the source: a batch is drawn when the one `bound` places before it
    is taken, and trained at most `bound` steps later, so it trains at most `bound` updates after its
    weights, whichever weights it got; nothing is generated to be thrown away. Batches are numbered
    in the order they are drawn (the seed of their sampling, meta["step"]); a step's dynamic-sampling
    refill is the next batch of the buffer. Which weights a batch samples with depends on how fast
    each side runs; what is drawn, and so what a checkpoint keeps, does not."""

    def __init__(self, dataset, generate: Callable, early: list, n_samples: int, bound: int, total_steps: int):
        self.dataset, self.generate, self.early = dataset, generate, early
        self.n_samples, self.bound, self.total_steps = n_samples, bound, total_steps
        self.ahead: deque[Generation] = deque()      # drawn and not taken, in order
        self.waiting: deque[tuple[Generation, object]] = deque()     # drawn, not yet given to the rollout
        self.drawn = 0                   # the number of the last batch drawn
        self.scoring: set[int] = set()   # batches whose early scoring was issued
        self.idle = 0.0                  # seconds the rollout had nothing to generate, since the last report
        self.depth = 0                   # generated batches in the buffer when the last one was taken
        self.last_done: float | None = None
        self.throughput = VersionThroughput()
        self.taken: list[Generation] = []  # taken since the last measures(): their throughput said then
        self.changed = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None

    def resume(self, step: int, inflight: list[Batch]) -> None:
        """Continue after `step` with the batches a checkpoint kept (generated and scored early)."""
        self.ahead.extend(Generation(b.meta["step"], b, []) for b in inflight)
        self.scoring.update(g.step for g in self.ahead)
        self.drawn = max((g.step for g in self.ahead), default=step)

    def take(self, step: int) -> Generation:
        """The oldest batch of the buffer, after drawing up to `bound` more behind it (fewer near the end)."""
        while len(self.ahead) < 1 + min(self.bound, self.total_steps - step):
            self._draw()
        g = self.ahead.popleft()
        self._wait_issued(g)
        self._issue_scoring([g, *self.ahead])
        self.depth = sum(self._done(h) for h in (g, *self.ahead))
        self.taken.append(g)
        return g

    def refill(self, step: int, draw: int) -> Generation:
        """One more batch for `step` (dynamic sampling's refill `draw`): the next one of the buffer."""
        return self.take(step)

    def steps(self) -> list[int]:
        """The numbers of the batches in the buffer."""
        return [g.step for g in self.ahead]

    def held(self) -> Callable[[], list[Batch]]:
        """The batches of the buffer now, generated and scored early, to collect later (a checkpoint
        keeps them: a resumed run could not make them again)."""
        ahead = list(self.ahead)

        def collect() -> list[Batch]:
            for g in ahead:
                self._wait_issued(g)
            self._issue_scoring(ahead)
            return [g.collect() for g in ahead]
        return collect

    def measures(self) -> dict:
        """The buffer's metrics of the step that took its batch last, its batches collected
        (hpcrl/ppo/step_metrics.py)."""
        for g in self.taken:
            if isinstance(g.generated, Batch) and g.seconds is not None:
                self.throughput.add(int(g.generated.meta.get("policy_version", 0)),
                                    int(g.generated["response_mask"].sum()), g.seconds)
        self.taken = []
        with self.changed:
            idle, self.idle = self.idle, 0.0
            return {"buffer/depth": self.depth, "timing/rollout_idle": round(idle, 4), **self.throughput.said()}

    def close(self) -> None:
        """Stop giving the rollout batches (the one it is generating is not waited for)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join()

    def _draw(self) -> None:
        self.drawn += 1
        # group numbers unique across batches: a refill joins its step's batch
        prompts = next_prompts(self.dataset, self.n_samples, self.drawn)
        prompts.meta.update(step=self.drawn)
        g = Generation(self.drawn, None, [])
        self.ahead.append(g)
        with self.changed:
            self.waiting.append((g, prompts))
            self.changed.notify_all()
        if self.thread is None:
            self._start_thread()

    def _start_thread(self) -> None:
        self.thread = threading.Thread(target=self._produce, name="hpcrl-producer", daemon=True)
        self.thread.start()

    def _produce(self) -> None:
        """The thread: the next drawn batch to the rollout once it has generated the one before."""
        while True:
            with self.changed:
                while not self.waiting and not self.closed:
                    self.changed.wait()
                if self.closed:
                    return
                g, prompts = self.waiting.popleft()
                given = time.monotonic()
                if self.last_done is not None:
                    self.idle += given - self.last_done
                g.generated = self.generate(prompts)
                self.changed.notify_all()
            # (a rank that died answers with its error: the driver's collect rebuilds the role and asks again)
            while not self.closed and not self._done(g, timeout=1.0):
                pass
            self.last_done = time.monotonic()
            g.seconds = self.last_done - given

    def _wait_issued(self, g: Generation) -> None:
        """Until the rollout has been given `g`; once closed, given here (a checkpoint taken as the
        run stops keeps every batch drawn)."""
        with self.changed:
            while g.generated is None and not self.closed:
                self.changed.wait()
            if g.generated is None:
                prompts = next(p for w, p in self.waiting if w is g)
                self.waiting = deque((w, p) for w, p in self.waiting if w is not g)
                g.generated = self.generate(prompts)

    def _issue_scoring(self, batches: list[Generation]) -> None:
        """The early scoring of those of `batches` the rollout has been given, issued once (on the driver's thread)."""
        with self.changed:
            given = [g for g in batches if g.generated is not None and g.step not in self.scoring]
        for g in given:
            g.scored = [m.future(g.generated) for m in self.early]
            self.scoring.add(g.step)

    @staticmethod
    def _done(g: Generation, timeout: float = 0) -> bool:
        return g.generated is not None and (isinstance(g.generated, Batch) or _answered(g.generated, timeout))


class SegmentedProducer(Producer):
    """`pipeline: async` with `partial_rollout: continue`. The driver's thread draws prompts into a
    pool, as many groups ahead of the one in training as `bound` batches hold (the rows of a group:
    its n_samples responses); a thread of its own gives the rollout every row of the pool for
    `segment` tokens each (the longest responses no longer hold a batch up: each call decodes every
    response in the making, the new ones beside those going on), and when the call is back takes each
    row's segment (hpcrl/ppo/partial_rollouts.py): rows not done go back to the pool, a group whose
    rows are all done joins the whole ones. A step's batch is the first data.batch_size whole groups,
    in the order they were done. Nothing is thrown away: a response that goes on over several calls
    while the trainer updates may be older than `bound` updates by its first tokens (policy/lag/<lag>
    counts it; each token's own log-prob is what the importance correction divides by).

    A checkpoint keeps the rows as they were before the call in flight (that call is made again on
    resume, with its seed), so what it holds agrees with the data cursor of the same step."""

    def __init__(self, dataset, generate: Callable, early: list, n_samples: int, bound: int, total_steps: int, *,
                 segment: int, max_new_tokens: int, pad_id: int):
        super().__init__(dataset, generate, early, n_samples, bound, total_steps)
        self.segment, self.max_new_tokens, self.pad_id = segment, max_new_tokens, pad_id
        self.groups_per_batch = dataset.batch_size
        self.pool: list[Row] = []              # rows waiting for a call: those going on first, then new ones
        self.calling: list[Row] = []           # the rows of the call in flight, as they were before it
        self.partial: dict[int, list[Row]] = {}    # group -> its rows done, while others are not
        self.whole: list[list[Row]] = []       # groups all of whose rows are done, in the order they were
        self.open = 0                          # groups drawn and not taken
        self.calls = 0                         # calls made: each one's number is its seed's
        self.inflight = None                   # the GroupFuture of the call in flight
        self.failed: tuple[list[Row], object] | None = None      # a call a rank died in, for the driver to make again
        self.error: BaseException | None = None

    def resume(self, step: int, inflight: list[Batch]) -> None:
        """Continue with the rows a checkpoint kept (one batch of them: hpcrl/checkpoint/inflight.py)."""
        for kept in inflight:
            self.calls, self.drawn = kept.meta["calls"], kept.meta["drawn"]
            for row in rows_of(kept):
                if row.done:
                    self._done_row(row)
                else:
                    self.pool.append(row)
            self.open = len({int(g) for g in kept["group"]})

    def take(self, step: int) -> Generation:
        """The step's batch: the first data.batch_size whole groups, after drawing up to `bound` batches'
        groups ahead; early scoring issued on it."""
        per_batch = self.groups_per_batch
        with self.changed:
            while True:
                if self.error is not None:
                    raise self.error
                while self.open < (1 + min(self.bound, self.total_steps - step)) * per_batch:
                    self._draw()
                if len(self.whole) >= per_batch:
                    break
                self._wait()
            groups, self.whole = self.whole[:per_batch], self.whole[per_batch:]
            self.open -= per_batch
            self.depth = 1 + len(self.whole) // per_batch
        batch = to_batch([r for g in groups for r in g], self.max_new_tokens, self.pad_id, {"step": step})
        batch.pop("done")
        batch.meta["policy_version"] = int(batch["policy_version"].min())
        return Generation(step, batch, [m.future(batch) for m in self.early])

    def steps(self) -> list[int]:
        """The number of the rollout's call in flight (none: [])."""
        return [self.calls] if self.calling else []

    def held(self) -> Callable[[], list[Batch]]:
        """The rows now (those of the call in flight as they were before it), to write as one batch."""
        with self.changed:
            rows = [r for g in self.whole for r in g] + [r for g in self.partial.values() for r in g] + \
                self.calling + [_copy(r) for r in self.pool]
            meta = {"calls": self.calls - bool(self.calling), "drawn": self.drawn}
        return lambda: [to_batch(rows, self.max_new_tokens, self.pad_id, meta)] if rows else []

    def _draw(self) -> None:
        """The dataset's next prompts into the pool (under the lock, on the driver's thread: the data
        cursor a checkpoint records counts them)."""
        self.drawn += 1
        prompts = next_prompts(self.dataset, self.n_samples, self.drawn)
        if "group" not in prompts:          # one response a prompt: each its own group
            prompts["group"] = np.arange(len(prompts)) + self.drawn * len(prompts)
        self.pool += rows_of(prompts)
        self.open += self.groups_per_batch
        self.changed.notify_all()
        if self.thread is None and self.failed is None:
            self._start_thread()

    def _done_row(self, row: Row) -> None:
        group = int(row.fields["group"])
        done = self.partial.setdefault(group, [])
        done.append(row)
        if len(done) == self.n_samples:
            self.whole.append(self.partial.pop(group))

    def _produce(self) -> None:
        """The thread: every row of the pool to the rollout for a segment, then their tokens taken in.
        A call that failed (a rank died) goes to the driver's thread, which rebuilds the role and calls
        again (`take`), and the thread ends until then."""
        while True:
            with self.changed:
                while not self.pool and not self.closed:
                    self.changed.wait()
                if self.closed:
                    return
                rows, self.pool = self.pool, []
                self.calling = [_copy(r) for r in rows]
                self.calls += 1
                prompts = continuation(rows, self.pad_id)
                prompts.meta.update(step=self.calls, segment=min(self.segment, max(self.max_new_tokens - len(r.tokens)
                                                                                   for r in rows)))
                given = time.monotonic()
                if self.last_done is not None:
                    self.idle += given - self.last_done
                try:
                    self.inflight = self.generate(prompts)
                except BaseException as e:      # said by the driver's next take
                    self.error = e
                    self.changed.notify_all()
                    return
            future = self.inflight
            while not self.closed and not _answered(future, timeout=1.0):
                pass
            if self.closed:
                return
            try:
                ray.get(future.refs)
            except Exception:       # (the refs of the call made again, where the driver's wait found it hung)
                with self.changed:
                    self.failed, self.thread = (rows, future), None
                    self.changed.notify_all()
                return
            self.last_done = time.monotonic()
            self._absorb(rows, future.result(), self.last_done - given)

    def _absorb(self, rows: list[Row], out: Batch, seconds: float | None = None) -> None:
        """A call's segments into its rows; the rows done to their groups, the others back to the pool.
        `seconds`: the call's, for the throughput (None: a call made again after a rebuild, not counted)."""
        with self.changed:
            version = int(out.meta.get("policy_version", 0))
            added = absorb(rows, out, version, self.max_new_tokens)
            if seconds is not None:
                self.throughput.add(version, added, seconds)
            going_on = []
            for row in rows:
                if row.done:
                    self._done_row(row)
                else:
                    going_on.append(row)
            self.pool = going_on + self.pool
            self.calling, self.inflight = [], None
            self.changed.notify_all()

    def _wait(self) -> None:
        """The driver's thread, while the step's groups are not whole (under the lock): a call that failed
        made again here; a call in flight waited on with its deadline (hung ranks: their group rebuilt and
        the call made again, which the thread then waits on); else until the thread says something."""
        if self.failed is not None:
            (rows, future), self.failed = self.failed, None
            self.changed.release()
            try:
                out = future.result()       # the role rebuilt, the call made again
            finally:
                self.changed.acquire()
            self._absorb(rows, out)         # (the lock is reentrant)
            self._start_thread()
        elif self.inflight is not None:
            future = self.inflight
            self.changed.release()
            try:
                future.wait()
            finally:
                self.changed.acquire()
            self.changed.wait(timeout=0.05)      # the thread's turn to take the call in
        else:
            self.changed.wait()


def _answered(future, timeout: float) -> bool:
    """Whether every rank has answered the call (its results not fetched)."""
    refs = future.refs
    return len(ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)[0]) == len(refs)


def _copy(row: Row) -> Row:
    return dataclasses.replace(row, tokens=list(row.tokens), logps=list(row.logps), versions=list(row.versions))


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

