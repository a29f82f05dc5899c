"""ActorRollout: the policy. Samples responses, recomputes their log-probs, takes PPO steps."""
from __future__ import annotations

from typing import Sequence

import torch

from hpcrl.algo import aggregate, kl_penalty, masked_is_weights, masked_mean, policy_loss, truncated_is_weights
from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register, startup
from hpcrl.controller.batch import Batch, Weights
from hpcrl.controller.device_weights import DeviceWeights, Placement, shares_gpu
from hpcrl.controller.weight_transport import Ticket, WeightGroup, WeightGroupError
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import CompilesAhead, ModelRole, local_share, make_train_engine, ppo_updates, seed_all
from hpcrl.ppo.roles.rollout import Generates, make_rollout_engine


class ActorRollout(Generates, Checkpointed, CompilesAhead, ModelRole, Worker):
    """The policy; it also generates unless the job runs a separate `rollout` role."""
    shares_device = True
    weights_to: WeightGroup | None = None    # rank 0: the group it sends the weights to a rollout role by

    def __init__(self, model_dir: str, cfg: TrainConfig):
        self.cfg, self.model_dir = cfg, model_dir
        seed_all(self.cfg.seed + self.rank)
        self.engine = make_train_engine(self.cfg, model_dir, "log_probs", self.device, self.cfg.optim.actor_lr)
        self.rollout = None if self.cfg.rollout.own_role else make_rollout_engine(self.cfg, model_dir, self.rank, self.device,
                                                                              self.engine)
        if self.rollout is not None:
            startup.mark("rollout engine")

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """log π_old of the sampled tokens, recomputed by the training model (not the sampler's); with
        LoRA and a KL term also the reference's, log π_ref: the same model with its adapters off."""
        micro = self.cfg.optim.micro_batch_size, self.cfg.optim.micro_batch_tokens
        out = self.engine.infer(batch, *micro)
        scored = {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}
        if self.cfg.reference_in_actor:
            with self.engine.adapters_off():
                scored["ref_log_probs"] = self.engine.infer(batch, *micro)["log_probs"]
        return Batch(scored)

    @register(Dispatch.DP_COMPUTE, changes_state=True)
    def update_actor(self, batch: Batch) -> dict:
        step = int(batch.meta.get("step", 0))
        return ppo_updates(self.engine, batch, self.cfg, self.world_size, [self.cfg.seed, step, self.rank, 1], self._loss)

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, version: int | None = None) -> None:
        """Copy the trained weights (of the update at step `version`) into this process's rollout
        engine, in place (a sampler that is the training module itself needs nothing)."""
        if self.rollout is not None and not self.rollout.shares_module:
            self.rollout.load_weights(self.engine.full_weights())
        if version is not None:
            self.policy_version = version

    @register(Dispatch.ALL_RANK_ZERO)
    def export_weights(self, dtype: str | None = None, to: Sequence[Placement] = ()) -> Weights | DeviceWeights | None:
        """The policy's parameters by HF name, for a separate rollout role's `load_weights`; floating
        ones in `dtype` (the rollout's sampling dtype, Rollout.sampling_dtype), when given. `to`: where
        the rollout's ranks run (Rollout.placement); when all are on this rank's GPU the weights stay
        on it (DeviceWeights), else they go through host memory (Weights)."""
        weights = self.engine.full_weights()      # every rank: gathering sharded weights is a collective
        if self.rank != 0:
            return None
        cast = getattr(torch, dtype) if dtype else None
        if shares_gpu(Placement.of(self.device), to):
            return DeviceWeights.export(weights, cast, self.device, readers=len(to))
        return Weights({k: v.detach().to(cast if cast and v.is_floating_point() else v.dtype).cpu()
                        for k, v in weights.items()})

    @register(Dispatch.RANK_ZERO)
    def placement(self) -> Placement:
        """Where its rank 0 runs, the rank that sends the weights to a rollout role."""
        return Placement.of(self.device)

    @register(Dispatch.RANK_ZERO)
    def join_weight_group(self, ticket: Ticket) -> None:
        """Rank 0 joins the group it sends the weights by, as its rank 0 (a stale ticket: nothing)."""
        if self.weights_to is None or self.weights_to.ticket.formation < ticket.formation:
            self.weights_to = WeightGroup.join(ticket, 0, self.device) or self.weights_to

    @register(Dispatch.ALL_RANK_ZERO)
    def send_weights(self, dtype: str, ticket: Ticket) -> str | None:
        """The policy's parameters, floating ones in `dtype`, to the rollout's ranks by the group of
        `ticket`: "sent"; "stale" when that group was re-formed since (the weights go again through
        the new one); "broken: why" when a receiver went away meanwhile (its rebuild re-forms the
        group), and the group is let go, so that the ranks still waiting on it are told at once."""
        weights = self.engine.full_weights()      # every rank: gathering sharded weights is a collective
        if self.rank != 0:
            return None
        if self.weights_to is None or self.weights_to.ticket != ticket:
            return "stale"
        try:
            self.weights_to.send(weights, getattr(torch, dtype))
        except WeightGroupError as e:
            self.weights_to = None
            return f"broken: {e}"
        return "sent"

    def trained_outputs(self) -> tuple[str, ...]:
        return ("log_probs", "entropy") if self.cfg.algorithm.entropy_coef else ("log_probs",)

    def _loss(self, out: dict, mb: Batch, total_tokens: float, total_seqs: float):
        algorithm, mask, logp, ent = self.cfg.algorithm, mb["response_mask"], out["log_probs"], out["entropy"]
        mode, counts = algorithm.loss_agg_mode, dict(total_tokens=total_tokens, total_seqs=total_seqs,
                                                     max_length=self.cfg.rollout.max_new_tokens)
        weights = truncated_is_weights(mb["old_log_probs"], mb["rollout_log_probs"], algorithm.tis_cap) if algorithm.tis_cap else None
        if algorithm.mis_band:
            kept = masked_is_weights(mb["old_log_probs"], mb["rollout_log_probs"], *algorithm.mis_band)
            weights = kept if weights is None else weights * kept
        pg, stats = policy_loss(logp, mb["old_log_probs"], mb["advantages"], mask, algorithm.clip_low, algorithm.clip_high,
                                algorithm.dual_clip or None, mode, is_weights=weights,
                                importance="sequence" if algorithm.policy_loss == "gspo" else "token", **counts)
        loss = pg
        if algorithm.entropy_coef:
            loss = loss - algorithm.entropy_coef * aggregate(ent, mask, mode, **counts)
        share = local_share(mask, total_tokens)
        stats.update(pg_loss=float(pg.detach()) / share, entropy=float(masked_mean(ent.detach(), mask)))
        if algorithm.mis_band:
            stats["mis_masked"] = 1.0 - float(masked_mean(kept, mask))
        if algorithm.kl_loss and algorithm.kl_coef:
            kl_loss = aggregate(kl_penalty(logp, mb["ref_log_probs"], algorithm.kl_loss_estimator), mask, mode, **counts)
            loss = loss + algorithm.kl_coef * kl_loss
            stats["kl_loss"] = float(kl_loss) / share
        return loss, stats

    def checkpoint_state(self) -> dict:
        return self.engine.state_dict()

    def load_checkpoint_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)
        self.sync_rollout_weights()
