"""The environment protocol: what the policy acts in across the turns of an episode.

An episode starts from a row of the dataset; the model writes a turn, the environment answers it
(runs the tool it called, makes the move, checks the answer) and says whether the episode goes on:

    env = MyEnvironment(**train.environment.kwargs)      one instance per episode, in the env role
    await env.start(row)        the dataset's row: prompt, ground_truth, extra_info (verl's tools_kwargs, ...)
    turn = await env.step(text) the model's turn (its text, the stop token dropped) -> Turn
    ...                         until turn.done, the turn limit or the token budget
    await env.close()           always, once the episode is over

Many episodes run at once on each rank of the env role (one event loop, `asyncio.gather`), so an
environment that waits (a subprocess, a server) must await, not block: put blocking work in
`asyncio.to_thread`. The observation is chat messages (role "tool" or "user"), which the policy's
chat template renders, or text, for a model that takes plain-text prompts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class Turn:
    """An environment's answer to one turn of the model."""
    observation: list[dict] | str = ""
    """what the model reads next: chat messages ({"role": "tool", "content": ...}) or text"""
    reward: float = 0.0
    """this turn's reward; it lands on the turn's last token (the final answer's score comes from the
    reward role, as for single-turn rollouts)"""
    done: bool = False
    """the episode is over (no observation is read)"""
    info: dict = field(default_factory=dict)
    """numbers the step's metrics sum over episodes as env/<name> (tool_calls, tool_errors, ...)"""


class Environment:
    """Base class of environments (any class with these coroutines will do)."""

    tools: ClassVar[list[dict]] = []
    """the tools the prompt describes to the model, as JSON schemas ({"type": "function", "function":
    {"name", "description", "parameters"}})"""

    @classmethod
    def tool_schemas(cls, **kwargs) -> list[dict]:
        """The tools an environment made with `kwargs` offers (the driver renders them into the
        prompts without making one): `tools`, unless the class says otherwise."""
        return list(cls.tools)

    async def start(self, row: dict) -> None:
        """A new episode from a dataset row (every field of the row)."""

    async def step(self, text: str) -> Turn:
        """The model's turn -> the environment's answer."""
        raise NotImplementedError

    async def close(self) -> None:
        """The episode is over: free what it holds."""
