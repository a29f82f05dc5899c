"""TrainConfig: the `train:` section of a job spec, typed and parsed once with the spec.

The settings are grouped into sections (data, validation, reward, model, rollout, engine,
algorithm, optim, checkpoint, layout, environment); each section is a pydantic model whose field types carry the
ranges (a setting out of range, NaN or infinite is refused by name) and whose validators check what
concerns it alone. What spans sections is `TrainConfig.problems()`, in one place. Each field's
docstring is its documentation: the reference (docs) and `hpcrl schema` are generated from it.

The flat keys of earlier releases (`train.actor_lr`) are still read, moved to their section
(`train.optim.actor_lr`) with a note naming the new key (`upgrade_flat_keys`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import typing

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, field_validator,
                      model_validator)


def _one_line(value: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{value!r} holds control characters (a newline, a NUL), which no path can")
    return value


PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
PathText = Annotated[str, AfterValidator(_one_line)]
"""a file or folder: relative ones are taken from where the spec is loaded"""


class Settings(BaseModel):
    """A section of the training settings: unknown keys are errors, values are of their type as
    YAML writes it (no "1" for 1, no 1.5 for an int), numbers finite, assignments checked."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True,
                              use_attribute_docstrings=True, protected_namespaces=())


class ConfigError(ValueError):
    """Every problem of the training settings at once, each `train.<section>.<field>: what is wrong`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def spec_key(key) -> str:
    """A key of the spec as messages show it: as written, or quoted where it holds anything odd
    (a space, a colon, a control character), so a message always starts with one field path."""
    return str(key) if re.fullmatch(r"[A-Za-z0-9_+-]+", str(key)) else repr(key)


class DataSettings(Settings):
    """The training prompts."""
    dataset: PathText = ""
    """training prompts, JSONL or Parquet: {"prompt": text | chat messages} or {"prompt_ids": [...]},
    verl's format as it is (data_source, prompt, reward_model.ground_truth, extra_info); every other
    field goes to the reward function (hpcrl/ppo/data.py). Empty: the built-in copy task writes
    RUN_DIR/prompts.jsonl"""
    batch_size: PositiveInt = 64
    """prompts per step"""
    max_prompt_length: Count = 0
    """prompts longer than this many tokens are left out (counted in the log), never cut; 0: no limit"""
    task: Literal["copy_digits", "tool_sums"] = "copy_digits"
    """the built-in task (no dataset): "copy_digits" ("12=" answered "12"), or "tool_sums" ("37+45="
    answered "82", with environment.cls hpcrl.ppo.tasks.tool_sums:SumsEnvironment a calculator to call)"""
    task_digits: PositiveInt = 2
    """built-in task: digits per number"""
    task_digits_sigma: Annotated[float, Field(ge=0)] = 0.0
    """built-in copy task: 0, every prompt has task_digits digits; > 0, each prompt's count is drawn from a
    lognormal of median task_digits and this σ (at most 10 × task_digits): responses of long-tailed lengths"""
    task_prompts: PositiveInt = 4096
    """built-in task: distinct prompts generated"""


class ValidationSettings(Settings):
    """Held-out prompts, scored with the training reward during training."""
    dataset: PathText = ""
    """held-out prompts, in the same formats as data.dataset; empty: no validation"""
    every: Count = 0
    """validate after every this many steps (and after the last); 0: only as before_train says"""
    before_train: bool = False
    """validate once with the weights before the first update (recorded as step 0 in metrics.jsonl); a rollout role of its own answers it while the first step trains"""
    samples: PositiveInt = 1
    """responses per held-out prompt"""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    """sampling temperature of validation; 0: greedy"""

    @model_validator(mode="after")
    def _needs_dataset(self):
        if (self.every or self.before_train) and not self.dataset:
            raise ValueError("dataset: missing; every / before_train validate on it (give a JSONL or Parquet file "
                             "of held-out prompts)")
        return self


class Scorer(Settings):
    """One term of a sample's score: weight × role.method(batch)["scores"]."""
    role: Annotated[str, Field(min_length=1)]
    """the role whose method scores: reward (the built-in one), or a role of your own (roles.<role>.worker)"""
    method: str = "compute_scores"
    """the role's @register method; it gets the generated batch and returns Batch({"scores": one float per sample})"""
    weight: float = 1.0
    """the term's weight in the sum"""

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        if not v.isidentifier():
            raise ValueError(f"{v!r} is not a method name")
        return v


class RewardSettings(Settings):
    """How a response is scored."""
    fn: str = ""
    """rule reward `module:function`, called as fn(prompt, response, **fields) -> float in the reward
    role. Empty: with a dataset, the built-in scorer of each sample's data_source (GSM8K, MATH,
    reasoning-gym…: hpcrl/ppo/verifiers.py); without one, the copy task's rule. With judge.enabled:
    an async function taking `judge`, an openai.AsyncOpenAI of the judge role's endpoint, awaited
    as fn(prompt, response, judge=client, **fields), the batch's calls at once"""
    batched: bool = False
    """fn takes the whole batch: fn(prompts, responses, **fields as lists) -> a score per sample"""
    model_dir: PathText = ""
    """a sequence-scoring HF model directory; when set it scores instead of fn"""
    missing_eos_penalty: Annotated[float, Field(ge=0)] = 0.0
    """subtracted from the score of a response that never emitted the stop token"""
    scorers: list[Scorer] = Field(default_factory=list)
    """a sample's score as a weighted sum of roles' scores, e.g. [{role: reward}, {role: rule_engine,
    method: compute_rule_score, weight: 0.5}]; each is logged as score/<role>. Empty: the reward role
    alone, weight 1"""

    @field_validator("scorers")
    @classmethod
    def _one_per_role(cls, v):
        twice = sorted({s.role for s in v if [t.role for t in v].count(s.role) > 1})
        if twice:
            raise ValueError(f"roles {twice} are listed twice; one scoring method per role")
        return v

    def terms(self) -> list[Scorer]:
        """The scorers; the reward role alone when none are given."""
        return list(self.scorers) or [Scorer(role="reward")]

    def function(self, dataset: str, task: str = "copy_digits") -> str:
        """fn, or its default: each sample's data_source scorer with a dataset, the built-in task's rule without."""
        return self.fn or ("hpcrl.ppo.verifiers:by_data_source" if dataset else f"hpcrl.ppo.tasks.{task}:score")


