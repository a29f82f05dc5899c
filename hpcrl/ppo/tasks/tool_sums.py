"""Sums with a calculator: the prompt "37+45=" is answered "82", by a model too small to add, through
a calculator it calls over two turns.

A turn that ends with "=" calls the calculator on what precedes it: "37+45=" is answered "82="
(an expression it cannot read: "="), and the model's next turn is its answer; a turn without "="
is the answer. score = share of the answer's digits given in place, as the copy task scores
(hpcrl/ppo/tasks/copy_digits.py). Without the environment the model must answer at once, from
the prompt alone: the same task, to compare against.

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
    return sum(a == b for a, b in zip(response, answer)) / len(answer)


class SumsEnvironment(Environment):
    """The calculator, called by a turn that ends with "="."""

    async def step(self, text: str) -> Turn:
        if not text.endswith("="):
            return Turn(done=True)
        try:
            result, failed = Calculator().evaluate(text[:-1]), 0
        except ToolError:
            result, failed = "", 1
        return Turn(f"{result}=", info={"tool_calls": 1, "tool_errors": failed})
