"""The memory plan: every GPU's predicted peak, from the model's size, the training settings and the
spec's GPUs, before the job waits in the queue. Pure arithmetic (no Ray, no Slurm, no torch).

Each GPU of a component runs one process per group of colocated roles (a process holds a GPU of its
own: hpcrl.jobspec.checks refuses GPU roles of one component that are not colocated). A process is
a list of parts, each held by one role's calls in some of the four phases of a step (generate,
score, update, sync: the new weights to the rollout), or resident:

    weights      trained parameters fp32 (4 B), frozen ones bf16 (2 B: the reference, a LoRA base)
    gradients    fp32, of the trained parameters, during the update
    optimizer    AdamW's two fp32 moments (8 B a trained parameter), resident; offloaded: those of
                 three streamed chunks, during the update
    activations  what one micro-batch's forward keeps for its backward: per token and decoder layer
                 a·hidden + b·FFN bytes (Constants.train), with checkpointing the layers' inputs and
                 one layer's worth; the bf16 copies of the fp32 weights the forward casts and keeps;
                 the output layer's chunked log-probs (a chunk's logits, the weight's bf16 copy and
                 fp32 gradient)
    rollout      the generating engine: its bf16 copy of the weights, the KV cache and the sampler's
                 buffers (static-cache engine), the new set it casts at a sync, or vLLM's share
    fixed        the CUDA context (NVML sees it, torch's allocator does not), the allocator's slack

Where the ranks keep standby processes (train.layout.standby), each GPU holds one beside each of its
processes whose engine compiles its decoder layers: its CUDA context and a layer it rehearses the
rank's compiled calls on.

A process's roles' calls run one after the other: while one runs, the process holds the resident
parts and that call's own. Its peak is its largest call, times the caching allocator's slack (it
keeps what it reserved: a process's peak holds until it ends), plus the context; a GPU's is the sum
of its processes' peaks. Where an assumption stands in for a missing setting (the prompt length) the
plan says so in its notes. The constants, and how each was measured, are in Constants.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from hpcrl.models.size import ModelSize
from hpcrl.ppo.config import TrainConfig

GIB = 2**30
PHASES = ("generate", "score", "update", "sync")
KINDS = ("weights", "gradients", "optimizer", "activations", "rollout", "fixed")


@dataclass(frozen=True)
class Constants:
    """What the arithmetic cannot know, each measured (bench/gpu_memory.py, one H100, torch 2.11,
    2026-12-06; docs/pages/how-to/will-it-fit.md has the figures)."""
    context: int = int(0.8 * GIB)
    """a process's CUDA context and library handles: NVML's count for the process less torch's reserved
    memory, 0.74-0.84 GiB in the bench's role processes (0.66 in a bare process)"""
    allocator: float = 1.03
    """torch's reserved memory over its allocated memory at the peak: 1.004-1.03 in the bench's
    processes (expandable segments), but 1.24 in the one that filled the card"""
    train: dict = field(default_factory=lambda: {"eager": (41.7, 5.2), "compiled": (23.3, 3.6)})
    """bytes a forward keeps for its backward per token and decoder layer, (× hidden, × FFN width), fp32
    weights under bf16 autocast: one Qwen2 layer of the 1.5B and of the 7B shape, measured (the
    allocation left after its forward, over 2,048 and 4,096 tokens: the slope; the intercept is the
    layer's weights cast to bf16, which both keep) and solved for the two coefficients"""
    inference: tuple[int, int] = (12, 8)
    """bytes live at once per token inside one decoder layer of a forward without gradients (× hidden,
    × FFN): the fp32 residual and norm, the MLP's bf16 gate, up and product; counted"""
    checkpoint_input: int = 4
    """bytes per token and hidden unit a checkpointed layer keeps: its fp32 input (counted)"""
    head_logit: dict = field(default_factory=lambda: {"update": {"compiled": 6, "eager": 14},
                                                      "score": {"compiled": 4, "eager": 10}})
    """bytes per logit of one chunk of the output layer's log-probs (hpcrl.models.causal_lm): compiled,
    the chunk's bf16 logits and what the fused kernel writes (measured: the 1.5B PPO run's log-prob and
    update calls less their resident parts); eager, every fp32 intermediate (counted)"""
    offload_chunk: int = 256 * 2**20
    """bytes of parameters one streamed optimizer chunk covers (hpcrl.engines.train.offload)"""
    gpu_reserve: int = GIB // 2
    """what a GPU's driver and other users keep of its memory"""