class ModelSettings(Settings):
    """The policy model, and where the critic starts."""
    path: PathText = ""
    """an HF causal LM directory; empty: a tiny Qwen2 of the sizes below in RUN_DIR/model (cached in $XDG_CACHE_HOME/hpcrl)"""
    hidden_size: PositiveInt = 128
    """tiny model width (head_dim = hidden_size / heads must be ≥ 32)"""
    layers: PositiveInt = 2
    """tiny model depth"""
    heads: PositiveInt = 4
    """tiny model attention heads"""
    critic_init: PathText = "actor"
    """"actor" (the policy's backbone, fresh value head) or a reward model directory"""


class RolloutSettings(Settings):
    """Generation: the engine, sampling, and where and when it runs."""
    engine: Literal["torch", "vllm"] = "torch"
    """"torch": on a GPU, for Llama- and Qwen2-shaped models, hpcrl's static-cache engine (CUDA graphs; the
    fastest on one GPU in docs/pages/how-to/vllm.md), else sampling with the training module itself;
    "vllm": a vLLM engine in the rollout process (the actor's new weights loaded into it in place after
    every update)"""
    own_role: bool = False
    """generate in a separate `rollout` role (its own nodes in the spec) instead of in actor_rollout;
    the actor's weights travel to it after every update"""
    weight_transport: Literal["auto", "collective", "object_store"] = "auto"
    """own_role: how the actor's weights reach the rollout role. "auto": through CUDA IPC when every
    rollout rank runs on the GPU of the actor's rank 0, else "collective". "collective": broadcast
    from the actor's rank 0 to the rollout's ranks by a torch.distributed group of their own (NCCL
    when each has a GPU of its own, else gloo), in buckets of at most 256 MB. "object_store": numpy
    buffers through Ray's object store. The events say which route the weights take, at the start
    and after every rebuild or resize of either role"""
    weight_sync_timeout: Annotated[float, Field(gt=0)] = 600.0
    """own_role, collective transport: seconds a rank waits for the others, to join the group (the
    error then names the ranks that did not) and at each sync for the rollout to be ready (pipelined,
    it finishes the generation in flight first)"""
    n_samples: PositiveInt = 1
    """responses per prompt (≥ 2 for advantage grpo, rloo, reinforce_pp_baseline and for dynamic_sampling:
    the group each response is compared against)"""
    max_new_tokens: PositiveInt = 3
    """longest response"""
    temperature: Annotated[float, Field(gt=0)] = 1.0
    """sampling temperature; the same temperature scales the actor's and reference's log-probs"""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """nucleus sampling"""
    top_k: Count = 0
    """top-k sampling (0: off)"""
    tensor_parallel: PositiveInt = 1
    """vLLM tensor parallel size: GPUs per engine (CPU: 1)"""
    gpu_memory: Annotated[float, Field(gt=0, le=1)] = 0.5
    """vLLM: fraction of a GPU's memory for its weights and KV cache"""
    max_model_len: Count = 0
    """vLLM: longest prompt + response (0: the model's max_position_embeddings)"""
    cache_dir: PathText = ""
    """vLLM's caches (its compiled graphs) and temp files; empty: RUN_DIR/cache, where a requeued job
    finds what the job before it compiled. Runs that share one reuse each other's compiled graphs"""
    pipeline: Literal["off", "one_step_off", "async"] = "off"
    """"off": each step generates, scores and trains in turn. "one_step_off": the rollout role
    generates the batch of step k+1 (with the weights of step k−1) while step k is scored and
    trained, and scores it (reward, reference) while step k still trains; needs own_role.
    "async": the rollout role generates one batch after another without waiting for the updates,
    each with the newest weights the actor has sent (loaded between two batches), into a buffer
    the trainer takes its batches from; needs own_role. The PPO ratio still uses log-probs the
    actor recomputes before its update"""
    max_staleness: PositiveInt = 1
    """one_step_off: batches generated ahead of the step being trained, so a batch trains with
    weights this many updates newer than the ones that sampled it. async: the bound on that lag
    (a batch trains at most this many updates after the weights that sampled it, less when the
    rollout is the slower side), and the buffer's depth: batches drawn ahead of the one in training"""
    partial_rollout: Literal["finish", "continue"] = "finish"
    """pipeline: async, a response the rollout is generating when new weights arrive. "finish": each
    batch is generated whole with the weights it started with (the new ones are loaded before the
    next), so the batch takes as long as its longest response. "continue": the rollout generates
    `segment_tokens` at a time; the responses not finished go on in its next call, with whatever
    weights arrived meanwhile, beside the new prompts, so that the longest ones hold nothing up. Each token
    keeps the version and log-prob that sampled it (the correction of algorithm.tis_cap, mis_band); a
    group trains once all its responses are done, in the order groups finish. max_staleness bounds the
    prompts drawn ahead; a response that goes on over several calls may have first tokens older than that"""
    segment_tokens: PositiveInt = 16
    """partial_rollout: continue: tokens per response per call of the rollout"""
    release_memory: bool = False
    """a rollout engine in a trainer's process (actor_rollout, own_role false) gives its GPU memory
    back after each generation (its copy of the weights, its KV cache, CUDA graphs), so that scoring
    and the updates have it, and takes the trainer's weights again at the next generation: the
    static-cache engine then captures its graphs again (part of a second at 7B). vLLM there always
    sleeps after generating.
    `hpcrl plan` says when a spec needs it"""

    @model_validator(mode="after")
    def _combinations(self):
        if self.tensor_parallel > 1 and self.engine != "vllm":
            raise ValueError(f"tensor_parallel: {self.tensor_parallel} needs engine: vllm (or tensor_parallel: 1)")
        if self.partial_rollout == "continue" and self.pipeline != "async":
            raise ValueError("partial_rollout: continue goes on with responses across the rollout's calls of pipeline: "
                             "async; set pipeline: async, or partial_rollout: finish")
        if self.pipeline != "off" and not self.own_role:
            raise ValueError(f"pipeline: {self.pipeline} overlaps a separate rollout role with the trainers; set "
                             "own_role: true (and give roles.rollout its nodes), or pipeline: off")
        return self


