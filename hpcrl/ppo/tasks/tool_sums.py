"""Sums with a calculator: the prompt "37+45=" is answered "82", by a model too small to add, through
a calculator it calls.

A turn that starts with "=" calls the calculator on the question (what follows the "=" is not
read), which answers "82="; the call earns `call_reward`, a per-turn reward. Any other turn is the
answer, scored by the share of the sum's digits it gives in place, as the copy task scores
(hpcrl/ppo/tasks/copy_digits.py). Without the calculator the model cannot work the sum out: the
same task answered at once (no environment) stays near the score of guessing the leading digit.
With it, the answer is the calculator's digits repeated, which a small model learns as it learns
the copy task. The call reward is what leads a randomly initialised model, which starts a turn with
"=" a few times in a hundred, to call at all: the answer alone would reward a call only once the
model also repeats the result.

    train:
      data: {task: tool_sums, task_digits: 2}
      environment: {cls: "hpcrl.ppo.tasks.tool_sums:SumsEnvironment", max_turns: 2}
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from hpcrl.environments import Calculator, Environment, Turn

ALPHABET = "0123456789+="


def write_prompts(path: Path, n: int, digits: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        # two numbers of `digits` digits whose sum, uniform, has as many: no leading digit a guess gets right often
        low = 10 ** (digits - 1) if digits > 1 else 0
        total = rng.randrange(2 * low, 10 ** digits)
        a = rng.randrange(low, total - low + 1)
        b = total - a
        rows.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(path)
    return Path(path)


def score(prompt: str, response: str, answer: str = "", **_) -> float:
    return sum(a == b for a, b in zip(response, answer)) / len(answer)


class SumsEnvironment(Environment):
    """The calculator, called by a turn that starts with "="."""

    def __init__(self, call_reward: float = 0.2):
        self.call_reward = call_reward

    async def start(self, row: dict) -> None:
        self.question = str(row["prompt"]).rstrip("=")

    async def step(self, text: str) -> Turn:
        if not text.startswith("="):
            return Turn(done=True, info={"tool_calls": 0})
        return Turn(f"{Calculator().evaluate(self.question)}=", reward=self.call_reward, info={"tool_calls": 1})
