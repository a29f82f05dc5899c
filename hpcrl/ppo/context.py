"""RunContext: what a driver works with. The built-in PPO driver (hpcrl/ppo/loop.py) is written
on it, and so is your own (`driver: mypkg.train:main` in the spec, called as main(ctx)):

    def main(ctx: hpcrl.RunContext) -> str | None:
        resumed = ctx.resume()                       # roles, data cursor and metrics of the newest good step
        start = resumed.step if resumed else 0
        for step in range(start + 1, ctx.cfg.total_steps + 1):
            gen = ctx.generate(ctx.dataset.next_batch())   # generate_sequences (or multi-turn episodes)
            batch = ctx.scored(gen)                  # train.reward.scorers, weighted: batch["scores"]
            ...                                      # any calls of any role: ctx.groups[role].<method>
            ctx.log({"step": step, "reward/mean": float(batch["scores"].mean())})
            # checkpoints as train: asks, and on a signal (preemption, time limit) or the deadline
            # one, then the stop: the job requeues and the next start resumes
            if reason := ctx.end_step(step, {"my_counter": ...}):
                return reason
        return None

Requeue, exact resume, role restart (a rebuilt role takes back its state of the last step
boundary, and the state-changing calls since are made again), `hpcrl status`, `logs` and `report`
work the same for any driver written on it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from hpcrl.checkpoint.cadence import CommitCadence, SnapshotCadence
from hpcrl.checkpoint.commit import RoleCheckpoints
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.controller import CallAbandoned, ResourcePoolError, RoleHung, WorkerGroup, follow_nodes
from hpcrl.controller.batch import Batch
from hpcrl.importing import import_object
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.observe.metrics import MetricsLog
from hpcrl.observe.startup import StartupClock, slowest_phases
from hpcrl.observe.status import RunStatus
from hpcrl.ppo.config import TrainConfig, Scorer
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.agent_episodes import AgentEpisodes
from hpcrl.ppo.episodes import Episodes, episode_scores
from hpcrl.ppo.validation import validate
from hpcrl.run_dir import RunDir, log_stamp
from hpcrl.serving.keys import endpoint_secret
from hpcrl.stop import StopRequest

Driver = Callable[["RunContext"], "str | None"]
"""A training loop: returns None when done, or the reason it stopped early at a committed checkpoint."""


class Boundary(NamedTuple):
    """The end of the newest step done: what a checkpoint of it would hold, for a stop that comes
    while a later call runs (or hangs) to commit it."""
    step: int
    state: dict | None      # the driver's state given to end_step
    inflight: Callable[[], list]
    dataset: dict           # the data cursor
    calls: dict             # WorkerGroup -> its calls_issued() there


class Resumed(NamedTuple):
    step: int          # the committed step training goes on after
    state: dict        # the driver state given to checkpoint() (without the data cursor and metrics size)
    inflight: list     # the batches given to checkpoint(inflight=...)


@dataclass
class Score:
    """One term of train.reward.scorers on its role's WorkerGroup: `future(generated)` issues the scoring
    call; its result() is Batch({"score/<role>": the method's scores})."""
    scorer: Scorer
    group: WorkerGroup

    @property
    def wg(self) -> WorkerGroup:
        return self.group

    def future(self, generated) -> _Renamed:
        return _Renamed(self, getattr(self.group, self.scorer.method).future(generated))

    def keep(self, result) -> Batch:
        role, method = self.scorer.role, self.scorer.method
        if not isinstance(result, Batch) or "scores" not in result:
            got = result.keys() if isinstance(result, Batch) else type(result).__name__
            raise RuntimeError(f"train.reward.scorers: {role}.{method} returned {got}; a scoring method returns "
                               "Batch({'scores': one float per sample})")
        return Batch({f"score/{role}": torch.as_tensor(result["scores"]).float()})


@dataclass
class _Renamed:
    score: Score
    pending: object

    def result(self) -> Batch:
        return self.score.keep(self.pending.result())


def snapshots_spill(groups: dict[str, WorkerGroup], sizes: dict[str, int]) -> list[str]:
    """The nodes whose Ray object store cannot hold the snapshots kept there, twice (for an instant a
    new one sits beside the last): Ray writes each to disk then, and every step waits on the write.
    Under Slurm a node's object store is 30% of its component's `mem`."""
    import ray

    capacity = {n["NodeManagerAddress"]: n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"]}
    kept: dict[str, list[str]] = {}
    for role, size in sizes.items():
        if size:
            kept.setdefault(groups[role].describe()["ranks"][0]["node_ip"], []).append(role)
    return [f"the snapshots of {', '.join(roles)} ({need / 1e9:.2f} GB, twice while one replaces the last) do not fit in "
            f"the object store of {ip} ({capacity[ip] / 1e9:.2f} GB): Ray spills them to disk at every snapshot; give "
            f"the component more mem (its object store is 30% of it) or set train.checkpoint.snapshot_every"
            for ip, roles in kept.items() if ip in capacity
            and 2 * (need := sum(sizes[r] for r in roles)) > capacity[ip]]


def weighted_scores(batch: Batch, scorers: list[Scorer]) -> torch.Tensor:
    """Σ weight × score/<role>: a sample's score (one term of weight 1 gives its scores exactly)."""
    total = None
    for s in scorers:
        term = s.weight * batch[f"score/{s.role}"]
        total = term if total is None else total + term
    return total


class Inputs(NamedTuple):
    """What the driver reads before its first step besides the roles: the policy's tokenizer, the
    training prompts and the held-out ones (or None), tokenized."""
    tokenizer: object
    dataset: PromptDataset
    held_out: PromptDataset | None

    @classmethod
    def read(cls, cfg: TrainConfig, model_dir: Path, prompts: Path) -> Inputs:
        tokenizer = load_tokenizer(model_dir)
        environment = cfg.environment
        tools = import_object(environment.cls).tool_schemas(**environment.kwargs) if environment.cls else None
        return cls(tokenizer, *(PromptDataset(path, tokenizer, cfg.data.batch_size, cfg.seed, cfg.data.max_prompt_length,
                                              tools) if path else None
                                for path in (prompts, cfg.validation.dataset and Path(cfg.validation.dataset))))


@dataclass
class RunContext:
    """A run as a driver sees it, built by `hpcrl.ppo.loop.train` once the roles are up. Besides
    the fields: `tokenizer` (the policy's), `dataset` (the training prompts: `next_batch()`; its
    cursor is in every checkpoint), `held_out` (validation.dataset's, or None), `scores` (train.reward.scorers on
    their roles), `checkpoints` (RoleCheckpoints: the roles' files and manifests), `generating` (a
    pipelined driver sets it: the steps whose batches are being generated ahead, which the
    `rebuild` event of a role names)."""
    cfg: TrainConfig
    """the train: settings (hpcrl/ppo/config.py)"""
    run_dir: Path
    """the run directory (RunDir names every path in it)"""
    groups: dict[str, WorkerGroup]
    """role -> its WorkerGroup, built-in roles and your own; call `groups[role].<method>(...)`, or
    `.future(...)` to pass the result rank to rank without fetching it"""
    model_dir: Path
    """the policy's HF model directory"""
    status: RunStatus
    """status.json and events.jsonl: `status.phase(step, "my phase")` says what runs"""
    stop: StopRequest
    """`stop.check()`: why to stop now (Slurm's signal, the deadline, the batch script's stop file) or None"""
    metrics: MetricsLog
    """metrics.jsonl (and TensorBoard, W&B): write through `log`"""
    prompts: Path
    """the training prompts' file"""
    history: list[dict] = field(default_factory=list)
    """the metrics records logged in this start"""
    startup: StartupClock | None = None
    """says the phases of this start (hpcrl/observe/startup.py); `log` ends its last with the first step's record"""
    inputs: Inputs | None = None
    """the tokenizer and prompts, when already read (`Inputs.read`); read here otherwise"""

    def __post_init__(self):
        cfg = self.cfg
        environment = cfg.environment
        self.tokenizer, self.dataset, self.held_out = self.inputs or Inputs.read(cfg, self.model_dir, self.prompts)
        generator = self.groups.get("rollout") or self.groups["actor_rollout"]
        said = lambda failed: print(f"{log_stamp()} {failed}", flush=True)     # noqa: E731
        self.episodes = Episodes(cfg, generator, self.groups["env"], self.tokenizer, said) if environment.cls else \
            AgentEpisodes(cfg, generator, self.groups["env"], self.tokenizer,
                          endpoint_secret(RunDir(self.run_dir).ray_token), said) if environment.agent else None
        for name, data in (("training", self.dataset), ("held-out", self.held_out)):
            if data is not None and data.too_long:
                print(f"{log_stamp()} {data.too_long} of {data.too_long + len(data)} {name} prompts are longer than "
                      f"max_prompt_length {cfg.data.max_prompt_length} tokens: left out", flush=True)
        self.scores = [Score(s, self.groups[s.role]) for s in cfg.reward.terms()]
        # the rollout role holds a copy of the actor's weights: nothing of its own to save
        self.checkpoints = RoleCheckpoints(CheckpointStore(self.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every),
                                           {r: g for r, g in self.groups.items() if r != "rollout"},
                                           cfg.checkpoint.async_save, self._committed)
        self.snapshot_cadence = SnapshotCadence(cfg.checkpoint.snapshot_every)
        self.commit_cadence = CommitCadence(cfg.checkpoint.save_every)
        self.snapshot_spills: list[str] | None = None    # checked at the first snapshot
        self.generating: Callable[[], list[int]] = lambda: []
        for role, wg in self.groups.items():
            wg.on_change(self._rebuild_listener(role))
            if wg.elastic:
                wg.on_resize(self._resize_listener(role))
        self.committing = False      # a checkpoint is being written: a stop does not give up its calls
        self.boundary = self._boundary(0)
        for wg in self._process_groups():
            wg.stop_when(lambda: None if self.committing else self.stop.check())
            wg.on_hang(self._hang_listener)
            wg.on_deadline(self._deadline_listener)

    def generate(self, prompts: Batch):
        """The batch generated from `prompts` by the generating role (rollout, or actor_rollout): a
        future of its generate_sequences, or with train.environment the batch of multi-turn
        episodes, made turn by turn with the env role (hpcrl/ppo/episodes.py)."""
        if self.episodes is not None:
            return self.episodes.generate(prompts)
        return (self.groups.get("rollout") or self.groups["actor_rollout"]).generate_sequences.future(prompts)

    def scored(self, generated) -> Batch:
        """The generated batch (`generate`'s future, or a Batch) with every term of
        train.reward.scorers (score/<role>) and their weighted sum (scores; a failed episode's is
        train.environment.failed_score)."""
        if isinstance(generated, Batch) and "agent_reward" in generated:   # the agents' rewards are the scores
            generated["scores"] = episode_scores(generated, self.cfg.environment.failed_score)
            return generated
        futures = [s.future(generated) for s in self.scores]
        batch = generated.result() if hasattr(generated, "result") else generated
        for f in futures:
            batch = batch.union(f.result())
        batch["scores"] = weighted_scores(batch, self.cfg.reward.terms())
        batch["scores"] = episode_scores(batch, self.cfg.environment.failed_score)
        return batch

    def resume(self) -> Resumed | None:
        """Load every role from the newest step whose files verify, put the data cursor back and
        drop the metrics logged after it; None on a fresh start. Call it once, before the first step."""
        t0 = time.perf_counter()
        found = self.checkpoints.resume()
        if found is None:
            self.status.event("start", step=0, resumed=False, total_steps=self.cfg.total_steps)
            self._satellites_at_start(0)
            return None
        step, state, nbytes, inflight = found
        state = dict(state)
        self.dataset.load_state_dict(state.pop("dataset"))
        self.metrics.truncate(state.pop("metrics_bytes"))   # steps after the checkpoint are done again
        ahead = [b.meta["step"] for b in inflight if "step" in b.meta]     # (partial rollouts keep rows, not batches)
        print(f"{log_stamp()} resumed from checkpoint step {step} ({RunDir(self.run_dir).ckpt}): "
              f"{size_rate(nbytes, time.perf_counter() - t0, 'read')}"
              + (f"; batches of steps {ahead} were generated ahead" if ahead else ""), flush=True)
        self.status.event("start", step=step, resumed=True, total_steps=self.cfg.total_steps)
        self._satellites_at_start(step)
        self.boundary = self._boundary(step)
        return Resumed(step, state, list(inflight))

    def _process_groups(self) -> list[WorkerGroup]:
        """One WorkerGroup per set of processes (colocated roles share theirs)."""
        out: list[WorkerGroup] = []
        for wg in self.groups.values():
            if not any(wg.shares_processes_with(o) for o in out):
                out.append(wg)
        return out

    def _boundary(self, step: int, state: dict | None = None, inflight: Callable[[], list] = list) -> Boundary:
        return Boundary(step, state, inflight, self.dataset.state_dict(),
                        {wg: wg.calls_issued() for wg in self.groups.values()})

    def stop_at_boundary(self, error: CallAbandoned | RoleHung) -> str:
        """A call was given up (a stop came while it ran past its usual time, or its ranks hung past
        layout.restart_limit): every role goes back to its state at the end of the newest step done
        (processes that ran past it are rebuilt from their snapshot or checkpoint and the calls up
        to there), which is committed, and the run stops there. Returns why (the job requeues)."""
        b, self.committing = self.boundary, True
        reason = self.stop.reason if isinstance(error, CallAbandoned) else f"{error}; stopped at step {b.step}"
        print(f"{log_stamp()} {error}", flush=True)
        self.status.phase(b.step, "checkpoint")       # the step the run stops after
        steps = self.checkpoints.store.committed_steps()
        if b.step and not (steps and steps[-1] >= b.step):
            for wg in self._process_groups():
                sharing = [g for g in self.groups.values() if g.shares_processes_with(wg)]
                if wg.busy() or any(g.calls_issued() > b.calls[g] for g in sharing):
                    self.checkpoints.pending = None     # a background write of those processes is gone with them
                    wg.roll_back({g: b.calls[g] for g in sharing})
            self.dataset.load_state_dict(b.dataset)
            self.checkpoint(b.step, b.state, inflight=b.inflight())
        self.checkpoints.finish()
        steps = self.checkpoints.store.committed_steps()
        print(f"{log_stamp()} stopped after step {b.step}; "
              + (f"checkpoint step {steps[-1]} committed" if steps else "nothing committed: the run starts over"),
              flush=True)
        return reason

    def _replay_full(self) -> bool:
        """Whether the batches kept to make a rebuilt role's updates again (since its snapshot or
        checkpoint) passed train.checkpoint.replay_limit: a snapshot then lets them go. (Dropping them
        instead would leave a rebuilt role nothing to go back to but the last commit, for every role.)"""
        kept = max((wg.replay_size() for wg in self._process_groups()), key=lambda size: size[1])
        if kept[1] <= self.cfg.checkpoint.replay_limit * 1e6:
            return False
        print(f"{log_stamp()} {kept[0]} updates kept for a rebuilt role to make again hold {kept[1] / 1e6:.3g} MB, more "
              f"than train.checkpoint.replay_limit ({self.cfg.checkpoint.replay_limit} MB): a snapshot now", flush=True)
        return True

    def _hang_listener(self, hang: dict) -> None:
        role = hang["call"].split(".")[0]
        self.status.event("hang", role=role, step=self.status.doc["step"], call=hang["call"], ranks=hang["ranks"],
                          deadline=hang["deadline_s"], waited=hang["waited_s"])
        print(f"{log_stamp()} role {role}: ranks {hang['ranks']} did not answer {hang['call']} within its deadline of "
              f"{hang['deadline_s']:.0f} s; their stacks are in {RunDir(self.run_dir).logs}/{role}/rank<k>.log",
              flush=True)

    def _deadline_listener(self, call: str, seconds: float) -> None:
        self.status.event("deadline", role=call.split(".")[0], step=self.status.doc["step"], call=call,
                          seconds=round(seconds, 1))

    def _satellites_at_start(self, step: int) -> None:
        """An elastic role whose satellites joined before its group was built starts with their
        ranks; said as the resize it would have been a step later, so events and status show every join."""
        for role, wg in self.groups.items():
            ranks = wg.describe()["ranks"] if wg.elastic else []
            own = sum(not r["origin"].startswith("satellite") for r in ranks)
            if own < len(ranks):
                nodes = list(dict.fromkeys((r["origin"], r["node"]) for r in ranks))
                why = "; ".join(f"{origin} joined ({node}) before the role started"
                                for origin, node in nodes if origin.startswith("satellite"))
                self._resize_listener(role)({"from": own, "to": len(ranks), "why": why, "seconds": 0.0,
                                             "nodes": [f"{node} ({origin})" for origin, node in nodes]}, step)

    def checkpoint(self, step: int, state: dict | None = None, *, background: bool = False,
                   inflight: list = ()) -> None:
        """Every role's file, then the manifest with `state` (the driver's own, JSON), the data cursor
        and the metrics size; `inflight`: batches made ahead of `step` (kept bitwise). background:
        write while training goes on (train.checkpoint.async_save), committed by the next checkpoint or the end."""
        self.status.phase(step, "checkpoint")
        committing, self.committing = self.committing, True
        try:
            self.checkpoints.save(step, {"step": step, **(state or {}), "dataset": self.dataset.state_dict(),
                                         "metrics_bytes": self.metrics.size()}, background=background, inflight=inflight)
        finally:
            self.committing = committing

    def end_step(self, step: int, state: dict | None = None, inflight: Callable[[], list] = list) -> str | None:
        """After each step: the checkpoint train: asks for (as save_every says, in the background
        with async_save; after the last step with save_last) and the one a stop request
        asks for, then the stop; else the roles' snapshots (as snapshot_every says: the state a
        rebuilt role takes back), the standby processes start after the first (layout.standby), and the
        elastic roles follow their nodes (follow_nodes). Returns
        why to stop now (return it from the driver), or None. `inflight()`: the batches made ahead
        of `step`, collected only when a checkpoint is taken."""
        cfg, reason = self.cfg, self.stop.check()
        last = step == cfg.total_steps
        periodic = not reason and self.commit_cadence.due(step)
        saved = reason or (last and cfg.checkpoint.save_last) or periodic
        background = not reason and step < cfg.total_steps
        if saved:
            t0 = time.perf_counter()
            self.checkpoint(step, state, background=background, inflight=inflight())
            if periodic:
                self._said_interval(self.commit_cadence.took(time.perf_counter() - t0), step)
        if reason:
            return self.stopped(step, reason)
        self.boundary = self._boundary(step, state, inflight)
        # a committed file is a rebuilt role's way back as well: no snapshot of the same step beside it
        if (self.snapshot_cadence.due(step) or self._replay_full()) and step < cfg.total_steps and \
                not (saved and not (background and cfg.checkpoint.async_save)):
            t0 = time.perf_counter()
            kept = self.checkpoints.take_snapshots(step)
            self.snapshot_cadence.took(time.perf_counter() - t0)
            if self.snapshot_spills is None:
                self.snapshot_spills = snapshots_spill(self.groups, kept)
                for warning in self.snapshot_spills:
                    print(f"{log_stamp()} warning: {warning}", flush=True)
            self.status.snapshotted(step, sum(kept.values()), self.snapshot_cadence.cost, self.snapshot_spills)
        for wg in self.groups.values():      # once the start is over (layout.standby)
            wg.start_standby()
        self.follow_nodes()
        return None

    def _said_interval(self, interval: float | None, step: int) -> None:
        """save_every auto's interval, in the log and events.jsonl, when it is new or changed."""
        if interval is None:
            return
        cost = self.commit_cadence.cost
        print(f"{log_stamp()} periodic checkpoints every {interval:.0f} s (save_every: auto; the last held training "
              f"{cost:.2f} s, {cost / (cost + interval):.1%} of the wall time): a lost node costs at most that",
              flush=True)
        self.status.event("checkpoint_interval", step=step, seconds=round(interval, 3), cost=round(cost, 3))

    def follow_nodes(self) -> None:
        """The elastic roles (reward, ref, rollout, your own stateless roles) take the nodes that
        joined since the last step and drop those that left (`hpcrl scale`); end_step calls it."""
        try:
            follow_nodes(self.groups.values())
        except ResourcePoolError as e:
            print(f"{log_stamp()} {e}; the role goes on with the nodes it has", flush=True)
            self.status.event("resize_failed", step=self.status.doc["step"], error=str(e))

    def stopped(self, step: int, reason: str) -> str:
        """After the checkpoint of `step`, taken because stop.check() gave `reason`: the run stops
        there (the job requeues it). Returns reason, for the driver to return."""
        self.checkpoints.finish()
        print(f"{log_stamp()} stopped after step {step} ({reason}); checkpoint committed "
              f"{time.time() - self.stop.since:.2f} s after the request", flush=True)
        return reason

    def log(self, record: dict) -> None:
        """One metrics record (a step's, or a validation's): metrics.jsonl, trackers, history."""
        if self.startup is not None:
            self.startup.logged(record)
        self.metrics.write(record)
        self.history.append(record)

    def validate(self, step: int) -> Callable[[], dict]:
        """The policy answers the held-out prompts, issued now (with the weights of now); the function
        returned has the reward role score them, says the scores and returns them (val/...)."""
        collect = validate(self.cfg, self.held_out, self.generate, self.groups["reward"], step)

        def scores() -> dict:
            scores = collect()
            self.status.validated(step, scores)
            print(f"{log_stamp()} validation after step {step}: " + "  ".join(f"{k.removeprefix('val/')} {v:.3f}"
                                                                       for k, v in scores.items()), flush=True)
            return scores
        return scores

    def _rebuild_listener(self, role: str) -> Callable[[], None]:
        """Says in events.jsonl when a role is rebuilt and back, and in the log when batches are
        generated ahead meanwhile (`generating`): the rollout goes on with them, the step waits
        only for that role."""
        was, since = ["alive"], [0.0]

        def changed() -> None:
            state = self.groups[role].describe()["state"]
            if state == "restarting" and was[0] != "restarting":
                since[0] = time.time()
                steps = self.generating() if role != "rollout" else []
                self.status.event("rebuild", role=role, step=self.status.doc["step"], generating=steps)
                if steps:
                    print(f"{log_stamp()} role {role} is being rebuilt; meanwhile the rollout goes on generating "
                          f"the batches of steps {steps}", flush=True)
            elif state == "alive" and was[0] == "restarting":
                self.status.event("rebuilt", role=role, step=self.status.doc["step"],
                                  seconds=round(time.time() - since[0], 3),
                                  phases=slowest_phases(self.groups[role].startup(), since[0]),
                                  restore=self.groups[role].describe()["last_restore"])
            was[0] = state
        return changed

    def _resize_listener(self, role: str) -> Callable[..., None]:
        """Says in events.jsonl and the log when an elastic role took or lost nodes (at the step in
        progress, or at `step`)."""
        def resized(info: dict, step: int | None = None) -> None:
            self.status.event("resize", role=role, step=self.status.doc["step"] if step is None else step, **info)
            print(f"{log_stamp()} role {role}: {info['why']}: {info['from']} -> {info['to']} ranks "
                  f"({info['seconds']:.2f} s)", flush=True)
        return resized

    def _committed(self, step: int, nbytes: int, seconds: float) -> None:
        self.status.event("checkpoint", step=step, bytes=nbytes, seconds=round(seconds, 3))
        print(f"{log_stamp()} checkpoint step {step} committed: {size_rate(nbytes, seconds, 'written')}", flush=True)


def size_rate(nbytes: int, seconds: float, verb: str) -> str:
    return f"{nbytes / 1e6:.1f} MB {verb} in {seconds:.2f} s ({nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s)"