class EngineSettings(Settings):
    """The training engine of the actor, critic and reference."""
    backend: Literal["torch", "megatron"] = "torch"
    """"torch" (DDP on CPU, FSDP2 on GPUs) or "megatron" (megatron-core, GPU only: tensor and
    pipeline parallelism, distributed optimizer)"""
    tensor_parallel: PositiveInt = 1
    """megatron: GPUs that split each layer (must divide the heads, KV heads and FFN width)"""
    pipeline_parallel: PositiveInt = 1
    """megatron: stages the layers are split into (must divide the layer count)"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """"auto" (bf16 autocast on GPU, fp32 on CPU), "bf16" or "fp32" for the torch engine; megatron is bf16"""
    compile: bool = True
    """on GPUs, torch.compile the decoder layers of the torch engine (not under FSDP2) and of
    megatron (without TP or PP), and the static-cache rollout's decode step (fused norms, RoPE and
    activations: fewer, larger kernels; the first steps pay the compilation, tens of seconds per
    role, once per kind of call: with or without gradients or padding). false: eager, e.g. for a
    model Inductor cannot compile"""
    compile_cache: PathText = ""
    """where torch.compile keeps what it compiled for the training engines and the static-cache
    rollout (Inductor's graphs, Triton's kernels); empty: $XDG_CACHE_HOME/hpcrl/torch-compile
    (~/.cache/hpcrl/...), yours alone and shared by your runs: a requeued job, and your next run of
    the same model and shapes, on any node that mounts your home, load the kernels compiled before
    (Dynamo still traces each graph again in each new process); where it cannot be written (a
    container's read-only home), rollout.cache_dir. A TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR set
    in the environment is kept"""
    activation_checkpointing: bool = False
    """keep only each decoder layer's input from the forward and compute the rest of its activations
    again in the backward (per layer: torch's non-reentrant checkpoint, megatron's full recompute):
    an update's activations shrink to about one layer's worth, for about a third more update time.
    `hpcrl plan` says when a spec needs it"""
    offload: Literal["none", "optimizer"] = "none"
    """"optimizer": the training roles' AdamW moments (8 bytes a trained parameter) live in pinned host
    memory; each optimizer step streams them through the GPU in chunks, the next chunk's copy
    overlapped with this chunk's update (the same arithmetic as the optimizer on the GPU). For a
    model whose optimizer does not fit beside its weights and gradients (7B full fine-tuning on one
    80 GB GPU); torch engine, one GPU per process group (not with FSDP2)"""

    @model_validator(mode="after")
    def _megatron_only(self):
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) > 1 and self.backend != "megatron":
                raise ValueError(f"{name}: {getattr(self, name)} needs backend: megatron (or {name}: 1)")
        return self

    @model_validator(mode="after")
    def _offload_torch_only(self):
        if self.offload != "none" and self.backend != "torch":
            raise ValueError(f"offload: {self.offload} needs backend: torch (megatron's distributed optimizer shards "
                             "its state instead); set offload: none")
        return self

    @property
    def model_parallel(self) -> int:
        """GPUs that hold one copy of a model: tensor × pipeline parallel."""
        return self.tensor_parallel * self.pipeline_parallel


Estimator = Literal["k1", "k2", "k3"]


class AlgorithmSettings(Settings):
    """Advantages, KL and the losses (hpcrl/algo/ has each formula)."""
    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "gae"
    """how advantages are estimated (docs: algorithms/menu.md). gae: with the critic; the others need
    none. grpo: each score against its group's mean and std; rloo: against the mean of the group's
    other scores; reinforce_pp: the discounted returns of the token rewards, whitened over the batch;
    reinforce_pp_baseline: the group mean taken off each score, then whitened over the batch"""
    grpo_std_normalize: bool = True
    """grpo: divide by the group's std (false: Dr.GRPO, only the group mean taken off)"""
    gamma: Fraction = 1.0
    """discount (gae, reinforce_pp)"""
    lam: Fraction = 0.95
    """GAE λ"""
    whiten_advantages: bool = True
    """normalise GAE advantages over the batch's valid tokens"""
    kl_coef: Annotated[float, Field(ge=0)] = 0.01
    """β: weight of KL(π‖π_ref)"""
    kl_in_reward: bool = True
    """put −β·KL in the token rewards"""
    kl_loss: bool = False
    """add β·KL to the actor's loss instead (both only when both are set)"""
    kl_estimator: Estimator = "k1"
    """k1, k2 or k3 for the reward penalty"""
    kl_loss_estimator: Estimator = "k3"
    """k1, k2 or k3 for the loss term"""
    kl_target: Annotated[float, Field(ge=0)] = 0.0
    """> 0: adaptive β that steers KL to this value"""
    kl_horizon: Annotated[float, Field(gt=0)] = 10000.0
    """adaptive β: samples over which β may change by ±20%"""
    clip_low: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """PPO ε below 1"""
    clip_high: Annotated[float, Field(gt=0)] = 0.2
    """PPO ε above 1 (raise it for DAPO's clip-higher)"""
    dual_clip: Annotated[float, Field(ge=0)] = 0.0
    """> 1: dual-clip constant c for negative advantages (0: off)"""
    vf_clip: Annotated[float, Field(ge=0)] = 0.5
    """value clip around the old values (0: off)"""
    entropy_coef: Annotated[float, Field(ge=0)] = 0.01
    """entropy bonus"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = \
        "token-mean"
    """how token losses become the loss: the mean over all tokens, or over sequences of each one's sum,
    its mean, or its sum divided by `rollout.max_new_tokens` (seq-mean-token-sum-norm: Dr.GRPO)"""
    policy_loss: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: PPO's clipped surrogate with token-level ratios; gspo: GSPO's sequence-level ratio
    (the geometric mean of the response's token ratios), clipped by clip_low/clip_high (GSPO uses
    ranges like 3e-4/4e-4)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose scores (`reward.scorers`, before any penalty)
    are all equal before the advantages, and generate more batches (`refills`) until data.batch_size
    groups are left; the step trains on those (`batch/kept_groups`), on fewer when the refills run
    out, or skips its updates when none is left"""
    refills: Count = 3
    """dynamic_sampling: batches generated at most, beyond the step's own, to refill it to
    data.batch_size groups (`batch/refills`; DAPO's max_num_gen_batches less one); 0: no refill"""
    overlong_buffer: Count = 0
    """> 0: DAPO's overlong reward shaping: a response within this many tokens of
    `rollout.max_new_tokens` loses up to overlong_penalty from its score, linearly (0: off)"""
    overlong_penalty: Annotated[float, Field(ge=0)] = 1.0
    """the most a response of `rollout.max_new_tokens` tokens loses with overlong_buffer"""
    tis_cap: Annotated[float, Field(ge=0)] = 0.0
    """> 0: truncated importance sampling (verl's TIS): each token's policy loss is weighted by
    min(π_actor/π_rollout, tis_cap) of its old log-probs, which corrects for the sampler's weights
    (or kernels) differing from the actor's; 0: off"""
    mis_band: Annotated[list[PositiveFloat], Field(min_length=2, max_length=2)] | None = None
    """[low, high]: masked importance sampling: a token whose π_actor/π_rollout (of its old log-probs)
    leaves [low, high] gets no policy loss (a policy too far from the one that trains sampled it:
    stale weights in a pipelined run, the sampler's own numerics), e.g. [0.5, 2]; with tis_cap the
    tokens kept are also weighted. `actor/mis_masked` is the share dropped; null: off"""

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip(cls, v):
        if 0 < v <= 1:
            raise ValueError(f"{v} is out of range; it must be > 1, or 0 (off)")
        return v

    @field_validator("mis_band")
    @classmethod
    def _mis_band(cls, v):
        if v is not None and not v[0] < 1 < v[1]:
            raise ValueError(f"{v} does not hold a ratio of 1; give [low, high] with low < 1 < high, e.g. [0.5, 2]")
        return v

    GROUP_ADVANTAGES: ClassVar[tuple[str, ...]] = ("grpo", "rloo", "reinforce_pp_baseline")
    """the estimators that compare each response with the others to its prompt"""

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_ref(self) -> bool:
        return self.kl_coef > 0 and (self.kl_in_reward or self.kl_loss)


class OptimSettings(Settings):
    """The updates: epochs, batch sizes, the optimizers."""
    ppo_epochs: PositiveInt = 2
    """passes over each step's batch"""
    mini_batch_size: PositiveInt = 32
    """samples per optimizer step (across the role's ranks)"""
    micro_batch_size: PositiveInt = 32
    """samples per forward/backward on one rank (gradient accumulation below mini_batch_size)"""
    micro_batch_tokens: Count = 0
    """> 0: a micro-batch also holds at most this many tokens (rows × (longest prompt + longest
    response), the padding all its rows share cut away), so long and short samples neither run out of
    memory nor compute on padding (torch engine)"""
    pack: bool = False
    """each micro-batch's forward runs on its sequences packed into one row with no padding at all, each
    sequence attending only to itself, and micro_batch_tokens (if > 0) counts their real tokens (the sum
    of their lengths): the same results, less compute when response lengths vary (torch engine; a GPU
    skips the work across sequences only with flash-attn, see the packing how-to)"""
    actor_lr: Annotated[float, Field(gt=0)] = 1e-3
    """actor AdamW learning rate"""
    critic_lr: Annotated[float, Field(gt=0)] = 2e-3
    """critic AdamW learning rate"""
    warmup_steps: Count = 5
    """optimizer steps of linear LR warm-up"""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """AdamW weight decay"""
    grad_clip: Annotated[float, Field(gt=0)] = 1.0
    """gradient norm clip"""
    critic_warmup: Count = 0
    """steps that train only the critic"""

    @model_validator(mode="after")
    def _micro_in_mini(self):
        if self.micro_batch_size > self.mini_batch_size:
            raise ValueError(f"micro_batch_size: {self.micro_batch_size} is larger than mini_batch_size "
                             f"{self.mini_batch_size}")
        return self


class LoraSettings(Settings):
    """LoRA adapters (peft) in place of full fine-tuning: the base weights stay frozen, only the
    adapters (and the critic's value head) train, and the optimizer holds only those."""
    rank: Count = 0
    """adapter rank r; 0: off (every weight trains). Needs engine.backend: torch and `pip install 'hpcrl[lora]'`"""
    alpha: Annotated[float, Field(gt=0)] = 16.0
    """scaling numerator: an adapter adds (alpha / rank)·B·A to its layer's weight"""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """dropout on the adapters' input while training"""
    target_modules: str | list[str] = "all-linear"
    """the layers that get adapters: "all-linear" (every linear layer but the output layer: in
    Llama/Qwen-style models the attention and MLP projections), or a list of module names or name
    suffixes, e.g. [q_proj, k_proj, v_proj, o_proj]"""
    critic: bool = True
    """the critic gets adapters too (on its backbone; its value head trains whole); false: the
    critic fine-tunes every weight. The reference is the frozen base either way"""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, str) and v != "all-linear":
            raise ValueError(f"{v!r} is neither \"all-linear\" nor a list of module names (write [{v}] for one)")
        if isinstance(v, list) and (not v or not all(v)):
            raise ValueError(f"{v!r}: give at least one module name (e.g. [q_proj, v_proj]), or \"all-linear\"")
        return v


