"""The PPO driver: the single controller, and the only code that knows the order of the phases.

Per step:
    prompts ──► actor_rollout.generate_sequences ──► (one future, not fetched yet)
                  ├─► actor_rollout.compute_log_prob   (old log-probs, recomputed by the trainer)
                  ├─► ref.compute_ref_log_prob          } issued at once, on their own
                  ├─► critic.compute_values             } processes and nodes; the batch goes
                  └─► reward.compute_scores             } rank to rank, not via the driver
                      (and every term of train.reward.scorers: your own roles' scoring methods, weighted)
    (with train.environment: multi-turn episodes, the generating role and the env role taking turns,
    hpcrl/ppo/episodes.py; the roles below score and train them as they do single turns)
    advantages on the driver (shaped scores, KL-shaped token rewards, then GAE or a critic-free
    estimator: algorithm.advantage), of the groups dynamic sampling keeps
    critic.update_critic ─► actor_rollout.update_actor (after critic_warmup) ─► weights to rollout
    every val_every steps: the held-out prompts answered and scored (hpcrl/ppo/validation.py)

With `pipeline: one_step_off` (a separate rollout role) the batch of step k+1 is generated while
step k is scored and trained, and scored by the roles that need no trained weights (reward, and
ref unless it shares the actor's processes) as soon as it exists:

    rollout   │ gen k+1 (weights k−1) │ gen k+2 (weights k) │
    ref,reward│     score k+1 ┆       │     score k+2       │
    actor     │ old log-probs k, update k ─► weights │ log-probs k+1, update k+1 ─► ...
    critic    │ values k, update k                   │ values k+1, update k+1

Each batch records the policy version that sampled it; `max_staleness` batches are in flight, and a
checkpoint keeps them (hpcrl/checkpoint/inflight.py), so a resumed run trains what an uninterrupted
one would. With `pipeline: async` the same loop takes its batches from a buffer the rollout fills
without waiting for the updates, each batch given to it once it has finished the one before, so
that it samples with the newest weights (Producer, hpcrl/ppo/generation.py).

The loop (`ppo`) is written on the public RunContext (hpcrl/ppo/context.py), as a driver of your
own is (`driver:` in the spec); `train` builds the roles and the context and runs either. Started by
hpcrl/launch/entrypoint.py, the one way in: inside a job (`python -m hpcrl.launch RUN_DIR`, what the
batch script runs), through submitit, or locally (`hpcrl run SPEC --local`).
"""
from __future__ import annotations

import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from hpcrl import algo
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.controller import CallAbandoned, DeadlinePolicy, ResourcePool, RoleHung, RoleStateLost, WorkerGroup
from hpcrl.controller.batch import Batch
from hpcrl.controller.startup import process_started
from hpcrl.files import StorageError, storage_failure
from hpcrl.models import CharTokenizer, create_model_dir
from hpcrl.observe.metrics import MetricsLog
from hpcrl.observe.startup import StartupClock
from hpcrl.observe.status import RunStatus
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.context import Driver, Inputs, RunContext, weighted_scores
from hpcrl.ppo.generation import Generation, Lookahead, Producer, SegmentedProducer, WeightSync
from hpcrl.ppo.episodes import episode_scores, turn_rewards
from hpcrl.ppo.roles import Agents, ActorRollout, Critic, Environments, Judge, Reference, RewardModel, Rollout, RuleReward
from hpcrl.ppo.roles.judge import judge_key
from hpcrl.ppo.roles.custom import checkpointed, worker_class
from hpcrl.ppo.step_metrics import step_record
from hpcrl.ppo.tasks import copy_digits, tool_sums
from hpcrl.run_dir import RunDir, log_stamp
from hpcrl.serving.keys import endpoint_secret
from hpcrl.stop import StopRequest