CONSTANTS = Constants()
HEAD_CHUNK_BYTES = 2**30        # hpcrl.models.causal_lm's fp32 logits of one chunk on a GPU
STATIC_CHECK_EVERY, STATIC_CACHE_ROUND = 32, 64   # hpcrl.engines.rollout.static_cache's defaults
ASSUMED_PROMPT = 1024


@dataclass(frozen=True)
class Gpus:
    """A hetjob component's GPUs as the plan sees them."""
    field: str
    """the spec field that gives them: roles.<the component's first role>"""
    roles: tuple[str, ...]
    nodes: int
    per_node: int
    memory: int | None
    """bytes of one GPU; None: not known"""
    source: str
    """how `memory` was found (the GPU table, gpu_mem, or why it is unknown)"""


@dataclass(frozen=True)
class Part:
    name: str
    kind: str
    bytes: float
    phases: tuple[str, ...] = PHASES
    """held in these phases; in all of them: resident"""
    role: str = ""
    """the role whose calls hold it"""


@dataclass
class ProcessPlan:
    """One process on each GPU of a component: its roles and what it holds when. Its roles' calls run
    one after the other: while one role's call runs, the process holds every resident part and that
    call's own, not the other roles' (their activations and gradients are gone by then)."""
    roles: tuple[str, ...]
    parts: list[Part]
    constants: Constants = CONSTANTS

    def live(self, phase: str, role: str) -> list[Part]:
        """What the process holds while `role`'s call of `phase` runs."""
        return [p for p in self.parts if p.phases == PHASES or (phase in p.phases and p.role == role)]

    def phase_bytes(self, phase: str) -> float:
        """The most it holds during `phase`, whichever role's call runs."""
        return max(sum(p.bytes for p in self.live(phase, r)) for r in self.roles)

    @property
    def peak_call(self) -> tuple[str, str]:
        """(phase, role) of the call during which it holds the most."""
        return max(((ph, r) for ph in PHASES for r in self.roles), key=lambda m: sum(p.bytes for p in self.live(*m)))

    @property
    def peak_phase(self) -> str:
        return self.peak_call[0]

    @property
    def allocated(self) -> float:
        """torch's allocated memory at the peak."""
        return self.phase_bytes(self.peak_phase)

    @property
    def peak(self) -> float:
        """What the process holds on its GPU at most: reserved memory and its CUDA context."""
        return self.allocated * self.constants.allocator + self.constants.context

    def by_kind(self) -> dict[str, float]:
        """The peak call's bytes by kind, fixed costs (context, allocator slack) under "fixed"."""
        out = {k: 0.0 for k in KINDS}
        for p in self.live(*self.peak_call):
            out[p.kind] += p.bytes
        out["fixed"] += self.peak - self.allocated
        return out


@dataclass
class GpuPlan:
    """One GPU of a component, as each of its GPUs holds the same."""
    gpus: Gpus
    processes: list[ProcessPlan]

    @property
    def peak(self) -> float:
        return sum(p.peak for p in self.processes)

    @property
    def usable(self) -> float | None:
        return None if self.gpus.memory is None else self.gpus.memory - self.processes[0].constants.gpu_reserve

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.peak <= self.usable


@dataclass
class MemoryPlan:
    """The plan of a configuration on its components' GPUs, with what it was made of (to plan changes of it)."""
    cfg: TrainConfig | None
    components: list[Gpus]
    size: ModelSize | None
    constants: Constants
    gpus: list[GpuPlan]
    notes: list[str]

    @property
    def fits(self) -> bool:
        return all(g.fits is not False for g in self.gpus)