class CheckpointSettings(Settings):
    """Committed checkpoints on shared storage, and snapshots in host memory."""
    save_every: Count | Literal["auto"] = "auto"
    """steps between checkpoints, what survives a lost node or an out-of-memory kill. auto: by time,
    as often as keeps the commits under 5% of the wall time (after a commit that held training c
    seconds, the next c / 0.05 seconds later; at least 10 s apart, at most 30 min), the interval said
    in the log and events.jsonl (checkpoint_interval). 0: only when stopped by a signal or the
    deadline, and at the end"""
    save_last: bool = True
    """checkpoint after the last step (off for benchmarks that only time the steps)"""
    keep_last: Count = 3
    """committed steps kept (older ones are deleted once a newer one is committed)"""
    keep_every: Count = 0
    """also keep every step that is a multiple of this (0: none)"""
    async_save: bool = False
    """write the periodic checkpoints on a background thread while training goes on"""
    io: Literal["auto", "parallel", "serial"] = "auto"
    """how a data-parallel role of several ranks writes its file. parallel: all its ranks write one
    file together (parallel HDF5; needs h5py built with MPI and a Slurm job to run the writers as a
    step of); serial: rank 0 writes it; auto: parallel where possible, else serial"""
    snapshot_every: Count | Literal["auto"] = "auto"
    """steps between snapshots of the training roles' state (weights, optimizer, RNG: what their
    checkpoint holds) in host memory, in the object store of each role's rank 0 node. A role whose
    process dies is rebuilt from its newer snapshot or committed checkpoint, and the updates made
    since are made again: it goes on with exactly the state it had. auto: as often as keeps the
    snapshots under 5% of the wall time (on a GPU a snapshot can take longer than a step). 0: no
    snapshots but those replay_limit asks for (a rebuilt role then replays every update since the
    newest checkpoint; the driver keeps their batches)"""
    replay_limit: Annotated[float, Field(gt=0)] = 1024.0
    """MB of batches the driver may keep for the updates a rebuilt role would make again (those since
    its snapshot or checkpoint); past it, the training roles are snapshotted at the end of the step
    whatever snapshot_every says, which lets the kept batches go"""

    @field_validator("save_every", "snapshot_every", mode="before")
    @classmethod
    def _count_or_auto(cls, v):
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError(f"{v!r} is neither a number of steps (≥ 0; 0: never) nor \"auto\"")


