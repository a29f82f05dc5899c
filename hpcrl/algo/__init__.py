"""Pure PPO/GRPO mathematics on tensors: no Ray, no Slurm, no I/O. Each function's docstring has
its formula; tests/test_algo.py checks each against numpy."""
from hpcrl.algo.advantages import gae, grpo_advantages, masked_mean, masked_whiten
from hpcrl.algo.kl import AdaptiveKLController, FixedKLController, kl_penalty
from hpcrl.algo.losses import aggregate, entropy_from_logits, policy_loss, truncated_is_weights, value_loss
from hpcrl.algo.rewards import last_token_index, token_level_rewards, truncate_at_eos

__all__ = ["gae", "grpo_advantages", "masked_mean", "masked_whiten", "AdaptiveKLController", "FixedKLController",
           "kl_penalty", "aggregate", "entropy_from_logits", "policy_loss", "truncated_is_weights", "value_loss", "last_token_index",
           "token_level_rewards", "truncate_at_eos"]
