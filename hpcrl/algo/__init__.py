"""Pure PPO/GRPO mathematics on tensors: no Ray, no Slurm, no I/O. Each function's docstring has
its formula; tests/test_algo.py checks each against numpy."""
from hpcrl.algo.advantages import (discounted_returns, gae, grpo_advantages, masked_mean, masked_whiten,
                                   reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages)
from hpcrl.algo.kl import AdaptiveKLController, FixedKLController, kl_penalty
from hpcrl.algo.losses import (aggregate, entropy_from_logits, masked_is_weights, policy_loss, truncated_is_weights,
                               value_loss)
from hpcrl.algo.rewards import last_token_index, overlong_penalty, token_level_rewards, truncate_at_eos, varied_groups

__all__ = ["discounted_returns", "gae", "grpo_advantages", "masked_mean", "masked_whiten", "reinforce_pp_advantages",
           "reinforce_pp_baseline_advantages", "rloo_advantages", "AdaptiveKLController", "FixedKLController",
           "kl_penalty", "aggregate", "entropy_from_logits", "masked_is_weights", "policy_loss", "truncated_is_weights",
           "value_loss", "last_token_index",
           "overlong_penalty", "token_level_rewards", "truncate_at_eos", "varied_groups"]
