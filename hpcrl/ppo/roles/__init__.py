"""Thin role workers: registered methods that call an engine."""
from hpcrl.ppo.roles.actor_rollout import ActorRollout
from hpcrl.ppo.roles.critic import Critic
from hpcrl.ppo.roles.env import Environments
from hpcrl.ppo.roles.reference import Reference
from hpcrl.ppo.roles.reward import RewardModel, RuleReward
from hpcrl.ppo.roles.rollout import Rollout

__all__ = ["ActorRollout", "Critic", "Environments", "Reference", "RewardModel", "Rollout", "RuleReward"]
