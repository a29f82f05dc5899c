"""What the training roles share: their optimiser settings and the PPO epoch/mini-batch loop."""
from __future__ import annotations

import numpy as np
import torch

from hpcrl.config import PPOConfig
from hpcrl.engines import OptimConfig, TorchTrainer
from hpcrl.protocol import Batch


def optim_config(cfg: PPOConfig, lr: float) -> OptimConfig:
    return OptimConfig(lr=lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                       grad_clip=cfg.grad_clip, micro_batch_size=cfg.micro_batch_size)


def ppo_updates(engine: TorchTrainer, batch: Batch, cfg: PPOConfig, world_size: int, seed: list[int], loss_fn) -> dict:
    """cfg.ppo_epochs passes over this rank's shard, each in a fresh seeded order, one optimizer step
    per mini-batch. Returns the stats averaged over the optimizer steps."""
    per_rank = max(1, cfg.mini_batch_size // world_size)
    steps = []
    for epoch in range(cfg.ppo_epochs):
        order = np.random.default_rng([*seed, epoch]).permutation(len(batch))
        for mb in batch.reorder(order).split(per_rank):
            steps.append(engine.train_step(mb, loss_fn))
    return {k: float(np.mean([s[k] for s in steps])) for k in steps[0]} if steps else {}


def local_share(mask: torch.Tensor, total_tokens: float) -> float:
    """This micro-batch's share of the mini-batch's tokens (to report losses as per-token means)."""
    return max(float(mask.sum()), 1.0) / max(total_tokens, 1.0)
