"""PPOConfig: the `train:` section of a job spec, one field per setting, each with what it does."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


class RolePlace(NamedTuple):
    """Where the job spec puts a role: its hetjob component, its nodes and GPUs (all nodes), and the
    spec field that gives them (`roles.<the component's first role>`), for messages."""
    component: int
    nodes: int
    gpus: int
    field: str


class Scorer(NamedTuple):
    """One term of a sample's score (train.rewards): weight × role.method(batch)["scores"]."""
    role: str
    method: str = "compute_scores"
    weight: float = 1.0


class ConfigError(ValueError):
    """Every problem of the training settings at once, each `train.<field>: what is wrong`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def spec_key(key) -> str:
    """A key of the spec as messages show it: as written, or quoted where it holds anything odd
    (a space, a colon, a control character), so a message always starts with one field path."""
    return str(key) if re.fullmatch(r"[A-Za-z0-9_+-]+", str(key)) else repr(key)


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take, declared beside it (`number`): ge/gt its lowest value
    (allowed / excluded), le/lt its highest, None for no bound; `off`: one value outside them that
    turns the setting off. NaN and infinity are never in range."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    off: float | None = None

    def __str__(self) -> str:
        bounds = [f"{sign} {bound}" for sign, bound in (("≥", self.ge), (">", self.gt), ("≤", self.le), ("<", self.lt))
                  if bound is not None]
        allowed = " and ".join(bounds) or "finite"
        return allowed if self.off is None else f"{allowed}, or {self.off} (off)"

    def problem(self, name: str, value) -> str | None:
        """Why `value` is not in this range (the setting named, and what it must be), or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name}: {value} is not a finite number; it must be {self}"
        outside = ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                   or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt))
        return f"{name}: {value} is out of range; it must be {self}" if outside and value != self.off else None


FINITE = Range()
"""any finite number: the range of a setting declared without `number`"""


def number(default: float, **bounds):
    """A numeric setting's default and its Range, e.g. `top_p: float = number(1.0, gt=0, le=1)`."""
    return field(default=default, metadata={"range": Range(**bounds)})


