"""Training in plain torch: micro-batches with gradient accumulation, clipping, AdamW, warm-up LR,
and data parallelism within a role (DDP over the role's own torch.distributed group)."""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hpcrl.protocol import Batch


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0          # optimizer steps of linear warm-up from 0
    total_steps: int = 0           # for the cosine decay; 0: constant after warm-up
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 16


def _lr_factor(cfg: OptimConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if not cfg.total_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class TorchTrainer:
    """loss_fn(module, micro_batch, total_tokens, total_seqs) -> (loss, stats): the loss of the micro-batch
    as its share of the whole mini-batch (the totals span every micro-batch and every rank)."""

    def __init__(self, module: torch.nn.Module, cfg: OptimConfig):
        self.cfg = cfg
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.module = module
        self.wrapped = torch.nn.parallel.DistributedDataParallel(module) if self.world > 1 else module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_factor(cfg))

    def _all_sum(self, x: float) -> float:
        if self.world == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def train_step(self, batch: Batch, loss_fn: Callable, mask_key: str = "response_mask") -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (every rank must hold the same
        number of samples: pad with zero-mask samples)."""
        self.wrapped.train()
        mask = batch[mask_key]
        total_tokens = self._all_sum(float(mask.sum()))
        total_seqs = self._all_sum(float((mask.sum(dim=1) > 0).sum()))
        micro = batch.split(self.cfg.micro_batch_size)
        # Every value summed over micro-batches and ranks: the loss is already each piece's share of the
        # mini-batch's; the stats (token means within a piece) are weighted by the piece's token share.
        sums: dict[str, float] = {}
        for i, mb in enumerate(micro):
            sync = not (self.world > 1 and i < len(micro) - 1)
            with (nullcontext() if sync else self.wrapped.no_sync()):
                loss, stats = loss_fn(self.wrapped, mb, total_tokens, total_seqs)
                (loss * self.world).backward()   # DDP averages over ranks; undo it, the loss is a share of the total
            share = float(mb[mask_key].sum()) / max(total_tokens, 1.0)
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
        if torch.isfinite(grad_norm):   # a non-finite gradient skips the step rather than poisoning the weights
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out = {k: self._all_sum(v) for k, v in sums.items()}
        out.update(grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        return out

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
