"""Critic: values of the sampled sequences, and value-loss steps toward the returns."""
from __future__ import annotations

from hpcrl.algo import value_loss
from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.controller.batch import Batch
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import CompilesAhead, ModelRole, local_share, make_train_engine, ppo_updates, seed_all


class Critic(Checkpointed, CompilesAhead, ModelRole, Worker):
    def __init__(self, model_dir: str, cfg: TrainConfig):
        self.cfg = cfg
        seed_all(self.cfg.seed + 7919 + self.rank)
        init = model_dir if self.cfg.model.critic_init == "actor" else self.cfg.model.critic_init
        self.engine = make_train_engine(self.cfg, init, "values", self.device, self.cfg.optim.critic_lr)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        values = self.engine.infer(batch, self.cfg.optim.micro_batch_size, self.cfg.optim.micro_batch_tokens)["values"]
        return Batch({"values": values * batch["response_mask"]})

    @register(Dispatch.DP_COMPUTE, changes_state=True)
    def update_critic(self, batch: Batch) -> dict:
        step = int(batch.meta.get("step", 0))
        return ppo_updates(self.engine, batch, self.cfg, self.world_size, [self.cfg.seed, step, self.rank, 2], self._loss)

    def trained_outputs(self) -> tuple[str, ...]:
        return ("values",)

    def _loss(self, out: dict, mb: Batch, total_tokens: float, total_seqs: float):
        mask = mb["response_mask"]
        loss, stats = value_loss(out["values"], mb["values"], mb["returns"], mask, self.cfg.algorithm.vf_clip or None,
                                 self.cfg.algorithm.loss_agg_mode, total_tokens, total_seqs, self.cfg.rollout.max_new_tokens)
        return loss, {"vf_loss": float(loss.detach()) / local_share(mask, total_tokens), "vf_clipfrac": stats["clipfrac"]}

    def checkpoint_state(self) -> dict:
        return self.engine.state_dict()

    def load_checkpoint_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)
