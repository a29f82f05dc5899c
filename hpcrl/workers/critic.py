"""Critic: values of the sampled sequences, and value-loss steps toward the returns."""
from __future__ import annotations

import torch

from hpcrl.algo import value_loss
from hpcrl.config import PPOConfig
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.engines import TorchTrainer
from hpcrl.models import ValueModel, response_values
from hpcrl.protocol import Batch
from hpcrl.workers.common import Checkpointed, local_share, optim_config, ppo_updates, seed_all


class Critic(Checkpointed, Worker):
    def __init__(self, model_dir: str, cfg: dict):
        self.cfg = PPOConfig(**cfg)
        seed_all(self.cfg.seed + 7919 + self.rank)
        init = model_dir if self.cfg.critic_init == "actor" else self.cfg.critic_init
        self.model = ValueModel(init)
        self.engine = TorchTrainer(self.model, optim_config(self.cfg, self.cfg.critic_lr))

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        with torch.no_grad():
            values = response_values(self.model, batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1])
        return Batch({"values": values * batch["response_mask"]})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch) -> dict:
        step = int(batch.meta.get("step", 0))
        return ppo_updates(self.engine, batch, self.cfg, self.world_size, [self.cfg.seed, step, self.rank, 2], self._loss)

    def _loss(self, module, mb: Batch, total_tokens: float, total_seqs: float):
        mask = mb["response_mask"]
        values = response_values(module, mb["input_ids"], mb["attention_mask"], mb["responses"].shape[1])
        loss, stats = value_loss(values, mb["values"], mb["returns"], mask, self.cfg.vf_clip or None,
                                 self.cfg.loss_agg_mode, total_tokens, total_seqs)
        return loss, {"vf_loss": float(loss.detach()) / local_share(mask, total_tokens), "vf_clipfrac": stats["clipfrac"]}

    def checkpoint_state(self) -> dict:
        return self.engine.state_dict()

    def load_checkpoint_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)