@dataclass(frozen=True)
class Lengths:
    """Tokens of one sample: prompt and response (a multi-turn episode's after its prompt)."""
    prompt: int
    response: int

    @property
    def sequence(self) -> int:
        return self.prompt + self.response

    @classmethod
    def of(cls, cfg: TrainConfig, notes: list[str]) -> Lengths:
        response = cfg.environment.tokens(cfg.rollout.max_new_tokens) if cfg.environment.multi_turn else cfg.rollout.max_new_tokens
        if cfg.data.max_prompt_length:
            return cls(cfg.data.max_prompt_length, response)
        if not cfg.data.dataset:       # the built-in tasks' prompts: their digits, "+", "=", a start token
            return cls(3 * cfg.data.task_digits + 4, response)
        notes.append(f"prompts planned at {ASSUMED_PROMPT} tokens: train.data.max_prompt_length is 0 (no limit); "
                     "set it to plan (and bound) their real length")
        return cls(ASSUMED_PROMPT, response)


def plan_memory(cfg: TrainConfig, components: list[Gpus], size: ModelSize, constants: Constants = CONSTANTS) -> MemoryPlan:
    """Each GPU component's processes and their parts (the module's docstring says how)."""
    notes: list[str] = []
    lengths = Lengths.of(cfg, notes)
    ranks = {role: c.nodes * c.per_node for c in components for role in c.roles}
    generator = "rollout" if cfg.rollout.own_role else "actor_rollout"
    plans = []
    for c in components:
        if not c.per_node:
            continue
        groups = [tuple(g) for g in cfg.layout.colocate if set(g) <= set(c.roles)]
        grouped = {r for g in groups for r in g}
        processes = []
        for roles in groups + [(r,) for r in c.roles if r not in grouped]:
            parts = [replace(p, role=role) for role in roles
                     for p in _role_parts(role, cfg, size, lengths, ranks, generator, c, constants)]
            if parts:
                processes.append(ProcessPlan(roles, parts, constants))
                if cfg.layout.standby and any(_compiles_layers(r, cfg, ranks.get(r, 1)) for r in roles):
                    processes.append(_standby(roles, parts, size, constants))   # true, or auto: on CUDA devices
        if processes:
            plans.append(GpuPlan(c, processes))
    return MemoryPlan(cfg, components, size, constants, plans, notes)


def _compiles_layers(role: str, cfg: TrainConfig, world: int) -> bool:
    """Whether the role's engine compiles its decoder layers (which a standby rehearses): the torch
    engine's, not under FSDP2 (a trained role on several GPUs), megatron's without TP or PP."""
    e = cfg.engine
    if role not in ("actor_rollout", "critic", "ref") or not e.compile:
        return False
    if e.backend == "megatron":
        return e.tensor_parallel == e.pipeline_parallel == 1
    return world == 1 or role == "ref"


def _standby(roles: tuple[str, ...], parts: list[Part], size: ModelSize, k: Constants) -> ProcessPlan:
    """A rank's standby process (train.layout.standby) on its GPU: a CUDA context, and while it rehearses
    the rank's compiled layers (hpcrl.controller.layer_rehearsal), one decoder layer: its weights and
    gradients where the rank trains (fp32), else its bf16 weights; the rehearsal's activations are a
    few samples' and left out. One process for colocated roles, which rehearses theirs one at a time."""
    trains = any(p.kind == "gradients" for p in parts)
    return ProcessPlan(("+".join(roles) + " standby",),
                       [Part("one layer rehearsed" + (" (+ gradients)" if trains else ""), "weights",
                             (8 if trains else 2) * size.per_layer)], k)


