"""The tiny tool task (hpcrl/ppo/tasks/tool_sums.py) as an agent of your own, written against the
`openai` package alone (it imports nothing of hpcrl): jobs/tiny-cpu-agent.yaml trains it.

The model either answers at once, or starts its turn with "=" to call the calculator, which
answers "82="; the agent then asks for the answer. The reward: 0.2 for a call, plus the share of
the sum's digits the answer gives in place, as the built-in SumsEnvironment and task score it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:      # the client is given; the wheel imports this module without the agents extra
    import openai


def digits_right(answer: str, truth: str) -> float:
    return sum(a == b for a, b in zip(answer, truth)) / len(truth)


async def solve(row: dict, client: openai.AsyncOpenAI) -> dict:
    prompt = row["prompt"]                           # "37+45="
    first = await client.completions.create(model="policy", prompt=prompt, max_tokens=4)
    turn = first.choices[0].text
    if not turn.startswith("="):                     # answered without the calculator
        return {"reward": digits_right(turn, row["answer"]), "info": {"tool_calls": 0}}
    a, b = prompt.rstrip("=").split("+")
    result = f"{int(a) + int(b)}="                   # the calculator's answer, as the model reads it
    second = await client.completions.create(model="policy", prompt=prompt + turn + result, max_tokens=4)
    answer = second.choices[0].text
    return {"reward": 0.2 + digits_right(answer, row["answer"]), "info": {"tool_calls": 1}}


async def hangs(row: dict, client: openai.AsyncOpenAI) -> float:
    """An agent that never finishes (tests: it is cut at train.environment.agent_time_limit)."""
    import asyncio

    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=4)
    await asyncio.sleep(3600)
    return 1.0