def prepare_inputs(cfg: TrainConfig, run_dir: Path) -> tuple[Path, Path]:
    """The model and prompts every role reads: given by the config, or built once into the run dir
    (the built-in task's prompts, and a tiny model for its alphabet)."""
    task = {"copy_digits": copy_digits, "tool_sums": tool_sums}[cfg.data.task]
    tok, paths = CharTokenizer(task.ALPHABET), RunDir(run_dir)
    model_dir = Path(cfg.model.path) if cfg.model.path else create_model_dir(
        paths.model, tok, cfg.seed, hidden_size=cfg.model.hidden_size, layers=cfg.model.layers, heads=cfg.model.heads)
    prompts = Path(cfg.data.dataset) if cfg.data.dataset else paths.prompts
    if not cfg.data.dataset and not prompts.exists():
        task.write_prompts(prompts, cfg.data.task_prompts, cfg.data.task_digits, cfg.seed,
                          **({"sigma": cfg.data.task_digits_sigma} if cfg.data.task_digits_sigma else {}))
    return model_dir, prompts


def worker_classes(cfg: TrainConfig, own: dict[str, tuple[str, dict]] | None = None) -> dict[str, type]:
    """Role -> its worker class: the built-in roles cfg runs, then your own (`own`: role ->
    (worker class path, its __init__ keyword arguments), checked)."""
    builtin = {"actor_rollout": ActorRollout, "rollout": Rollout, "critic": Critic, "ref": Reference,
               "reward": RewardModel if cfg.reward.model_dir else RuleReward,
               "env": Agents if cfg.environment.agent else Environments, "judge": Judge}
    return {**{r: c for r, c in builtin.items() if r in cfg.roles()},
            **{r: checkpointed(worker_class(path, kwargs)) for r, (path, kwargs) in (own or {}).items()}}


def build_worker_groups(cfg: TrainConfig, model_dir: Path, run_dir: Path,
                        own: dict[str, tuple[str, dict]] | None = None) -> dict[str, WorkerGroup]:
    """One WorkerGroup per role, on the nodes labelled with that role; colocated roles share
    processes. `own`: your own roles, role -> (worker class path, its __init__ keyword arguments)."""
    paths = RunDir(run_dir)
    conf = cfg.model_copy(deep=True)      # what the roles get: the run's cache unless the spec names one
    conf.rollout.cache_dir = str(Path(cfg.rollout.cache_dir or paths.cache).absolute())
    secret = endpoint_secret(paths.ray_token) if cfg.judge.enabled else b""    # the judge's: its key to the reward role alone
    builtin_args = {"actor_rollout": (str(model_dir), conf), "rollout": (str(model_dir), conf),
                    "critic": (str(model_dir), conf), "ref": (str(model_dir), conf),
                    "reward": (cfg.reward.model_dir,) if cfg.reward.model_dir else
                    (str(model_dir), cfg.reward_function(), cfg.reward.batched, judge_key(secret) if secret else ""),
                    "env": (cfg.environment.agent, cfg.environment.agent_time_limit) if cfg.environment.agent else
                    (cfg.environment.cls, cfg.environment.kwargs, cfg.environment.step_timeout),
                    "judge": (str(model_dir), conf, secret)}
    own = own or {}
    workers = {r: (cls, () if r in own else builtin_args[r], dict(own[r][1]) if r in own else {})
               for r, cls in worker_classes(cfg, own).items()}
    d = cfg.deadlines
    opts = {"log_dir": paths.logs, "restart_limit": cfg.layout.restart_limit, "standby": cfg.layout.standby,
            "deadlines": DeadlinePolicy(d.floor, d.factor, d.first, d.window, dict(d.calls))}

    def colocated(together: list[str]) -> dict[str, WorkerGroup]:
        pool = ResourcePool.for_role(together[0], cfg.layout.processes_per_node.get(together[0]), len(together),
                                     uses_gpus=any(workers[r][0].uses_gpus for r in together))
        return WorkerGroup.colocated(pool, {r: workers[r] for r in together}, **opts)

    def alone(role: str) -> dict[str, WorkerGroup]:
        cls, args, kwargs = workers[role]
        pool = ResourcePool.for_role(role, cfg.layout.processes_per_node.get(role), uses_gpus=cls.uses_gpus)
        return {role: WorkerGroup(pool, cls, args, kwargs, **opts)}

    # every group at once: each start (process, torch import, model load) takes seconds, and the
    # groups are on different nodes. A colocated role this training does not run is left out
    # (the reference of a LoRA run: the actor's base)
    groups_run = [g for g in ([r for r in group if r in workers] for group in cfg.layout.colocate) if len(g) > 1]
    together = {r for group in groups_run for r in group}
    starts = [lambda g=g: colocated(g) for g in groups_run] + [lambda r=r: alone(r) for r in workers if r not in together]
    groups: dict[str, WorkerGroup] = {}
    with ThreadPoolExecutor(len(starts), thread_name_prefix="hpcrl-start") as threads:
        for built in [threads.submit(start) for start in starts]:
            groups.update(built.result())
    return {r: groups[r] for r in workers}     # in role order, whatever finished first