def _role_parts(role: str, cfg: TrainConfig, size: ModelSize, lengths: Lengths, ranks: dict, generator: str,
                gpus: Gpus, k: Constants) -> list[Part]:
    if role not in cfg.roles():
        return []
    world = ranks.get(role, 1)
    if role == "actor_rollout":
        parts = _trainer_parts(cfg, size, lengths, world, k, value=False)
        if generator == role:
            return parts + _rollout_parts(cfg, size, lengths, ranks.get(generator, 1), gpus, k, in_trainer=True)
        # the weights for the rollout role, in its dtype: on the GPU for CUDA IPC where it shares this one
        return parts + [Part("weights exported (bf16)", "rollout", 2 * (size.params + (size.embedding if size.shape.tied
                                                                                       else 0)), ("sync",))]
    if role == "critic":
        return _trainer_parts(cfg, size, lengths, world, k, value=True)
    if role == "ref":
        return _reference_parts(cfg, size, lengths, world, k)
    if role == "rollout":
        return _rollout_parts(cfg, size, lengths, world, gpus, k, in_trainer=False)
    return []       # rule rewards and environments run on the CPU; your own roles are not planned


def _tokens(cfg: TrainConfig, lengths: Lengths) -> tuple[int, int]:
    """(tokens, rows) of one micro-batch on one rank."""
    rows = cfg.optim.micro_batch_size
    if cfg.optim.micro_batch_tokens:
        rows = max(1, min(rows, cfg.optim.micro_batch_tokens // lengths.sequence))
    return rows * lengths.sequence, rows


def _head(size: ModelSize, positions: int, per_logit: int, weight_cast: bool, weight_grad: bool) -> float:
    """The chunked output layer's transient (hpcrl.models.causal_lm.head_log_probs): a chunk's logits,
    the weight's bf16 copy where it is fp32, and its fp32 gradient where it trains."""
    vocab, hidden = size.shape.vocab, size.shape.hidden
    chunk = min(positions, max(1, HEAD_CHUNK_BYTES // (4 * vocab)))
    return per_logit * chunk * vocab + (2 * vocab * hidden if weight_cast else 0) + (4 * vocab * hidden if weight_grad else 0)


def _trainer_parts(cfg: TrainConfig, size: ModelSize, lengths: Lengths, world: int, k: Constants, value: bool) -> list[Part]:
    s, e = size.shape, cfg.engine
    lora = cfg.lora.rank and (not value or cfg.lora.critic)
    total = size.value_model if value else size.params
    trained = size.lora_params(cfg.lora.rank, cfg.lora.target_modules) + (s.hidden + 1 if value else 0) if lora else total
    frozen = total - trained if lora else 0
    tokens, rows = _tokens(cfg, lengths)
    megatron = e.backend == "megatron"
    if megatron:      # bf16 weights, fp32 main gradients, the distributed optimizer's fp32 copy and moments
        split, dp = e.model_parallel, max(1, world // e.model_parallel)
        weights, grads, optimizer = 2 * total / split, 4 * total / split, 12 * total / (split * dp)
        per_layer_tokens = tokens / e.tensor_parallel
    else:             # FSDP2 shards weights, gradients and moments over the role's GPUs
        shards = world if world > 1 else 1
        weights, grads, optimizer = (4 * trained + 2 * frozen) / shards, 4 * trained / shards, 8 * trained / shards
        per_layer_tokens = tokens
    parts = [Part("weights", "weights", weights)]
    if e.offload == "optimizer":     # three chunks' two moments at once: arriving, updating, leaving
        chunk = min(k.offload_chunk, 4 * trained)
        parts.append(Part("optimizer (streamed chunks)", "optimizer", 3 * 2 * chunk, ("update",)))
    else:
        parts.append(Part("optimizer", "optimizer", optimizer))
    parts.append(Part("gradients", "gradients", grads, ("update",)))
    a_hidden, a_ffn = k.train["compiled" if e.compile and world == 1 else "eager"]
    per_token_layer = a_hidden * s.hidden + a_ffn * s.ffn
    layer_trained = size.per_layer if not lora else trained / s.layers
    if e.activation_checkpointing:
        kept = s.layers * per_layer_tokens * k.checkpoint_input * s.hidden + per_layer_tokens * per_token_layer
        casts = 0.0 if megatron else 2 * layer_trained
    else:
        kept = s.layers * per_layer_tokens * per_token_layer
        casts = 0.0 if megatron else 2 * (trained if not lora else 0)
    parts.append(Part("activations", "activations", kept + casts, ("update",)))
    parts.append(Part("activations (forward)", "activations", _inference(size, tokens, k), ("score",)))
    if value:
        parts.append(Part("values", "activations", 4 * s.hidden * tokens, ("update", "score")))
    else:
        positions, fp32_head = rows * lengths.response, not (lora or megatron)
        fused = "compiled" if e.compile else "eager"
        parts.append(Part("output layer", "activations", _head(size, positions, k.head_logit["update"][fused], fp32_head,
                                                                fp32_head), ("update",)))
        parts.append(Part("output layer (forward)", "activations",
                          _head(size, positions, k.head_logit["score"][fused], fp32_head, False), ("score",)))
    return parts


def _inference(size: ModelSize, tokens: int, k: Constants) -> float:
    a_hidden, a_ffn = k.inference
    return tokens * (a_hidden * size.shape.hidden + a_ffn * size.shape.ffn)


def _reference_parts(cfg: TrainConfig, size: ModelSize, lengths: Lengths, world: int, k: Constants) -> list[Part]:
    tokens, rows = _tokens(cfg, lengths)
    split = cfg.engine.model_parallel if cfg.engine.backend == "megatron" else 1
    return [Part("weights (bf16)", "weights", 2 * size.params / split),
            Part("activations (forward)", "activations", _inference(size, tokens, k), ("score",)),
            Part("output layer (forward)", "activations", _head(size, rows * lengths.response,
                                                                k.head_logit["score"]["compiled" if cfg.engine.compile else "eager"],
                                                                False, False), ("score",))]


def _rollout_parts(cfg: TrainConfig, size: ModelSize, lengths: Lengths, ranks: int, gpus: Gpus, k: Constants,
                   in_trainer: bool) -> list[Part]:
    r, s = cfg.rollout, size.shape
    rows = -(-cfg.data.batch_size * r.n_samples // ranks)
    released = in_trainer and r.release_memory
    if r.engine == "vllm":
        share = r.gpu_memory * (gpus.memory or 0)
        return [Part("vLLM (weights, KV cache)", "rollout", share, ("generate",) if in_trainer else PHASES)]
    steps = min(STATIC_CHECK_EVERY, r.max_new_tokens)
    runs = -(-r.max_new_tokens // steps)
    extra = lengths.response - r.max_new_tokens           # a multi-turn episode's observations and turns
    length = -(-(lengths.prompt + extra + runs * steps) // STATIC_CACHE_ROUND) * STATIC_CACHE_ROUND
    vocab = s.vocab
    weights = 2 * (size.params + (size.embedding if s.tied else 0))    # its own output layer even when tied
    buffers = 4 * rows * vocab * ((steps if r.temperature else 0) + 1)  # the sampler's noise and logits, fp32
    parts = [Part("rollout weights (bf16)", "rollout", weights, ("generate", "sync") if released else PHASES),
             Part("KV cache", "rollout", s.kv_bytes_per_token() * rows * length, ("generate",) if released else PHASES),
             Part("sampler buffers", "rollout", buffers, ("generate",) if released else PHASES),
             Part("prompt forward", "rollout", _inference(size, rows * lengths.prompt, k) + 3 * 4 * rows * vocab,
                  ("generate",))]
    if in_trainer and not released:     # load_weights casts the whole new set before it copies it in place
        parts.append(Part("rollout weights (the new set)", "rollout", weights, ("sync",)))
    return parts


# --- what would make a spec fit

@dataclass(frozen=True)
class Fix:
    """A change of the spec (`PATH=VALUE` overrides): the GPU's predicted peak with it, and whether it then fits."""
    overrides: tuple[str, ...]
    peak: float
    fits: bool


def fixes(base: MemoryPlan, gpu: GpuPlan) -> list[Fix]:
    """For a GPU of a plan that it does not fit: single changes that lower its peak (checkpointing,
    the rollout's memory released, the optimizer offloaded, the largest micro-batch that fits, LoRA,
    twice its GPUs: FSDP2 shards weights, gradients and moments), each planned; when none of those
    that change only where memory is held fits alone, the first combination of those that does, taken
    in that order (the micro-batch chosen again for what comes before it), else of those and LoRA."""
    cfg, components = base.cfg, base.components

    def peak(c: TrainConfig, comps: list[Gpus] = components) -> tuple[float, bool]:
        """This GPU's peak and whether it fits, with the change."""
        g = next(g for g in plan_memory(c, comps, base.size, base.constants).gpus if g.gpus.field == gpu.gpus.field)
        return g.peak, bool(g.fits)

    def updated(c: TrainConfig, **changes) -> TrainConfig | None:
        try:
            return c.updated(**changes)
        except ValueError:      # a combination the settings refuse
            return None

    def largest_micro_batch(c: TrainConfig) -> tuple[str, ...]:
        micro = c.optim.micro_batch_size // 2
        while micro > 1 and not peak(c.updated(optim={"micro_batch_size": micro}))[1]:
            micro //= 2
        return (f"train.optim.micro_batch_size={micro}",) if micro else ()

    e, r, roles = cfg.engine, cfg.rollout, set(gpu.gpus.roles)
    changes: list[tuple[str, dict]] = []
    if not e.activation_checkpointing:
        changes.append(("train.engine.activation_checkpointing=true", {"engine": {"activation_checkpointing": True}}))
    if "actor_rollout" in roles and not r.own_role and r.engine == "torch" and not r.release_memory:
        changes.append(("train.rollout.release_memory=true", {"rollout": {"release_memory": True}}))
    if e.backend == "torch" and e.offload == "none" and all(
            g.nodes * g.per_node == 1 for g in components if {"actor_rollout", "critic"} & set(g.roles)):
        changes.append(("train.engine.offload=optimizer", {"engine": {"offload": "optimizer"}}))
    changes += [(m, {"optim": {"micro_batch_size": int(m.rpartition("=")[2])}}) for m in largest_micro_batch(cfg)]
    if not cfg.lora.rank and e.backend == "torch":
        changes.append(("train.lora.rank=16", {"lora": {"rank": 16}}))
    out = [Fix((text,), *peak(c)) for text, change in changes if (c := updated(cfg, **change)) is not None]
    if e.offload == "none":
        g = gpu.gpus
        more, what = (replace(g, per_node=g.per_node * 2), f"gpus_per_node={g.per_node * 2}") if g.per_node < 8 else \
            (replace(g, nodes=g.nodes * 2), f"nodes={g.nodes * 2}")
        out.append(Fix((f"{g.field}.{what}",), *peak(cfg, [more if c is g else c for c in components])))
    out = [f for f in out if f.peak < gpu.peak]
    if any(f.fits for f in out if not f.overrides[0].startswith(("train.lora", gpu.gpus.field))):
        return out
    for with_lora in (False, True):      # where memory is held first; then LoRA too (it changes what trains)
        combined, overrides = cfg, ()
        for text, change in changes:
            if text.startswith("train.optim.micro_batch_size") or (text.startswith("train.lora") and not with_lora):
                continue
            if (c := updated(combined, **change)) is None:
                continue
            combined, overrides = c, overrides + (text,)
            for tail in ((), largest_micro_batch(combined)):
                final = combined.updated(optim={"micro_batch_size": int(tail[0].rpartition("=")[2])}) if tail else combined
                got = peak(final)
                if got[1]:
                    return out + [Fix(overrides + tail, *got)]
    return out


# --- what `hpcrl validate` and `hpcrl plan` print

def plan_rows(plan: MemoryPlan) -> list[list[str]]:
    """One row per process of each GPU component (GiB): its peak phase, the peak by kind, the GPU's memory."""
    rows = [["gpus of", "process", "peak in", *KINDS, "peak", "gpu total", "usable", "fits"]]
    for gpu in plan.gpus:
        for i, p in enumerate(gpu.processes):
            last = i == len(gpu.processes) - 1
            rows.append([gpu.gpus.field if i == 0 else "", "+".join(p.roles), p.peak_phase,
                         *(f"{v / GIB:.1f}" for v in p.by_kind().values()), f"{p.peak / GIB:.1f}",
                         f"{gpu.peak / GIB:.1f}" if last else "",
                         (f"{gpu.usable / GIB:.1f}" if gpu.usable else "?") if last else "",
                         {True: "yes", False: "NO", None: "?"}[gpu.fits] if last else ""])
    return rows


def plan_details(plan: MemoryPlan) -> str:
    """Every part of every process by phase, the inputs and the constants: what `hpcrl plan` prints."""
    lines = []
    if plan.size is not None:
        s = plan.size.shape
        lines.append(f"model: {plan.size.params / 1e9:.3f} B parameters ({s.layers} layers, hidden {s.hidden}, FFN {s.ffn}, "
                     f"{s.heads} heads, {s.kv_heads} KV heads, vocabulary {s.vocab}{', tied' if s.tied else ''})")
    for gpu in plan.gpus:
        lines.append(f"\n{gpu.gpus.field} ({', '.join(gpu.gpus.roles)}): {gpu.gpus.nodes} node(s) × {gpu.gpus.per_node} GPU(s), "
                     f"{gpu.gpus.source}")
        for p in gpu.processes:
            lines.append(f"  process {'+'.join(p.roles)}: peak {p.peak / GIB:.2f} GiB in {p.peak_phase} "
                         f"(allocated {p.allocated / GIB:.2f} × {p.constants.allocator} + context {p.constants.context / GIB:.2f})")
            names = [f"{part.role}: {part.name}" if len(p.roles) > 1 else part.name for part in p.parts]
            width = max(map(len, names))
            lines.append(f"    {'':{width}}  {'  '.join(f'{ph:>9}' for ph in PHASES)}")
            for name, part in zip(names, p.parts):
                cells = "  ".join(f"{part.bytes / GIB:9.2f}" if ph in part.phases else f"{'':9}" for ph in PHASES)
                lines.append(f"    {name:{width}}  {cells}")
            lines.append(f"    {'allocated (the most)':{width}}  " + "  ".join(f"{p.phase_bytes(ph) / GIB:9.2f}" for ph in PHASES))
        if gpu.usable:
            lines.append(f"  the GPU: {gpu.peak / GIB:.2f} GiB of {gpu.usable / GIB:.2f} usable: "
                         + ("fits" if gpu.fits else "does NOT fit"))
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_json(plan: MemoryPlan) -> dict:
    """The plan as data, GiB: each GPU component, its processes, their parts and peaks; the fixes where it does not fit."""
    def gib(x: float) -> float:
        return round(x / GIB, 3)
    return {"fits": plan.fits, "notes": plan.notes,
            "gpus": [{"field": g.gpus.field, "roles": list(g.gpus.roles), "memory": gib(g.gpus.memory or 0) or None,
                      "source": g.gpus.source, "peak": gib(g.peak), "fits": g.fits,
                      "processes": [{"roles": list(p.roles), "peak": gib(p.peak), "allocated": gib(p.allocated),
                                     "peak_phase": p.peak_phase, "by_kind": {k: gib(v) for k, v in p.by_kind().items()},
                                     "phases": {ph: gib(p.phase_bytes(ph)) for ph in PHASES},
                                     "parts": [{"name": x.name, "kind": x.kind, "gib": gib(x.bytes), "phases": list(x.phases)}
                                               for x in p.parts]} for p in g.processes]} for g in plan.gpus],
            "fixes": {g.gpus.field: [{"overrides": list(f.overrides), "peak": gib(f.peak), "fits": f.fits}
                                     for f in fixes(plan, g)] for g in plan.gpus if g.fits is False}}
