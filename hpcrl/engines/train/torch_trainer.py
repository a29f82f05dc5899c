"""Training in plain torch (a TrainEngine): micro-batches with gradient accumulation, clipping, AdamW, warm-up LR,
and data parallelism within a role: DDP on CPU (gloo), FSDP2 (`fully_shard`, one unit per decoder
layer) on GPUs. On a GPU the forward runs under bf16 autocast (master weights and optimizer state
stay fp32; weights that do not train are stored in bf16) with PyTorch's SDPA attention, each decoder
layer compiled by Inductor on one GPU (`compile`), and AdamW is the fused kernel. `pack`: each
micro-batch's forward runs on its sequences packed into one row without padding (hpcrl.models.packing
says how, and which attention a GPU takes). `checkpointing`: each decoder layer's activations are
computed again in the backward instead of kept. `offload="optimizer"`: AdamW's moments live in host
memory between steps (offload.py).

The engine is told what the role computes (`forward(module, micro_batch) -> {name: per-token
tensor}`, e.g. response log-probs or values) and trains on a loss of those outputs, so roles never
touch the module, its device or its wrapper.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hpcrl.controller.batch import Batch
from hpcrl.controller.layer_rehearsal import compile_layers
from hpcrl.engines.micro_batches import micro_batches, pad_responses
from hpcrl.engines.train.offload import HostOptimizerState
from hpcrl.models.critic import ValueModel

Forward = Callable[[torch.nn.Module, Batch], dict]


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0          # optimizer steps of linear warm-up from 0, then constant
    grad_clip: float = 1.0
    micro_batch_size: int = 16
    micro_batch_tokens: int = 0    # > 0: also at most this many (unpadded) tokens per micro-batch


def lr_factor(cfg: OptimConfig):
    def factor(step: int) -> float:
        return (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else 1.0
    return factor


def use_bf16(precision: str, device: torch.device) -> bool:
    """precision "auto": bf16 on a GPU, fp32 on CPU."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision: {precision!r} is not auto, bf16 or fp32")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def all_sum(x: float, device: torch.device, group=None) -> float:
    """Sum over the ranks of `group` (default: the role's; a no-op alone)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


class TorchTrainer:
    """loss_fn(out, micro_batch, total_tokens, total_seqs) -> (loss, stats): the loss of the micro-batch
    as its share of the whole mini-batch (the totals span every micro-batch and every rank), where
    `out` is forward(module, micro_batch). cfg None: inference only (a frozen role). `pack`: micro-batches
    are marked for a packed forward, their token budget counting real tokens (micro_batches).
    `checkpointing` (a training engine's): each decoder layer of the HF module (a ValueModel's
    backbone) recomputes its activations in the backward, by transformers' own non-reentrant
    checkpoint around the layer's call (the compiled one on a GPU). `offload` "optimizer": AdamW's
    moments on the host between steps, one GPU per process group (not under FSDP2)."""

    def __init__(self, module: torch.nn.Module, cfg: OptimConfig | None, forward: Forward,
                 device: torch.device | str = "cpu", precision: str = "auto", compile: bool = True,
                 pack: bool = False, checkpointing: bool = False, offload: str = "none"):
        self.cfg, self.forward, self.pack = cfg, forward, pack
        self.device = torch.device(device)
        self.bf16 = use_bf16(precision, self.device)
        self.checkpointing = checkpointing and cfg is not None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.sharded = self.world > 1 and self.device.type == "cuda" and cfg is not None
        if offload not in ("none", "optimizer"):
            raise ValueError(f"train.engine.offload: {offload!r} is not none or optimizer")
        if offload == "optimizer" and self.sharded:
            raise ValueError(f"train.engine.offload: optimizer needs one GPU per process group; these {self.world} "
                             "GPUs shard the model with FSDP2, whose optimizer state is already split over them: "
                             "set offload: none")
        self.module = module.to(self.device)
        if self.bf16:
            # What does not train is stored in bf16, the dtype its forward computes in under autocast:
            # half the memory of a reference, or of a LoRA module's base. Buffers (RoPE's frequencies) stay.
            for p in module.parameters():
                if cfg is None or not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        if self.checkpointing:
            hf = module.backbone if isinstance(module, ValueModel) else module
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = [sub for sub in module.modules() if type(sub).__name__.endswith("DecoderLayer")]
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for layer in layers:
                fully_shard(layer)
            self.wrapped = fully_shard(module)
        elif self.world > 1 and cfg is not None:
            self.wrapped = torch.nn.parallel.DistributedDataParallel(module)
        else:
            self.wrapped = module
        self.compiled = compile and self.device.type == "cuda" and not self.sharded
        if self.compiled:
            # in place: parameter names and state dicts stay as they are. Not under FSDP2, whose hooks
            # the compiled layer would have to trace (untested here, where one GPU is all there is).
            # A checkpointed layer's call (transformers' GradientCheckpointingLayer) checkpoints this
            # compiled one: its recompute runs the compiled graph again. A standby process rehearses
            # the calls (layer_rehearsal), so that a rank it takes over finds them compiled
            compile_layers(layers)
        if cfg is None:
            module.requires_grad_(False)
            return
        trainable = [p for p in module.parameters() if p.requires_grad]   # all, or LoRA adapters (lora.py)
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg))
        self.optimizer_step = HostOptimizerState(self.optimizer).step if offload == "optimizer" else self.optimizer.step

    def _autocast(self):
        # With checkpointing, autocast's cache would keep the bf16 cast of every fp32 weight until the
        # forward ends (2 bytes a weight: most of what a checkpointed forward holds); off, each layer
        # casts its weights when it runs, as its recompute in the backward does anyway
        return (torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=not self.checkpointing)
                if self.bf16 else nullcontext())

    def _run(self, module: torch.nn.Module, mb: Batch) -> dict:
        with self._autocast():
            return self.forward(module, mb.to(self.device))

    @torch.no_grad()
    def infer(self, batch: Batch, micro_batch_size: int, micro_batch_tokens: int = 0) -> Batch:
        """forward over the batch in micro-batches, without gradients; float32 results on the CPU."""
        self.module.eval()     # the bare module (DDP's forward would sync buffers; FSDP2's is this module)
        micro = micro_batches(batch, micro_batch_size, micro_batch_tokens, self.sharded, self.device, self.pack)
        width = batch["responses"].shape[1] if "responses" in batch else 0
        outs = [pad_responses(self._run(self.module, mb), width) for mb in micro]
        return Batch({k: torch.cat([o[k] for o in outs]).float().cpu() for k in outs[0]})

    def compile_ahead(self, batch: Batch, micro_batch_size: int, micro_batch_tokens: int = 0,
                      trained: tuple[str, ...] = ()) -> None:
        """The compiled layers' calls of `infer` and of `train_step` made on `batch` (made-up tokens of the
        run's sizes) ahead of the real ones, so that a new process compiles them while it would wait (for
        the rollout's first batch). The training forward's backward runs too, from the outputs `trained`
        (those the loss differentiates: each makes a backward of its own kind), its gradients then dropped:
        the weights, the optimizer's state and its schedule stay as they were. Nothing where no layer is
        compiled (the CPU, FSDP2)."""
        if not self.compiled:
            return
        self.infer(batch, micro_batch_size, micro_batch_tokens)
        if self.cfg is None or not trained:
            return
        self.wrapped.train()
        for mb in micro_batches(batch, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens, self.sharded,
                                self.device, self.pack):
            out = self._run(self.wrapped, mb)
            sum(out[k].float().sum() for k in trained).backward()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, batch: Batch, loss_fn: Callable, mask_key: str = "response_mask") -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (every rank must hold the same
        number of samples: pad with zero-mask samples)."""
        self.wrapped.train()
        mask = batch[mask_key]
        total_tokens = all_sum(float(mask.sum()), self.device)
        total_seqs = all_sum(float((mask.sum(dim=1) > 0).sum()), self.device)
        micro = micro_batches(batch, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens, self.sharded, self.device,
                              self.pack)
        # Every value summed over micro-batches and ranks: the loss is already each piece's share of the
        # mini-batch's; the stats (token means within a piece) are weighted by the piece's token share.
        sums: dict[str, float] = {}
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            if self.sharded:
                self.wrapped.set_requires_gradient_sync(last)
            sync = nullcontext() if self.sharded or last or self.world == 1 else self.wrapped.no_sync()
            with sync:
                out = self._run(self.wrapped, mb)
                loss, stats = loss_fn(out, mb.to(self.device), total_tokens, total_seqs)
                (loss * self.world).backward()   # DP averages over ranks; undo it, the loss is a share of the total
            share = float(mb[mask_key].sum()) / max(total_tokens, 1.0)
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):   # a non-finite gradient skips the step rather than poisoning the weights
            self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out = {k: all_sum(v, self.device) for k, v in sums.items()}
        out.update(grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        return out

    @property
    def state_replicated(self) -> bool:
        """Every rank holds the whole state (DDP, one rank): any rank may write any part of it."""
        return not self.sharded

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The module's parameters by HF name, whole on every rank (gathered when sharded)."""
        if not self.sharded:
            return self.module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))

    def _frozen(self) -> set[str]:
        """Names of the parameters a training engine keeps frozen (a LoRA module's base): not part of
        its state, the model directory has them. None of an inference-only engine's: its state is all of it."""
        if self.cfg is None:
            return set()
        return {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def state_dict(self) -> dict:
        """Whole (gathered) parameters and optimizer state on the CPU, the same for any world size;
        of a training engine only the parameters that train."""
        if self.cfg is None:
            return {"model": self.module.state_dict()}
        if not self.sharded:
            frozen = self._frozen()
            return {"model": {k: v for k, v in self.module.state_dict().items() if k not in frozen},
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
        return {"model": model, "optimizer": optim, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=StateDictOptions(full_state_dict=True, strict=not self._frozen()))
        else:
            missing, unexpected = self.module.load_state_dict(state["model"], strict=False)
            if unexpected or set(missing) - self._frozen():
                raise ValueError(f"the checkpointed model does not fit this engine's (missing "
                                 f"{sorted(set(missing) - self._frozen())[:3]}, unexpected {unexpected[:3]})")
            if self.cfg is not None:
                self.optimizer.load_state_dict(state["optimizer"])
        if self.cfg is not None:
            self.scheduler.load_state_dict(state["scheduler"])