def compute_advantages(batch: Batch, cfg: TrainConfig, kl_ctl) -> dict:
    """Adds token_rewards, advantages, returns to batch; returns the KL metrics. The scores are
    shaped first: reward.missing_eos_penalty, and DAPO's overlong penalty with algorithm.overlong_buffer."""
    algorithm, mask = cfg.algorithm, batch["response_mask"].float()
    scores = batch["scores"].float() - cfg.reward.missing_eos_penalty * (~batch["has_eos"]).float()
    if algorithm.overlong_buffer:
        scores = scores + algo.overlong_penalty(mask.sum(dim=1), cfg.rollout.max_new_tokens, algorithm.overlong_buffer,
                                                algorithm.overlong_penalty)
    kl = None
    if algorithm.uses_ref:
        kl = algo.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], algorithm.kl_estimator) * mask
    beta = kl_ctl.value if algorithm.kl_in_reward else 0.0
    rewards = algo.token_level_rewards(scores, kl, mask, beta)
    if (per_turn := turn_rewards(batch)) is not None:      # multi-turn: each turn's reward on its last token
        rewards = rewards + per_turn
    if algorithm.advantage == "gae":
        adv, ret = algo.gae(rewards, batch["values"], mask, algorithm.gamma, algorithm.lam)
        if algorithm.whiten_advantages:
            adv = algo.masked_whiten(adv, mask)
    else:       # no critic: the advantages stand in for the returns
        outcome = rewards.sum(dim=1)
        adv = {"grpo": lambda: algo.grpo_advantages(outcome, _groups(batch), mask, norm_by_std=algorithm.grpo_std_normalize),
               "rloo": lambda: algo.rloo_advantages(outcome, _groups(batch), mask),
               "reinforce_pp": lambda: algo.reinforce_pp_advantages(rewards, mask, algorithm.gamma),
               "reinforce_pp_baseline": lambda: algo.reinforce_pp_baseline_advantages(outcome, _groups(batch), mask),
               }[algorithm.advantage]()
        ret = adv
    batch["token_rewards"], batch["advantages"], batch["returns"] = rewards, adv, ret
    current_kl = float(algo.masked_mean(kl, mask)) if kl is not None else 0.0
    kl_ctl.update(current_kl, len(batch))
    return {"kl": current_kl, "kl_coef": beta if algorithm.kl_in_reward else algorithm.kl_coef}


def groups_to_train(batch: Batch, cfg: TrainConfig) -> Batch:
    """The samples the step trains on: all of them, or with algorithm.dynamic_sampling those of the
    groups whose scores differ (DAPO)."""
    if not cfg.algorithm.dynamic_sampling:
        return batch
    return batch.index(algo.varied_groups(batch["scores"].float(), _groups(batch)))


def first_groups(batch: Batch, n: int) -> Batch:
    """The samples of the first `n` groups (all of them where it has fewer)."""
    if "group" not in batch:
        return batch
    groups = _groups(batch)
    first = list(dict.fromkeys(groups.tolist()))[:n]
    return batch.index(torch.isin(groups, torch.tensor(first, dtype=groups.dtype)))


def _groups(batch: Batch) -> torch.Tensor:
    """Each sample's prompt group (the Lookahead numbers them when rollout.n_samples > 1)."""
    return torch.as_tensor(batch["group"].astype(np.int64))


def pad_for_ranks(batch: Batch, world_size: int) -> Batch:
    """Equal shards for every rank (DDP needs the same number of steps everywhere): pad with copies
    whose response_mask is 0, so they add nothing to any loss."""
    padded, padding = batch.pad_to_multiple(world_size)
    if padding.pad:
        mask = padded["response_mask"].clone()
        mask[padding.size:] = 0
        padded["response_mask"] = mask
    return padded