class LayoutSettings(Settings):
    """Processes per role, colocation, and what happens when one dies."""
    colocate: list[Annotated[list[str], Field(min_length=1)]] = Field(default_factory=list)
    """groups of roles that share one process per rank, e.g. [[actor_rollout, ref]]"""
    processes_per_node: dict[str, PositiveInt] = Field(default_factory=dict)
    """role -> processes per CPU node (a GPU node runs one per GPU)"""
    standby: bool | Literal["auto"] = "auto"
    """keep an idle process per rank (its imports done, nothing reserved; started after the first step,
    and a step later its rank's compiled layers rehearsed on the rank's GPU: a CUDA context and one
    layer, which the memory plan counts) so a dead rank is replaced without a process start, imports or
    compiles: true, false, or auto (the roles whose processes run on CUDA devices)"""
    restart_limit: Count = 3
    """rebuilds of one role allowed per hour (a dead process, or ranks that missed a call's deadline)
    before the run fails; for missed deadlines it stops at its last step, committed, and requeues"""


class DeadlineSettings(Settings):
    """How long a role call may take before its ranks count as hung: their Python stacks go to the
    role's log and `hpcrl status`, and they are rebuilt with their state and the call made again, as
    for a dead process (layout.restart_limit). Learned per kind of call (role and method) from the run."""
    floor: Annotated[float, Field(gt=0)] = 300.0
    """seconds no learned deadline goes under"""
    factor: Annotated[float, Field(ge=1)] = 5.0
    """a call's deadline: this many times the slowest of its kind's recent calls (at least `floor`)"""
    first: Annotated[float, Field(gt=0)] = 1800.0
    """seconds for a kind's first call in new processes (it may compile, warm up, allocate: not
    learned from), and for a role's processes to start and build their workers"""
    window: PositiveInt = 20
    """how many recent calls of a kind the deadline is learned from"""
    calls: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """fixed deadlines in seconds, by method (`generate_sequences: 3600`) or `role.method`
    (`critic.update_critic: 900`, which wins), instead of learned ones"""


