"""Reward functions that call an LLM judge (train.judge; docs: how-to/your-own-agent.md#an-llm-judge),
written against the `openai` package alone.

`agrees` is for the tiny copy task (jobs/tiny-cpu.yaml with train.judge.enabled): the judge (by
default the policy's initial model) continues the prompt greedily, and a response scores the
share of its characters the judge's answer has in the same place. `verdict` is the usual form for
a chat model: the judge is asked whether the response answers the prompt and says yes or no.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:      # the client is given; the wheel imports this module without the agents extra
    import openai


async def agrees(prompt: str, response: str, judge: openai.AsyncOpenAI, **fields) -> float:
    said = (await judge.completions.create(model="judge", prompt=prompt, max_tokens=max(1, len(response)))).choices[0].text
    return sum(a == b for a, b in zip(response, said)) / max(1, len(response))


async def verdict(prompt: str, response: str, judge: openai.AsyncOpenAI, **fields) -> float:
    question = f"Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply yes or no."
    reply = await judge.chat.completions.create(model="judge", messages=[{"role": "user", "content": question}],
                                                max_tokens=4)
    return float(reply.choices[0].message.content.strip().lower().startswith("yes"))