class _Timer:
    """Times each phase of a step, and tells the run status which phase is running."""

    def __init__(self, status: RunStatus, step: int):
        self.times: dict[str, float] = {}
        self.status, self.step = status, step

    @contextmanager
    def __call__(self, phase: str):
        self.status.phase(self.step, phase)
        t0 = time.perf_counter()
        yield
        key = f"timing/{phase}"       # a phase timed twice (dynamic sampling's refills) adds up
        self.times[key] = round(self.times.get(key, 0.0) + time.perf_counter() - t0, 4)


def train(cfg: TrainConfig, run_dir: Path, groups: dict[str, WorkerGroup] | None = None,
          stop: StopRequest | None = None, metrics: dict | None = None, own: dict[str, tuple[str, dict]] | None = None,
          driver: Driver | None = None, began: tuple[float, str, list] | None = None) -> tuple[list[dict], str | None]:
    """Train to cfg.total_steps with `driver` (the built-in PPO loop, `ppo`, when None), resuming
    from the run's newest good checkpoint. Returns (this call's metrics records, why it stopped early
    or None). RUN_DIR/status.json and events.jsonl say what it is doing (hpcrl status, hpcrl
    report); `metrics` adds trackers (MetricsLog's tensorboard, wandb); `own`: your own roles
    (build_worker_groups). `began`: when this start began, since what, and its phases before the
    driver's (hpcrl/observe/startup.py; default: since this process started)."""
    run_dir = Path(run_dir)
    status = RunStatus(run_dir, cfg.total_steps)
    clock = StartupClock(status, *(began or (process_started(), "the driver's start", [("driver", time.time())])))
    model_dir, prompts_path = prepare_inputs(cfg, run_dir)
    log = None
    try:
        log = MetricsLog(run_dir, **(metrics or {}))
        # the tokenizer and prompts are read while the roles start: on a GPU node through Slurm the driver's
        # transformers import and its tokenizing of 4,300 prompts took 6.9 s after the roles were up
        with ThreadPoolExecutor(1, thread_name_prefix="hpcrl-inputs") as reading:
            inputs = reading.submit(Inputs.read, cfg, model_dir, prompts_path)
            if groups is None:
                groups = build_worker_groups(cfg, model_dir, run_dir, own)
                clock.roles({r: wg.startup() for r, wg in groups.items()})
        status.attach(groups)
        ctx = RunContext(cfg, run_dir, groups, model_dir, status, stop or StopRequest(), log, prompts_path, startup=clock,
                         inputs=inputs.result())
        try:
            reason = (driver or ppo)(ctx)
        except (CallAbandoned, RoleHung) as e:     # the last step done is committed; the job requeues
            reason = ctx.stop_at_boundary(e)
        ctx.committing = True
        ctx.checkpoints.finish()
    except RoleStateLost as e:     # the job requeues; its next start resumes every role from the newest committed step
        print(f"{log_stamp()} {e}: the run stops here", flush=True)
        reason = str(e)
    except BaseException as e:
        why = storage_failure(e)
        if why is None:
            status.event("fail", step=status.doc["step"], **failure(e))
            raise
        message = CheckpointStore(run_dir).refused_write(why, status.doc["step"])
        status.event("fail", step=status.doc["step"], error=message)     # once the directory takes writes
        raise StorageError(message) from None
    finally:
        if log is not None:
            log.close()
    if reason:
        status.event("stop", step=status.doc["step"], reason=reason)
    else:
        status.event("finish", step=cfg.total_steps)
    return ctx.history, reason


def failure(e: BaseException) -> dict:
    """What a failed run's events and status say of the error: its type and last line (a role's error
    by its own type, not as Ray wraps it), where it was raised (role, rank, method) and its traceback."""
    cause = getattr(e, "cause", None) or e        # a role's error arrives as a RayTaskError around it
    lines = str(cause).strip().splitlines()
    origin = getattr(cause, "hpcrl_origin", None)
    where = f" (role {origin['role']}, rank {origin['rank']}, {origin['method']})" if origin else ""
    return {"error": f"{type(cause).__name__}: {lines[-1] if lines else ''}".strip() + where,
            **({"origin": origin} if origin else {}),
            "traceback": "".join(traceback.format_exception(e))[-20000:]}