class EnvironmentSettings(Settings):
    """Multi-turn episodes: the model and an environment take turns (hpcrl/environments)."""
    cls: str = ""
    """the environment, `package.module:Class` (hpcrl.environments:ToolEnvironment, or your own on the
    protocol of hpcrl/environments/base.py); it runs in the `env` role, which the spec places like any
    role. Empty: single-turn rollouts"""
    kwargs: dict = Field(default_factory=dict)
    """keyword arguments of the class, e.g. {tools: [calculator, python]}"""
    max_turns: PositiveInt = 4
    """model turns per episode; the episode ends after the last (a tool call in it is not run)"""
    max_tokens: Count = 0
    """tokens of an episode after its prompt, the model's turns and the observations together (an
    episode ends where the next turn or observation would not fit); 0: max_turns × rollout.max_new_tokens"""
    step_timeout: Annotated[float, Field(gt=0)] = 60.0
    """seconds an environment may take to start an episode or answer a turn; then the episode fails"""
    failed_score: Annotated[float, Field(ge=-100, le=100)] = 0.0
    """the score of an episode whose environment failed (raised, timed out, or lost its process): it is
    trained with this score, and named in the log"""
    agent: str = ""
    """your own agent instead of an environment class, `package.module:function`: an async function
    `(row, client)` written against the `openai` package, `client` an openai.AsyncOpenAI pointed at
    the generating role's endpoint with the episode's key; it returns the episode's reward, or
    {reward, info}. It runs in the `env` role (docs: how-to/your-own-agent.md)"""
    agent_time_limit: Annotated[float, Field(gt=0)] = 600.0
    """seconds an agent may take for its whole episode; then it is cut, and the episode fails"""

    @field_validator("cls", "agent")
    @classmethod
    def _import_path(cls, v, info):
        if v and not re.fullmatch(r"[\w.]+:[\w.]+", v):
            form = {"cls": "package.module:Class (e.g. hpcrl.environments:ToolEnvironment)",
                    "agent": "package.module:function (e.g. my_agents:solve)"}[info.field_name]
            raise ValueError(f"{v!r}: write it as {form}")
        return v

    @model_validator(mode="after")
    def _one_kind(self):
        if self.cls and self.agent:
            raise ValueError(f"give cls (an environment class, {self.cls}) or agent (your own agent, {self.agent}), "
                             "not both")
        return self

    @property
    def multi_turn(self) -> bool:
        """Episodes of an environment or an agent, in the `env` role."""
        return bool(self.cls or self.agent)

    def tokens(self, max_new_tokens: int) -> int:
        """An episode's token budget after its prompt."""
        return self.max_tokens or self.max_turns * max_new_tokens


class JudgeSettings(Settings):
    """An LLM judge: a frozen model in a `judge` role of its own, serving an OpenAI-compatible
    endpoint for the whole run to train.reward.fn, which then gets a client of it (docs:
    how-to/your-own-agent.md#an-llm-judge)."""
    enabled: bool = False
    """run the judge role (placed like any role: roles.judge in the spec, on GPU or CPU nodes);
    train.reward.fn must then be an async function taking `judge`"""
    model: PathText = ""
    """the judge's HF causal LM directory; empty: the policy's initial model (model.path). Its
    weights never change"""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    """the judge's sampling temperature; 0: greedy (a request's own temperature is ignored, as the
    policy's endpoint ignores it)"""
    max_new_tokens: PositiveInt = 256
    """the longest answer of the judge (a request's max_tokens may ask for fewer)"""


BUILTIN_ROLES = ("actor_rollout", "rollout", "critic", "ref", "reward", "env", "judge")
"""The roles hpcrl's own workers play (TrainConfig.roles: those a configuration runs)."""


