"""Thin role workers: registered methods that call an engine."""
from hpcrl.workers.actor_rollout import ActorRollout
from hpcrl.workers.critic import Critic
from hpcrl.workers.reference import Reference
from hpcrl.workers.reward import RewardModel, RuleReward
from hpcrl.workers.rollout import Rollout

__all__ = ["ActorRollout", "Critic", "Reference", "RewardModel", "Rollout", "RuleReward"]
