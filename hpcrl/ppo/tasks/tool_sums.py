"""Sums with a calculator: the prompt "37+45=" is answered "82", by a model too small to add, through
a calculator it calls.

A turn that starts with "=" is the answer ("=82"); any other calls the calculator on what it holds
before its first "=": "37+45" is answered "82=" (an expression it cannot read: "="), and the next
turn, the last, is the answer. The answer scores the share of the sum's digits it gives in place
(its leading "=" dropped), as the copy task scores (hpcrl/ppo/tasks/copy_digits.py). A call earns
`call_reward` × the share of the prompt's expression it repeats in place: a per-turn reward that
leads a randomly initialised model to the right call, which the answer alone would reward only once
the model also copied the result. Without the environment the model must answer at once, from the
prompt alone: the same task, to compare against.

    train:
      data: {task: tool_sums, task_digits: 2}
      environment: {cls: "hpcrl.ppo.tasks.tool_sums:SumsEnvironment", max_turns: 2}
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from hpcrl.environments import Calculator, Environment, ToolError, Turn

ALPHABET = "0123456789+="


def write_prompts(path: Path, n: int, digits: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = (rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits) for _ in range(2))
        rows.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(path)
    return Path(path)


def score(prompt: str, response: str, answer: str = "", **_) -> float:
    response = response.removeprefix("=")
    return sum(a == b for a, b in zip(response, answer)) / len(answer)


class SumsEnvironment(Environment):
    """The calculator, called by every turn that does not start with "="."""

    def __init__(self, call_reward: float = 0.5):
        self.call_reward = call_reward

    async def start(self, row: dict) -> None:
        self.question = str(row["prompt"]).rstrip("=")

    async def step(self, text: str) -> Turn:
        if text.startswith("="):
            return Turn(done=True)
        expression = text.split("=")[0]
        try:
            result, failed = Calculator().evaluate(expression), 0
        except ToolError:
            result, failed = "", 1
        repeated = sum(a == b for a, b in zip(expression, self.question)) / len(self.question)
        return Turn(f"{result}=", reward=self.call_reward * repeated, info={"tool_calls": 1, "tool_errors": failed})
