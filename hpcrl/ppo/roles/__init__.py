"""Thin role workers: registered methods that call an engine."""
from hpcrl.ppo.roles.actor_rollout import ActorRollout
from hpcrl.ppo.roles.agents import Agents
from hpcrl.ppo.roles.critic import Critic
from hpcrl.ppo.roles.env import Environments
from hpcrl.ppo.roles.judge import Judge
from hpcrl.ppo.roles.reference import Reference
from hpcrl.ppo.roles.reward import RewardModel, RuleReward
from hpcrl.ppo.roles.rollout import Rollout

__all__ = ["ActorRollout", "Agents", "Critic", "Environments", "Judge", "Reference", "RewardModel", "Rollout", "RuleReward"]
