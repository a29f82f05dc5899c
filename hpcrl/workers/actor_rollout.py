"""ActorRollout: the policy. Samples responses, recomputes their log-probs, takes PPO steps."""
from __future__ import annotations

import torch

from hpcrl.algo import aggregate, kl_penalty, masked_mean, policy_loss
from hpcrl.config import PPOConfig
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.engines import TorchTrainer
from hpcrl.models import load_causal_lm, response_log_probs
from hpcrl.protocol import Batch
from hpcrl.workers.common import Checkpointed, local_share, optim_config, ppo_updates, seed_all
from hpcrl.workers.rollout import Generates, make_rollout_engine


class ActorRollout(Generates, Checkpointed, Worker):
    """The policy; it also generates unless the job runs a separate `rollout` role."""
    shares_device = True

    def __init__(self, model_dir: str, cfg: dict):
        self.cfg = PPOConfig(**cfg)
        seed_all(self.cfg.seed + self.rank)
        self.model = load_causal_lm(model_dir)
        self.rollout = None if self.cfg.rollout_role else make_rollout_engine(self.cfg, model_dir, self.model, self.rank)
        self.engine = TorchTrainer(self.model, optim_config(self.cfg, self.cfg.actor_lr))

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """log π_old of the sampled tokens, recomputed by the training model (not the sampler's)."""
        self.model.eval()
        with torch.no_grad():
            logp, ent = response_log_probs(self.model, batch["input_ids"], batch["attention_mask"], batch["responses"],
                                           self.cfg.temperature, with_entropy=True)
        return Batch({"old_log_probs": logp, "entropy": ent})

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict:
        step = int(batch.meta.get("step", 0))
        return ppo_updates(self.engine, batch, self.cfg, self.world_size, [self.cfg.seed, step, self.rank, 1], self._loss)

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> None:
        """Push the trained weights into this process's vLLM engine, in place. The torch engine
        samples from the training module itself: nothing to copy."""
        if self.rollout is not None and self.cfg.rollout_engine != "torch":
            self.rollout.load_weights(self.model.state_dict())

    @register(Dispatch.RANK_ZERO)
    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's parameters by HF name, for a separate rollout role's `load_weights`."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def _loss(self, module, mb: Batch, total_tokens: float, total_seqs: float):
        cfg, mask = self.cfg, mb["response_mask"]
        logp, ent = response_log_probs(module, mb["input_ids"], mb["attention_mask"], mb["responses"],
                                       cfg.temperature, with_entropy=True)
        pg, stats = policy_loss(logp, mb["old_log_probs"], mb["advantages"], mask, cfg.clip_low, cfg.clip_high,
                                cfg.dual_clip or None, cfg.loss_agg_mode, total_tokens, total_seqs)
        loss = pg
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(ent, mask, cfg.loss_agg_mode, total_tokens, total_seqs)
        share = local_share(mask, total_tokens)
        stats.update(pg_loss=float(pg.detach()) / share, entropy=float(masked_mean(ent.detach(), mask)))
        if cfg.kl_loss and cfg.kl_coef:
            kl = kl_penalty(logp, mb["ref_log_probs"], cfg.kl_loss_estimator)
            kl_loss = aggregate(kl, mask, cfg.loss_agg_mode, total_tokens, total_seqs)
            loss = loss + cfg.kl_coef * kl_loss
            stats["kl_loss"] = float(kl_loss) / share
        return loss, stats

    def checkpoint_state(self) -> dict:
        return self.engine.state_dict()

    def load_checkpoint_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)
        self.sync_rollout_weights()
