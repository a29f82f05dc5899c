"""Agents: the `env` role of a run with train.environment.agent, where your own agent runs.

The agent is an async function written against the `openai` package alone:

    async def agent(row: dict, client: openai.AsyncOpenAI) -> float | dict:
        ...   # any number of client.chat.completions.create / client.completions.create calls
        return reward          # or {"reward": reward, "info": {"tool_calls": 2, ...}}

Each rank runs its share of a batch's episodes at once on one event loop, each with a client of
its own pointed at a generating rank's endpoint with the episode's key (hpcrl/serving), and cuts
each at `time_limit` seconds. A call made again after this rank was rebuilt runs its agents afresh,
and the endpoint drops what the lost run had asked (each call is an attempt of its own). An agent
that raises, returns no reward, or runs out of time fails its episode (named in the log, scored
train.environment.failed_score, its requests not trained on).
"""
from __future__ import annotations

import asyncio
import inspect
import math
import time
import uuid

import torch

from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.controller.batch import Batch, object_array
from hpcrl.importing import import_object
from hpcrl.serving.server import ATTEMPT_HEADER

_NOT_ROW = ("prompt_ids", "prompt_mask", "episode", "episode_key", "endpoint")


def agent_result(result) -> tuple[float, dict]:
    """(reward, info) of what an agent returned: a number, or {"reward": number, "info": {name: number}}."""
    if isinstance(result, dict):
        if "reward" not in result:
            raise TypeError(f"it returned a dict without 'reward' (keys {sorted(result)})")
        reward, info = result["reward"], result.get("info") or {}
        if not isinstance(info, dict):
            raise TypeError(f"its info is {type(info).__name__}, not a dict of numbers")
    else:
        reward, info = result, {}
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(f"its reward is {reward!r}, not a finite number")
    return float(reward), {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Agents(Checkpointed, Worker):
    """Runs `agent` (module:function) per episode; `time_limit`: seconds per episode."""
    frozen = True    # no trained state
    elastic = True   # any number of ranks between steps
    uses_gpus = False

    def __init__(self, agent: str, time_limit: float):
        try:
            self.agent = import_object(agent)
        except ValueError as e:
            raise ValueError(f"train.environment.agent: {e}") from None
        if not inspect.iscoroutinefunction(self.agent):
            raise ValueError(f"train.environment.agent: {agent} is not an async function (write `async def "
                             f"{agent.rsplit(':', 1)[1]}(row, client)`)")
        try:
            import openai
        except ImportError:
            raise ValueError("train.environment.agent: the agents' client is the `openai` package, which does not import "
                             "in the env role's Python; pip install 'hpcrl[agents]' (or openai) there") from None
        self.openai, self.time_limit = openai, time_limit
        self.loop = asyncio.new_event_loop()   # one loop for the process: agents may keep loop-bound resources
        # the connections of every episode's client: a client of its own (its TLS context) takes 34 ms to make
        self.http = self.loop.run_until_complete(_http_client(openai))

    @register(Dispatch.DP_COMPUTE)
    def run_agents(self, batch: Batch) -> Batch:
        """Every episode of the batch (its dataset row's fields, `episode` its name, `episode_key`,
        `endpoint` the base URL it talks to) at once. Returns agent_reward, info and failure ("" or why)."""
        rows = [{k: batch[k][i] for k in batch.arrays if k not in _NOT_ROW} for i in range(len(batch))]

        async def every():
            return await asyncio.gather(*(self._episode(name, row, key, url, attempt) for name, row, key, url in
                                          zip(batch["episode"], rows, batch["episode_key"], batch["endpoint"])))
        attempt = uuid.uuid4().hex
        t0 = time.perf_counter()
        results = self.loop.run_until_complete(every())
        return Batch({"agent_reward": torch.tensor([r for r, _, _ in results], dtype=torch.float32)},
                     arrays={"info": object_array([i for _, i, _ in results]),
                             "failure": object_array([f for _, _, f in results])},
                     meta={"agent_seconds": time.perf_counter() - t0})

    async def _episode(self, name: str, row: dict, key: str, url: str, attempt: str) -> tuple[float, dict, str]:
        client = self.openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=self.time_limit,
                                         http_client=self.http, default_headers={ATTEMPT_HEADER: attempt})
        try:
            result = await asyncio.wait_for(self.agent(row, client), self.time_limit)
            reward, info = agent_result(result)
            return reward, info, ""
        except (asyncio.TimeoutError, TimeoutError):
            why = f"did not finish within train.environment.agent_time_limit ({self.time_limit:g} s)"
        except Exception as e:   # noqa: BLE001 - the user's agent: anything may fail
            why = f"raised {type(e).__name__}: {e}"
        message = f"{name}: the agent {why}"
        print(message, flush=True)     # the env role's log (hpcrl logs RUN_DIR env)
        return 0.0, {}, message


async def _http_client(openai):
    """openai's own HTTP client, made on the loop the agents run on."""
    return openai.DefaultAsyncHttpxClient()