def ppo(ctx: RunContext) -> str | None:
    """The built-in loop (PPO with GAE, or a critic-free estimator: docs/pages/algorithms/menu.md),
    sequential or pipelined as cfg.rollout.pipeline says; a driver of your own starts as a copy of it."""
    cfg, groups, status = ctx.cfg, ctx.groups, ctx.status
    actor, critic, ref, rollout = (groups.get(r) for r in ("actor_rollout", "critic", "ref", "rollout"))
    pipelined = cfg.rollout.pipeline != "off"
    algorithm = cfg.algorithm
    kl_ctl = (algo.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
              if algorithm.kl_target else algo.FixedKLController(algorithm.kl_coef))

    def routed(route: dict) -> None:      # once per choice of the route, not per step
        status.event("weight_sync", step=status.doc["step"], **route)
        print(f"{log_stamp()} weights to the rollout role by {route['path']}"
              + (f" ({route['backend']})" if route["backend"] else "")
              + f" to {route['receivers']} ranks, ready in {route['seconds']:.2f} s", flush=True)

    weights = WeightSync(actor, rollout, cfg.rollout, routed)
    for wg in (rollout, actor) if rollout else (actor,):   # after a rebuild (and the actor's restore): the weights
        wg.on_restart(weights.resend)

    # scoring that needs no trained weights: pipelined, it runs as soon as a batch is generated,
    # while the step before still trains, unless it shares a trainer's processes (it would hold them up)
    weight_free = [*ctx.scores] + ([ref.compute_ref_log_prob] if ref else [])
    early = [m for m in weight_free if pipelined and not any(m.wg.shares_processes_with(t) for t in (actor, critic) if t)]
    late = [m for m in weight_free if m not in early] + [actor.compute_log_prob] + ([critic.compute_values] if critic else [])
    buffered = cfg.rollout.pipeline == "async"
    ahead_args = (ctx.dataset, ctx.generate, early, cfg.rollout.n_samples, cfg.rollout.max_staleness if pipelined else 0,
                  cfg.total_steps)
    if buffered and cfg.rollout.partial_rollout == "continue":
        lookahead = SegmentedProducer(*ahead_args, segment=cfg.rollout.segment_tokens,
                                      max_new_tokens=cfg.rollout.max_new_tokens, pad_id=ctx.tokenizer.pad_id)
    else:
        lookahead = (Producer if buffered else Lookahead)(*ahead_args)
    ctx.generating = lookahead.steps     # said when a role is rebuilt meanwhile

    try:
        start = 0
        if resumed := ctx.resume():
            start = resumed.step
            kl_ctl.value = resumed.state["kl_coef"]
            weights.version = resumed.state.get("policy_version", start if start > cfg.optim.critic_warmup else 0)
            lookahead.resume(start, resumed.inflight)
            weights.send(weights.version)
        # a resumed run's trainers load their compiled layers (cached by the earlier start) on made-up batches
        # while the rollout generates the first batch; their first real calls queue behind. Not on a first start:
        # compiling cold on made-up sizes took longer than the first step's own compiles (an H100: 41 s vs 27 s)
        ahead = [wg.compile_ahead.future() for wg in (actor, critic, ref)
                 if wg and start > 0 and cfg.engine.compile and wg.on_cuda]
        # the score before training: issued behind the first step's generation, collected after the first
        # update, so that a rollout role of its own answers it while the actor trains (with the first weights)
        score_before = ctx.held_out is not None and cfg.validation.before_train and start == 0
        before_train = None     # its scores to come, once issued
        bar = _progress(cfg, start)
        for step in range(start + 1, cfg.total_steps + 1):
            timer, t_step = _Timer(status, step), time.perf_counter()

            # 1. this step's batch (the next ones issued first), then everything that reads it, issued
            # together as futures: the batch goes rank to rank, not through the driver
            def scored(generation: Generation) -> Batch:
                with timer("generate"):      # multi-turn episodes are made right here, turn by turn
                    source = generation.generated
                    batch = generation.collect()
                    weights.arrived()               # the weights sent after the last update are in
                # each sample's: a step's batch and its refills may have been sampled with different weights
                # (partial rollouts: each sample's oldest token's, already there)
                if "policy_version" not in batch:
                    batch["policy_version"] = torch.full((len(batch),), int(batch.meta.get("policy_version", 0)))
                with timer("score"):
                    for f in [m.future(source) for m in late]:
                        batch = batch.union(f.result())
                    batch["scores"] = weighted_scores(batch, cfg.reward.terms())
                    batch["scores"] = episode_scores(batch, cfg.environment.failed_score)
                return batch

            with timer("generate"):
                current = lookahead.take(step)
            if score_before and step == 1:
                before_train = ctx.validate(0)
            batch = scored(current)

            # 2. advantages, on the driver, of the samples the step trains on: with dynamic sampling,
            # batches generated until data.batch_size groups are left (or the refills run out)
            trained, refills = groups_to_train(batch, cfg), 0
            while algorithm.dynamic_sampling and _groups(trained).unique().numel() < cfg.data.batch_size \
                    and refills < algorithm.refills:
                refills += 1
                batch = Batch.concat([batch, scored(lookahead.refill(step, refills))])
                trained = groups_to_train(batch, cfg)
            batch.meta["refills"] = refills
            with timer("advantage"):
                trained = first_groups(trained, cfg.data.batch_size)
                kl_metrics = compute_advantages(trained, cfg, kl_ctl)

            # 3. updates: critic first, then actor, then the new weights to the generating engine (one
            # after the other: at once they would contend for the cores of a shared host); none when
            # dynamic sampling left nothing to train on
            trained_with, critic_stats, actor_stats = weights.version, {}, {}
            if critic and len(trained):
                with timer("update_critic"):
                    critic_stats = critic.update_critic(pad_for_ranks(trained, critic.world_size))[0]
            if step > cfg.optim.critic_warmup and len(trained):
                with timer("update_actor"):
                    actor_stats = actor.update_actor(pad_for_ranks(trained, actor.world_size))[0]
                with timer("sync_weights"):
                    weights.send(step, wait=not pipelined)

            train_s = time.perf_counter() - t_step
            val_scores = {}
            if ctx.held_out is not None and cfg.validation.every and (step % cfg.validation.every == 0
                                                                      or step == cfg.total_steps):
                with timer("validate"):
                    val_scores = ctx.validate(step)()
            record = step_record(step, batch, trained, [s.role for s in cfg.reward.terms()], kl_metrics, actor_stats,
                                 critic_stats if critic else None, trained_with, timer.times,
                                 time.perf_counter() - t_step, train_s, val_scores)
            if buffered:
                record.update(lookahead.measures())
            if before_train:
                ctx.log({"step": 0, "time": round(time.time(), 3), **before_train()})
                before_train = None
            for f in ahead:      # done long since: a failure is said here
                f.result()
            ahead = []
            ctx.log(record)
            bar(record)

            # 4. checkpoint: periodically, at the end, and when asked to stop (then stop); with the
            # batches generated ahead, which a resumed run could not make again
            if reason := ctx.end_step(step, {"kl_coef": kl_ctl.value, "policy_version": weights.version},
                                      inflight=lookahead.held()):
                return reason
        return None
    finally:
        if buffered:
            lookahead.close()


def _progress(cfg: TrainConfig, start: int = 0):
    """A live tqdm bar on a terminal; in a file (the Slurm output), one dated line per step."""
    if not cfg.progress:
        return lambda record: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=cfg.total_steps, initial=start, desc="ppo", unit="step")

        def show(r):
            bar.update(1)
            bar.set_postfix(reward=f"{r['reward/mean']:.3f}", kl=f"{r['kl']:.4f}", tok_s=f"{r['throughput/tokens_per_s']:.0f}")
            if r["step"] == cfg.total_steps:
                bar.close()
        return show

    def line(r):
        losses = "".join(f" {name} {r[key]:.4f}" for name, key in (("pg_loss", "actor/pg_loss"), ("vf_loss", "critic/vf_loss"))
                         if r.get(key) is not None)
        print(f"{log_stamp()} step {r['step']}/{cfg.total_steps} reward {r['reward/mean']:.3f} kl {r['kl']:.4f}{losses} "
              f"resp_len {r['response_length/mean']:.2f} tokens/s {r['throughput/tokens_per_s']:.0f} "
              f"({r['timing/step']:.2f} s)", flush=True)
    return line