class TrainConfig(Settings):
    """The training settings (`train:` of a job spec)."""
    seed: Count = 1
    """seeds the model's initial weights, the prompt order and every sampler"""
    total_steps: PositiveInt = 150
    """training steps; each is one batch of prompts: generate, score, advantages, updates"""
    progress: bool = True
    """a progress bar on the console"""
    data: DataSettings = Field(default_factory=DataSettings)
    """the training prompts"""
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    """held-out prompts scored during training"""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """how a response is scored"""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """the policy model, and where the critic starts"""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """generation: engine, sampling, and where and when it runs"""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    """the training engine of the actor, critic and reference"""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """advantages, KL and the losses"""
    optim: OptimSettings = Field(default_factory=OptimSettings)
    """the updates: epochs, batch sizes, optimizers"""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """LoRA adapters instead of full fine-tuning"""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """committed checkpoints, and snapshots in host memory"""
    layout: LayoutSettings = Field(default_factory=LayoutSettings)
    """processes per role, colocation, restarts"""
    deadlines: DeadlineSettings = Field(default_factory=DeadlineSettings)
    """how long a role call may take before its ranks count as hung"""
    environment: EnvironmentSettings = Field(default_factory=EnvironmentSettings)
    """multi-turn episodes with an environment (tools, games, code execution)"""
    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    """an LLM judge the reward function calls"""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data):
        """The flat keys of earlier releases, moved into their sections (where a spec is read, a note says so)."""
        return upgrade_flat_keys(data)[0] if isinstance(data, dict) else data

    PATHS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("data", "dataset"), ("validation", "dataset"), ("reward", "model_dir"), ("model", "path"),
        ("model", "critic_init"), ("rollout", "cache_dir"), ("engine", "compile_cache"), ("judge", "model"))
    """Settings that name files or folders: taken relative to where the spec is loaded, as run_dir is
    (the job's steps run in the run directory)."""

    @classmethod
    def parse(cls, data: dict | None, where: str = "train") -> TrainConfig:
        """Settings from a mapping (sections, or the flat keys of earlier releases), with the
        cross-section checks: a ConfigError lists every problem, each naming its field."""
        try:
            cfg = cls.model_validate(dict(data or {}))
        except ValidationError as e:
            raise ConfigError([problem(err, cls, where) for err in e.errors()]) from None
        if cfg.problems():
            raise ConfigError([f"{where}.{p}" for p in cfg.problems()])
        return cfg

    def updated(self, **changes) -> TrainConfig:
        """A checked copy with `changes` set: sections by their fields (optim={"actor_lr": 1e-4}, the
        section's other fields kept), settings by themselves (total_steps=10), or the flat keys of
        earlier releases (actor_lr=1e-4)."""
        data = self.model_dump(exclude_unset=True)
        for key, value in upgrade_flat_keys(changes)[0].items():
            data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
        return TrainConfig.model_validate(data)

    def problems(self) -> list[str]:
        """What spans sections (each section checks itself); every problem names one field."""
        p = []
        if self.rollout.n_samples < 2:
            if self.algorithm.advantage in self.algorithm.GROUP_ADVANTAGES:
                p.append(f"rollout.n_samples: advantage {self.algorithm.advantage} needs ≥ 2 responses per prompt "
                         "to compare against")
            if self.algorithm.dynamic_sampling:
                p.append("rollout.n_samples: algorithm.dynamic_sampling needs ≥ 2 responses per prompt (a group of "
                         "one always has equal scores)")
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            p.append(f"algorithm.overlong_buffer: {self.algorithm.overlong_buffer} is longer than "
                     f"rollout.max_new_tokens {self.rollout.max_new_tokens}")
        per_step = self.data.batch_size * self.rollout.n_samples
        if per_step % self.optim.mini_batch_size:
            p.append(f"optim.mini_batch_size: {self.optim.mini_batch_size} does not divide data.batch_size × "
                     f"rollout.n_samples = {per_step}")
        if self.rollout.pipeline != "off" and any("rollout" in g and "actor_rollout" in g
                                                  for g in self.layout.colocate):
            p.append(f"rollout.pipeline: {self.rollout.pipeline}, but layout.colocate puts rollout in actor_rollout's "
                     "processes, where the two cannot run at once; place rollout apart, or pipeline: off")
        if self.data.task_digits_sigma and (self.data.task != "copy_digits" or self.data.dataset):
            p.append(f"data.task_digits_sigma: {self.data.task_digits_sigma} spreads the built-in copy task's lengths; "
                     "set it to 0 with data.dataset or data.task: tool_sums")
        if self.rollout.pipeline == "async" and self.environment.multi_turn:
            p.append("rollout.pipeline: async generates on a thread of the driver, but multi-turn episodes "
                     "(environment.cls, environment.agent) are made on the driver's own; use pipeline: one_step_off")
        if self.environment.agent and self.reward.scorers:
            p.append("reward.scorers: with environment.agent the agent's reward is the score; leave scorers empty")
        p += self._judge_problems()
        if self.optim.micro_batch_tokens and self.engine.backend == "megatron":
            p.append("optim.micro_batch_tokens: needs engine.backend: torch (megatron's pipeline sends micro-batches "
                     "of one shape); set it to 0")
        if self.optim.pack and self.engine.backend == "megatron":
            p.append("optim.pack: needs engine.backend: torch (the megatron engine does not pack); set it to false")
        if self.lora.rank and self.engine.backend == "megatron":
            p.append("lora.rank: LoRA adapters need engine.backend: torch (megatron's engine trains every weight); "
                     "set engine.backend: torch, or lora.rank: 0")
        return p

    def _judge_problems(self) -> list[str]:
        """The judge is called by train.reward.fn alone: it needs one, in the reward role, scoring."""
        if not self.judge.enabled:
            return []
        if self.environment.agent:
            return ["judge.enabled: with environment.agent the agent's reward is the score and the reward role is "
                    "not asked; call a judge from your agent, or score in reward.fn without environment.agent"]
        if self.reward.model_dir:
            return ["judge.enabled: reward.model_dir scores with a reward model, which calls no judge; set "
                    "reward.fn to an async function taking `judge` (and reward.model_dir empty), or judge.enabled: false"]
        if all(s.role != "reward" for s in self.reward.terms()):
            return ["judge.enabled: reward.scorers leave out the reward role, whose reward.fn calls the judge; add "
                    "{role: reward} to them, or judge.enabled: false"]
        if not self.reward.fn:
            return ["judge.enabled: no reward.fn calls the judge (the built-in scorers do not); set reward.fn to "
                    "your `async def score(prompt, response, judge, **fields)`, or judge.enabled: false"]
        return []

    def with_paths_from(self, base: Path) -> TrainConfig:
        """A copy with its path settings absolute, relative ones taken from `base` (critic_init "actor" is not a path)."""
        out = self.model_copy(deep=True)
        for section, name, value in self._paths():
            setattr(getattr(out, section), name, str((base / Path(value).expanduser()).resolve()))
        return out

    def missing_paths(self) -> list[str]:
        """The path settings that name nothing here (checked before submission: the login node sees
        the shared filesystem the job will read them from)."""
        return [f"train.{section}.{name}: {value} does not exist (a path on storage every node sees)"
                for section, name, value in self._paths() if name not in ("cache_dir", "compile_cache") and not Path(value).exists()]

    def _paths(self) -> list[tuple[str, str, str]]:
        """(section, name, value) of every path setting that is set (critic_init "actor" is not a path)."""
        return [(section, name, value) for section, name in self.PATHS
                if (value := getattr(getattr(self, section), name)) and not (name == "critic_init" and value == "actor")]

    @property
    def reference_in_actor(self) -> bool:
        """The reference log-probs come from the actor's own frozen base with its LoRA adapters switched
        off (no second copy of the model, no `ref` role), as they must whenever the actor trains adapters."""
        return self.algorithm.uses_ref and self.lora.rank > 0

    def roles(self) -> list[str]:
        """The roles this configuration runs; the job spec must give each one resources."""
        return ["actor_rollout"] + (["rollout"] if self.rollout.own_role else []) + \
            (["critic"] if self.algorithm.uses_critic else []) + \
            (["ref"] if self.algorithm.uses_ref and not self.reference_in_actor else []) + ["reward"] + \
            (["env"] if self.environment.multi_turn else []) + (["judge"] if self.judge.enabled else [])

    def reward_function(self) -> str:
        return self.reward.function(self.data.dataset, self.data.task)


