"""Environments for multi-turn rollouts: the protocol (base.py), tools and their call format, the
tool-calling environment, and the sandbox that runs model-written code."""
from hpcrl.environments.base import Environment, Turn
from hpcrl.environments.tool_env import ToolEnvironment
from hpcrl.environments.tools import Calculator, Python, Tool, ToolError

__all__ = ["Calculator", "Environment", "Python", "Tool", "ToolEnvironment", "ToolError", "Turn"]