@dataclass
class PPOConfig:
    seed: int = number(1, ge=0)
    """seeds the model's initial weights, the prompt order and every sampler"""
    total_steps: int = number(150, ge=1)
    """training steps; each is one batch of prompts: generate, score, advantages, updates"""

    # --- data and task
    dataset: str = ""
    """training prompts, JSONL or Parquet: {"prompt": text | chat messages} or {"prompt_ids": [...]},
    verl's format as it is (data_source, prompt, reward_model.ground_truth, extra_info); every other
    field goes to the reward function (hpcrl/ppo/data.py). Empty: the built-in copy task writes
    RUN_DIR/prompts.jsonl"""
    max_prompt_length: int = number(0, ge=0)
    """prompts longer than this many tokens are left out (counted in the log), never cut; 0: no limit"""
    task_digits: int = number(2, ge=1)
    """copy task: digits per prompt ("12=" must be answered "12")"""
    task_prompts: int = number(4096, ge=1)
    """copy task: distinct prompts generated"""
    reward_fn: str = ""
    """rule reward `module:function`, called as fn(prompt, response, **fields) -> float in the reward
    role. Empty: with a dataset, the built-in scorer of each sample's data_source (GSM8K, MATH,
    reasoning-gym…: hpcrl/ppo/verifiers.py); without one, the copy task's rule"""
    reward_batched: bool = False
    """reward_fn takes the whole batch: fn(prompts, responses, **fields as lists) -> a score per sample"""
    reward_model_dir: str = ""
    """a sequence-scoring HF model directory; when set it scores instead of reward_fn"""
    missing_eos_penalty: float = number(0.0, ge=0)
    """subtracted from the score of a response that never emitted the stop token"""
    rewards: list[dict] = field(default_factory=list)
    """a sample's score as a weighted sum of roles' scores, e.g. [{role: reward}, {role: rule_engine,
    method: compute_rule_score, weight: 0.5}]: `method` (default compute_scores) of the role (the
    built-in reward, or one of your own: roles.<role>.worker) gets the generated batch and returns
    Batch({"scores": one float per sample}); each is logged as score/<role>. Empty: the reward role
    alone, weight 1"""

    # --- validation
    val_dataset: str = ""
    """held-out prompts, in the same formats as dataset; empty: no validation"""
    val_every: int = number(0, ge=0)
    """validate after every this many steps (and after the last); 0: only as val_before_train says"""
    val_before_train: bool = False
    """validate once before the first step (recorded as step 0 in metrics.jsonl)"""
    val_samples: int = number(1, ge=1)
    """responses per held-out prompt"""
    val_temperature: float = number(0.0, ge=0)
    """sampling temperature of validation; 0: greedy"""

    # --- model
    model_dir: str = ""
    """an HF causal LM directory; empty: a tiny Qwen2 built from the sizes below into RUN_DIR/model"""
    hidden_size: int = number(128, ge=1)
    """tiny model width (head_dim = hidden_size / heads must be ≥ 32)"""
    layers: int = number(2, ge=1)
    """tiny model depth"""
    heads: int = number(4, ge=1)
    """tiny model attention heads"""
    critic_init: str = "actor"
    """"actor" (the policy's backbone, fresh value head) or a reward model directory"""

    # --- rollout
    batch_size: int = number(64, ge=1)
    """prompts per step"""
    n_samples: int = number(1, ge=1)
    """responses per prompt (GRPO needs ≥ 2: the group to normalise against)"""
    max_new_tokens: int = number(3, ge=1)
    """longest response"""
    temperature: float = number(1.0, gt=0)
    """sampling temperature; the same temperature scales the actor's and reference's log-probs"""
    top_p: float = number(1.0, gt=0, le=1)
    """nucleus sampling"""
    top_k: int = number(0, ge=0)
    """top-k sampling (0: off)"""
    rollout_engine: str = "torch"
    """"torch" (samples with the training module itself) or "vllm" (a vLLM engine in the rollout
    process; the actor's new weights are loaded into it in place after every update)"""
    rollout_role: bool = False
    """generate in a separate `rollout` role (its own nodes in the spec) instead of in actor_rollout;
    the actor's weights travel to it through Ray's object store after every update"""
    pipeline: str = "off"
    """"off": each step generates, scores and trains in turn. "one_step_off": the rollout role
    generates the batch of step k+1 (with the weights of step k−1) while step k is scored and
    trained, and scores it (reward, reference) while step k still trains; needs rollout_role.
    The PPO ratio still uses log-probs the actor recomputes before its update"""
    max_staleness: int = number(1, ge=1)
    """one_step_off: batches generated ahead of the step being trained, so a batch trains with
    weights this many updates newer than the ones that sampled it"""
    tis_cap: float = number(0.0, ge=0)
    """> 0: truncated importance sampling (verl's TIS): each token's policy loss is weighted by
    min(π_actor/π_rollout, tis_cap) of its old log-probs, which corrects for the sampler's weights
    (or kernels) differing from the actor's; 0: off"""
    rollout_tensor_parallel: int = number(1, ge=1)
    """vLLM tensor parallel size: GPUs per engine (CPU: 1)"""
    rollout_gpu_memory: float = number(0.5, gt=0, le=1)
    """vLLM: fraction of a GPU's memory for its weights and KV cache"""
    rollout_max_model_len: int = number(0, ge=0)
    """vLLM: longest prompt + response (0: the model's max_position_embeddings)"""
    cache_dir: str = ""
    """compile caches and temp files of the rollout engine (vLLM, torch inductor); empty: RUN_DIR/cache.
    Runs that share one reuse each other's compiled kernels"""

    # --- training engine
    train_engine: str = "torch"
    """"torch" (DDP on CPU, FSDP2 on GPUs) or "megatron" (megatron-core, GPU only: tensor and
    pipeline parallelism, distributed optimizer) for the actor, critic and reference"""
    tensor_parallel: int = number(1, ge=1)
    """megatron: GPUs that split each layer (must divide the heads, KV heads and FFN width)"""
    pipeline_parallel: int = number(1, ge=1)
    """megatron: stages the layers are split into (must divide the layer count)"""
    precision: str = "auto"
    """"auto" (bf16 autocast on GPU, fp32 on CPU), "bf16" or "fp32" for the torch engine; megatron is bf16"""
    compile: bool = True
    """on GPUs, torch.compile the decoder layers of the torch engine (not under FSDP2) and of
    megatron (without TP or PP), and the static-cache rollout's decode step (fused norms, RoPE and
    activations: fewer, larger kernels; the first steps pay the compilation, tens of seconds per
    role, once per kind of call: with or without gradients or padding). false: eager, e.g. for a
    model Inductor cannot compile"""

    # --- advantages and KL
    advantage: str = "gae"
    """"gae" (with the critic) or "grpo" (group-normalised scores, no critic)"""
    gamma: float = number(1.0, ge=0, le=1)
    """discount"""
    lam: float = number(0.95, ge=0, le=1)
    """GAE λ"""
    whiten_advantages: bool = True
    """normalise GAE advantages over the batch's valid tokens"""
    kl_coef: float = number(0.01, ge=0)
    """β: weight of KL(π‖π_ref)"""
    kl_in_reward: bool = True
    """put −β·KL in the token rewards"""
    kl_loss: bool = False
    """add β·KL to the actor's loss instead (both only when both are set)"""
    kl_estimator: str = "k1"
    """k1, k2 or k3 for the reward penalty"""
    kl_loss_estimator: str = "k3"
    """k1, k2 or k3 for the loss term"""
    kl_target: float = number(0.0, ge=0)
    """> 0: adaptive β that steers KL to this value"""
    kl_horizon: float = number(10000.0, gt=0)
    """adaptive β: samples over which β may change by ±20%"""

    # --- optimisation
    ppo_epochs: int = number(2, ge=1)
    """passes over each step's batch"""
    mini_batch_size: int = number(32, ge=1)
    """samples per optimizer step (across the role's ranks)"""
    micro_batch_size: int = number(32, ge=1)
    """samples per forward/backward on one rank (gradient accumulation below mini_batch_size)"""
    micro_batch_tokens: int = number(0, ge=0)
    """> 0: a micro-batch also holds at most this many tokens (rows × (longest prompt + longest
    response), the padding all its rows share cut away), so long and short samples neither run out of
    memory nor compute on padding (torch engine)"""
    actor_lr: float = number(1e-3, gt=0)
    """actor AdamW learning rate"""
    critic_lr: float = number(2e-3, gt=0)
    """critic AdamW learning rate"""
    warmup_steps: int = number(5, ge=0)
    """optimizer steps of linear LR warm-up"""
    weight_decay: float = number(0.0, ge=0)
    """AdamW weight decay"""
    grad_clip: float = number(1.0, gt=0)
    """gradient norm clip"""
    clip_low: float = number(0.2, gt=0, lt=1)
    """PPO ε below 1"""
    clip_high: float = number(0.2, gt=0)
    """PPO ε above 1 (raise it for DAPO's clip-higher)"""
    dual_clip: float = number(0.0, gt=1, off=0)
    """> 1: dual-clip constant c for negative advantages (0: off)"""
    vf_clip: float = number(0.5, ge=0)
    """value clip around the old values (0: off)"""
    entropy_coef: float = number(0.01, ge=0)
    """entropy bonus"""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean"""
    critic_warmup: int = number(0, ge=0)
    """steps that train only the critic"""

    # --- checkpoints
    save_every: int = number(0, ge=0)
    """steps between checkpoints (0: only when stopped by a signal or the deadline, and at the end)"""
    save_last: bool = True
    """checkpoint after the last step (off for benchmarks that only time the steps)"""
    keep_last: int = number(3, ge=0)
    """committed steps kept (older ones are deleted once a newer one is committed)"""
    keep_every: int = number(0, ge=0)
    """also keep every step that is a multiple of this (0: none)"""
    async_save: bool = False
    """write the periodic checkpoints on a background thread while training goes on"""
    checkpoint_io: str = "auto"
    """how a data-parallel role of several ranks writes its file. parallel: all its ranks write one
    file together (parallel HDF5; needs h5py built with MPI and a Slurm job to run the writers as a
    step of); serial: rank 0 writes it; auto: parallel where possible, else serial"""

    # --- layout and fault tolerance
    colocate: list[list[str]] = field(default_factory=list)
    """groups of roles that share one process per rank, e.g. [[actor_rollout, ref]]"""
    processes_per_node: dict[str, int] = field(default_factory=dict)
    """role -> processes per CPU node (a GPU node runs one per GPU)"""
    standby: bool = False
    """keep an idle process per rank so a dead rank is replaced without a process start"""
    snapshot_every: int = number(1, ge=0)
    """steps between snapshots of the training roles' state (weights, optimizer, RNG: what their
    checkpoint holds) in host memory, in the object store of each role's rank 0 node. A role whose
    process dies is rebuilt from its newer snapshot or committed checkpoint, and the updates made
    since are made again: it goes on with exactly the state it had. 0: no snapshots (a rebuilt role
    then replays every update since the newest checkpoint; the driver keeps their batches)"""
    restart_limit: int = number(3, ge=0)
    """rebuilds of one role allowed per hour before the run fails"""
    progress: bool = True
    """a progress bar on the console"""

    PATHS = ("model_dir", "dataset", "val_dataset", "reward_model_dir", "critic_init", "cache_dir")
    """Settings that name files or folders: taken relative to where the spec is loaded, as run_dir is
    (the job's steps run in the run directory)."""

    @classmethod
    def resolve_paths(cls, data: dict, base: Path) -> dict:
        """data with its path settings absolute (critic_init "actor" is not a path)."""
        out = dict(data)
        for name in cls.PATHS:
            value = out.get(name)
            if isinstance(value, str) and value and not (name == "critic_init" and value == "actor"):
                out[name] = str((base / Path(value).expanduser()).resolve())
        return out

    def missing_paths(self) -> list[str]:
        """The path settings that name nothing here (checked before submission: the login node sees
        the shared filesystem the job will read them from)."""
        problems = []
        for name in self.PATHS:
            value = getattr(self, name)
            if value and not (name == "critic_init" and value == "actor") and name != "cache_dir" \
                    and not Path(value).exists():
                problems.append(f"train.{name}: {value} does not exist (a path on storage every node sees)")
        return problems

    @classmethod
    def from_dict(cls, data: dict | None, where: str = "train") -> PPOConfig:
        """Unknown or ill-typed settings are errors that name the field."""
        data = dict(data or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        problems = [f"{where}.{spec_key(k)}: unknown setting (known: {', '.join(known)})" for k in data
                    if k not in known]
        typed = {k: v for k, v in data.items() if k in known and _type_ok(v, known[k].type)}
        problems += [f"{where}.{k}: expected {known[k].type}, got {v!r}" for k, v in data.items()
                     if k in known and k not in typed]
        cfg = cls(**typed)
        problems += [f"{where}.{p}" for p in cfg.problems()]
        if problems:
            raise ConfigError(problems)
        return cfg

    def problems(self) -> list[str]:
        # every setting by the range declared beside it; one without (text, a list, a number added
        # without `number`) need only not be NaN or infinite
        p = [problem for f in dataclasses.fields(self)
             if (problem := f.metadata.get("range", FINITE).problem(f.name, getattr(self, f.name)))]
        if not isinstance(self.processes_per_node, dict):
            p.append(f"processes_per_node: {self.processes_per_node!r} is not a mapping of role to processes, "
                     "e.g. {reward: 4}")
        else:
            p += [f"processes_per_node.{role}: {n!r} must be a whole number ≥ 1"
                  for role, n in self.processes_per_node.items() if isinstance(n, bool) or not isinstance(n, int) or n < 1]
        p += [f"{name}: {getattr(self, name)!r} holds control characters (a newline, a NUL), which no path can"
              for name in self.PATHS if any(ord(c) < 32 or ord(c) == 127 for c in getattr(self, name))]
        if not self.colocate_ok:
            p.append(f"colocate: {self.colocate!r} is not a list of lists of role names, e.g. [[actor_rollout, ref]]")
        p += self.rewards_problems()
        if self.advantage not in ("gae", "grpo"):
            p.append(f"advantage: {self.advantage!r} is not gae or grpo")
        if self.rollout_engine not in ("torch", "vllm"):
            p.append(f"rollout_engine: {self.rollout_engine!r} is not torch or vllm")
        if self.rollout_tensor_parallel > 1 and self.rollout_engine != "vllm":
            p.append(f"rollout_tensor_parallel: {self.rollout_tensor_parallel} needs rollout_engine: vllm "
                     "(or rollout_tensor_parallel: 1)")
        if self.pipeline not in ("off", "one_step_off"):
            p.append(f"pipeline: {self.pipeline!r} is not off or one_step_off")
        elif self.pipeline == "one_step_off" and not self.rollout_role:
            p.append("pipeline: one_step_off overlaps a separate rollout role with the trainers; set "
                     "rollout_role: true (and give roles.rollout its nodes), or pipeline: off")
        elif self.pipeline == "one_step_off" and any("rollout" in g and "actor_rollout" in g for g in self.colocate
                                                     if isinstance(g, list)):
            p.append("pipeline: one_step_off, but colocate puts rollout in actor_rollout's processes, where the "
                     "two cannot run at once; place rollout apart, or pipeline: off")
        if self.train_engine not in ("torch", "megatron"):
            p.append(f"train_engine: {self.train_engine!r} is not torch or megatron")
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) > 1 and self.train_engine != "megatron":
                p.append(f"{name}: {getattr(self, name)} needs train_engine: megatron (or {name}: 1)")
        if self.precision not in ("auto", "bf16", "fp32"):
            p.append(f"precision: {self.precision!r} is not auto, bf16 or fp32")
        if self.checkpoint_io not in ("auto", "parallel", "serial"):
            p.append(f"checkpoint_io: {self.checkpoint_io!r} is not auto, parallel or serial")
        if self.advantage == "grpo" and self.n_samples < 2:
            p.append("n_samples: GRPO needs ≥ 2 responses per prompt to normalise against")
        for name in ("kl_estimator", "kl_loss_estimator"):
            if getattr(self, name) not in ("k1", "k2", "k3"):
                p.append(f"{name}: {getattr(self, name)!r} is not k1, k2 or k3")
        if self.loss_agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            p.append(f"loss_agg_mode: {self.loss_agg_mode!r} is not token-mean, seq-mean-token-sum or seq-mean-token-mean")
        if self.mini_batch_size >= 1 and (self.batch_size * self.n_samples) % self.mini_batch_size:
            p.append(f"mini_batch_size: {self.mini_batch_size} does not divide batch_size × n_samples = "
                     f"{self.batch_size * self.n_samples}")
        if self.micro_batch_size > self.mini_batch_size:
            p.append(f"micro_batch_size: {self.micro_batch_size} is larger than mini_batch_size {self.mini_batch_size}")
        if (self.val_every or self.val_before_train) and not self.val_dataset:
            p.append("val_dataset: missing; val_every / val_before_train validate on it (give a JSONL or Parquet "
                     "file of held-out prompts)")
        if self.micro_batch_tokens and self.train_engine == "megatron":
            p.append("micro_batch_tokens: needs train_engine: torch (megatron's pipeline sends micro-batches of "
                     "one shape); set it to 0")
        return p

    def rewards_problems(self) -> list[str]:
        if not isinstance(self.rewards, list):
            return [f"rewards: {self.rewards!r} is not a list, e.g. [{{role: reward}}, {{role: rule_engine, "
                    "method: compute_rule_score, weight: 0.5}]"]
        p, seen = [], set()
        for i, entry in enumerate(self.rewards):
            where = f"rewards[{i}]"
            if not isinstance(entry, dict):
                p.append(f"{where}: {entry!r} is not a mapping like {{role: rule_engine, method: compute_rule_score, "
                         "weight: 0.5}")
                continue
            p += [f"{where}.{spec_key(k)}: unknown key (known: role, method, weight)" for k in entry
                  if k not in Scorer._fields]
            role, method, weight = (entry.get(k, Scorer._field_defaults.get(k)) for k in Scorer._fields)
            if not isinstance(role, str) or not role:
                p.append(f"{where}.role: missing; name the role whose method scores (reward, or a role of your own)")
            elif role in seen:
                p.append(f"{where}.role: {role} is listed twice; one scoring method per role")
            else:
                seen.add(role)
            if not isinstance(method, str) or not method.isidentifier():
                p.append(f"{where}.method: {method!r} is not a method name")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                p.append(f"{where}.weight: {weight!r} is not a number")
            elif problem := FINITE.problem(f"{where}.weight", weight):
                p.append(problem)
        return p

    def scorers(self) -> list[Scorer]:
        """train.rewards as Scorers; the reward role alone when it is empty."""
        return [Scorer(**e) for e in self.rewards] or [Scorer("reward")]

    def reward_function(self) -> str:
        """reward_fn, or its default: each sample's data_source scorer with a dataset, the copy task's rule without."""
        return self.reward_fn or ("hpcrl.ppo.verifiers:by_data_source" if self.dataset else
                                  "hpcrl.ppo.tasks.copy_digits:score")

    @property
    def colocate_ok(self) -> bool:
        return isinstance(self.colocate, list) and all(
            isinstance(g, list) and g and all(isinstance(r, str) for r in g) for g in self.colocate)

    def world_size(self, role: str, place: RolePlace) -> int:
        """The data-parallel ranks of a role: one per GPU (per TP × PP group with megatron), else
        processes_per_node per node."""
        if place.gpus and self.train_engine == "megatron":
            return max(1, place.gpus // (self.tensor_parallel * self.pipeline_parallel))
        return place.gpus or place.nodes * self.processes_per_node.get(role, 1)

    def placement_problems(self, places: dict[str, RolePlace], own: tuple[str, ...] = ()) -> list[str]:
        """What these settings need of the spec's roles (`own`: those with a worker class of their
        own): every role they run placed, the scorers among the reward role and your own, colocated
        roles in one component, megatron's roles on GPUs that its TP × PP layout divides, a
        mini-batch for every rank of a training role, vLLM's tensor parallelism on the GPUs of the
        generating role."""
        problems = [f"roles.{r}: missing; train needs it (advantage={self.advantage}, kl_coef={self.kl_coef}) — "
                    f"give it resources or same_nodes_as: <role>" for r in self.roles() if r not in places]
        problems += [f"train.rewards[{i}].role: {s.role} is not " + (
                     f"a role that scores (the reward role, or one of your own with roles.{s.role}.worker)"
                     if s.role in places else f"a role of this spec (roles: {', '.join(places)})")
                     for i, s in enumerate(self.scorers()) if s.role != "reward" and s.role not in own]
        for role in ("actor_rollout", "critic"):
            if role in self.roles() and role in places and isinstance(self.processes_per_node, dict):
                world = self.world_size(role, places[role])
                if self.mini_batch_size % world:
                    problems.append(f"train.mini_batch_size: {self.mini_batch_size} is not a multiple of the {world} "
                                    f"ranks of role {role} ({places[role].field}); each rank takes an equal share")
        generator = "rollout" if self.rollout_role else "actor_rollout"
        if self.rollout_tensor_parallel > 1 and generator in places:
            gpus = places[generator].gpus // max(1, places[generator].nodes)
            if not gpus or gpus % self.rollout_tensor_parallel:
                problems.append(f"train.rollout_tensor_parallel: {self.rollout_tensor_parallel} GPUs per vLLM engine, "
                                f"but role {generator} has {gpus} GPUs per node ({places[generator].field}); it must "
                                "divide them")
        for k, group in enumerate(self.colocate if self.colocate_ok else []):
            unknown = [r for r in group if r not in [*self.roles(), *own]]
            if unknown:
                problems.append(f"train.colocate[{k}]: {unknown} not among the roles this training runs "
                                f"{[*self.roles(), *own]}")
            elif len({places[r].component if r in places else None for r in group}) > 1:
                problems.append(f"train.colocate[{k}]: {group} are in different Slurm components; colocated roles "
                                f"need the same nodes (same_nodes_as: {group[0]})")
        problems += [f"train.processes_per_node.{r}: not a role of this spec" for r in self.processes_per_node
                     if r not in places]
        if self.train_engine == "megatron":
            need = self.tensor_parallel * self.pipeline_parallel
            for r in ("actor_rollout", "critic", "ref"):
                if r not in self.roles() or r not in places:
                    continue
                place = places[r]
                if not place.gpus:
                    problems.append(f"{place.field}: no GPUs, but train.train_engine: megatron runs role {r} on GPUs "
                                    "(set gpus_per_node, or use train_engine: torch)")
                elif place.gpus % need:
                    problems.append(f"train.tensor_parallel: {self.tensor_parallel} × pipeline_parallel "
                                    f"{self.pipeline_parallel} = {need} GPUs per model does not divide the "
                                    f"{place.gpus} GPUs of role {r} ({place.field})")
        return problems

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_ref(self) -> bool:
        return self.kl_coef > 0 and (self.kl_in_reward or self.kl_loss)

    def roles(self) -> list[str]:
        """The roles this configuration runs; the job spec must give each one resources."""
        return ["actor_rollout"] + (["rollout"] if self.rollout_role else []) + (["critic"] if self.uses_critic else []) + (["ref"] if self.uses_ref else []) + ["reward"]


def _type_ok(value, annotation: str) -> bool:
    base = {"int": int, "float": (int, float), "str": str, "bool": bool}.get(annotation)
    if base is None:
        return True  # containers are checked where they are used
    if annotation != "bool" and isinstance(value, bool):
        return False
    return isinstance(value, base)