# --- the flat keys of earlier releases

_RENAMED = {"dataset": "data.dataset", "val_dataset": "validation.dataset", "val_every": "validation.every",
            "val_before_train": "validation.before_train", "val_samples": "validation.samples",
            "val_temperature": "validation.temperature", "reward_fn": "reward.fn", "reward_batched": "reward.batched",
            "reward_model_dir": "reward.model_dir", "rewards": "reward.scorers", "model_dir": "model.path",
            "rollout_engine": "rollout.engine", "rollout_role": "rollout.own_role",
            "rollout_tensor_parallel": "rollout.tensor_parallel", "rollout_gpu_memory": "rollout.gpu_memory",
            "rollout_max_model_len": "rollout.max_model_len", "train_engine": "engine.backend",
            "checkpoint_io": "checkpoint.io"}
"""Flat keys whose name changed in their section; the others kept theirs (FLAT_KEYS)."""


_KEPT = ("batch_size", "max_prompt_length", "task_digits", "task_prompts", "temperature", "missing_eos_penalty",
         "hidden_size", "layers", "heads", "critic_init", "n_samples", "max_new_tokens", "top_p", "top_k",
         "tensor_parallel", "cache_dir", "pipeline", "max_staleness", "pipeline_parallel", "precision", "compile",
         "advantage", "gamma", "lam", "whiten_advantages", "kl_coef", "kl_in_reward", "kl_loss", "kl_estimator",
         "kl_loss_estimator", "kl_target", "kl_horizon", "clip_low", "clip_high", "dual_clip", "vf_clip",
         "entropy_coef", "loss_agg_mode", "tis_cap", "ppo_epochs", "mini_batch_size", "micro_batch_size",
         "micro_batch_tokens", "actor_lr", "critic_lr", "warmup_steps", "weight_decay", "grad_clip", "critic_warmup",
         "save_every", "save_last", "keep_last", "keep_every", "async_save", "snapshot_every", "colocate",
         "processes_per_node", "standby", "restart_limit")
"""Flat keys that kept their name in their section. Frozen: settings added since exist only in sections."""


_SECTIONS_SINCE = ("judge",)
"""Sections added after the flat keys were frozen: a name they share with an older section (judge's
max_new_tokens and temperature) is not their flat key."""


def _flat_keys() -> dict[str, str]:
    section_of = {name: section for section, info in TrainConfig.model_fields.items()
                  if isinstance(info.default_factory, type) and issubclass(info.default_factory, Settings)
                  and section not in _SECTIONS_SINCE for name in info.default_factory.model_fields}
    return {name: f"{section_of[name]}.{name}" for name in _KEPT} | _RENAMED


FLAT_KEYS = _flat_keys()
"""flat key of earlier releases -> its path under train (`actor_lr` -> `optim.actor_lr`)"""


def upgrade_flat_keys(data: dict) -> tuple[dict, list[str]]:
    """`data` with every flat key moved into its section, and a note per key naming the new one; a
    ValueError names a setting given both ways."""
    out, notes = {k: (dict(v) if isinstance(v, dict) and k in TrainConfig.model_fields else v)
                  for k, v in data.items() if k not in FLAT_KEYS or k in TrainConfig.model_fields}, []
    for key, value in data.items():
        if key not in FLAT_KEYS or key in TrainConfig.model_fields:
            continue
        section, name = FLAT_KEYS[key].split(".")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            continue                 # the section itself is ill-typed: the model names it
        if name in target:
            raise ValueError(f"{key}: given twice, as train.{key} and train.{section}.{name}; write only the latter")
        target[name] = value
        notes.append(f"train.{key}: now train.{section}.{name} (the flat key is read until hpcrl 0.3)")
    return out, notes


_BOUNDS = {"greater_than": ">", "greater_than_equal": "≥", "less_than": "<", "less_than_equal": "≤"}


def model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model that holds the last key of `loc` (a path of field names, dict keys and list
    indices from `root`), or None where the keys below are the user's own."""
    model = root
    for part in loc[:-1]:
        if model is None:
            return None
        if isinstance(part, str) and part in model.model_fields:
            model = model_in(model.model_fields[part].annotation)
    return model


def model_in(annotation) -> type[BaseModel] | None:
    """The model a field's type holds, directly or in a list, dict or union (one level of keys)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(model_in, typing.get_args(annotation))), None)


def problem(err: dict, root: type[BaseModel], prefix: str = "") -> str:
    """One pydantic error of `root` (at `prefix`) as a line of ours: the field's path, what is wrong,
    and what it must be."""
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (p.startswith(("function-", "literal[", "lax-"))
                                                                        or p in ("str", "int", "float", "bool"))))
    path = ".".join(spec_key(p) for p in [*filter(None, [prefix]), *loc]) or "top level"
    kind, given = err["type"], err.get("input")
    if kind in _BOUNDS:
        return f"{path}: {given!r} is out of range; it must be {_BOUNDS[kind]} {next(iter(err['ctx'].values())):g}"
    if kind == "finite_number":
        return f"{path}: {given!r} is not a finite number"
    if kind == "extra_forbidden":
        model = model_at(root, loc)
        return f"{path}: unknown field (valid fields: {', '.join(model.model_fields) if model else '?'})"
    if kind == "missing":
        return f"{path}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and re.match(r"[a-z_]+: ", msg):      # a model's validator naming its field
        return f"{path}.{msg}"
    if "input" not in err or isinstance(given, dict) or repr(given) in msg:     # the parsers name it already
        return f"{path}: {msg}"
    return f"{path}: {msg} (got {given!r})"
