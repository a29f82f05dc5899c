"""What the roles share: optimiser settings, the PPO epoch/mini-batch loop, checkpoint methods."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpcrl import checkpoint_mpio
from hpcrl.checkpoint import AsyncWriter, read_role_file, rng_state, set_rng_state, snapshot, write_role_file
from hpcrl.config import PPOConfig
from hpcrl.controller import Dispatch, register
from hpcrl.engines import OptimConfig, TorchTrainer
from hpcrl.models import ValueModel, load_causal_lm, log_probs_head, values_head
from hpcrl.protocol import Batch


def seed_all(seed: int) -> None:
    """torch, numpy's and Python's global generators: a role's whole RNG state is then a function of
    the seed, so a resumed run and an uninterrupted one hold the same state (even where unused)."""
    import random

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def optim_config(cfg: PPOConfig, lr: float) -> OptimConfig:
    return OptimConfig(lr=lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                       grad_clip=cfg.grad_clip, micro_batch_size=cfg.micro_batch_size)


def make_train_engine(cfg: PPOConfig, model_dir: str, head: str, device: torch.device, lr: float | None):
    """The engine of a role: head "log_probs" (actor; reference when lr is None) or "values" (critic),
    on cfg.train_engine. lr None: inference only."""
    optim = optim_config(cfg, lr) if lr is not None else None
    if cfg.train_engine == "megatron":
        try:
            from hpcrl.engines.megatron import MegatronEngine
        except ImportError as e:
            raise RuntimeError(f"train.train_engine: megatron, but megatron-core does not import here ({e}); "
                               "install `hpcrl[megatron]` on the GPU nodes, or use train_engine: torch") from e
        return MegatronEngine(model_dir, head, optim, cfg.tensor_parallel, cfg.pipeline_parallel, cfg.temperature,
                              cfg.seed)
    if head == "values":
        module, forward = ValueModel(model_dir), values_head
    else:
        module, forward = load_causal_lm(model_dir), log_probs_head(cfg.temperature, with_entropy=lr is not None)
    return TorchTrainer(module, optim, forward, device, cfg.precision)


def ppo_updates(engine, batch: Batch, cfg: PPOConfig, world_size: int, seed: list[int], loss_fn) -> dict:
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


class Checkpointed:
    """Checkpoint methods every role shares. A role defines `checkpoint_state()` and
    `load_checkpoint_state(state)`; `frozen = True` roles are written once per run.

    Ranks of a data-parallel role hold the same parameters and optimizer state, so one file holds
    the role, with every rank's RNG state; any world size can load it (a rank without its own RNG
    entry keeps its seed). Rank 0 writes it, or, with parallel HDF5 (`checkpoint_io`), every rank
    writes its rows of it."""
    frozen = False

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int, background: bool = False):
        parallel = self._writes_in_parallel()
        ranks = self._gather((rng_state(), checkpoint_mpio.node_name()), everywhere=parallel)
        role_state = self.checkpoint_state()     # on every rank: gathering a sharded engine's state is a collective
        if not (parallel or self.rank == 0):
            return None
        state = {"role": role_state, "rng": {r: rng for r, (rng, _) in enumerate(ranks)}}
        attrs = {"step": step, "role": self.role, "world_size": self.world_size}
        if parallel:
            checkpoint_mpio.stage(Path(path), state, attrs, self.rank, self.world_size)
            dist.barrier()                       # every share is staged: training may go on
            if self.rank != 0:
                return None
            write = partial(checkpoint_mpio.write_staged, Path(path), [node for _, node in ranks])
        else:
            write = partial(write_role_file, Path(path), snapshot(state) if background else state, attrs)
        if background:
            self._ckpt_writer().submit(write)
            return {"pending": True}
        return write()

    def _writes_in_parallel(self) -> bool:
        """Parallel HDF5 for a data-parallel role of several ranks, as `checkpoint_io` says."""
        mode = getattr(getattr(self, "cfg", None), "checkpoint_io", "auto")
        if mode == "serial" or self.world_size == 1:
            return False
        why = checkpoint_mpio.unavailable()
        if not getattr(getattr(self, "engine", None), "state_replicated", False):
            why = why or "its ranks hold shards of the state, not copies"
        if why and mode == "parallel":
            raise RuntimeError(f"train.checkpoint_io: parallel, but role {self.role} cannot: {why}")
        return why is None

    def _gather(self, mine, everywhere: bool) -> list | None:
        """Every rank's value, in rank order: on rank 0 (everywhere: on every rank)."""
        if not (dist.is_initialized() and self.world_size > 1):
            return [mine]
        if everywhere:
            out = [None] * self.world_size
            dist.all_gather_object(out, mine)
            return out
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0)
        return out

    @register(Dispatch.RANK_ZERO)
    def finish_checkpoint(self):
        """Wait for a background save; its file info (or None if there was none)."""
        return self._ckpt_writer().wait()

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        state, attrs = read_role_file(Path(path))
        self.load_checkpoint_state(state["role"])
        if self.rank in state["rng"]:
            set_rng_state(state["rng"][self.rank])
        return int(attrs["step"])

    def checkpoint_state(self) -> dict:
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        pass

    def _ckpt_writer(self) -> AsyncWriter:
        if not hasattr(self, "_writer"):
            self._writer = AsyncWriter()
        return self._writer
