"""Environments: the `env` role, where the episodes of multi-turn rollouts live (hpcrl/environments).

Each rank holds the episodes of its share of the batch, one environment instance each, and runs
all of them on one event loop: a turn of every episode is one `step_episodes` call per rank, the
environments' awaits (subprocesses, sandboxes, servers) overlapping. The driver sends every
episode of the batch at every turn (those already over have no action), so a DP_COMPUTE share is
the same episodes from the first turn to the last. A rank that is rebuilt meanwhile has lost its
episodes: it answers each of them as failed, by name, and the step goes on.
"""
from __future__ import annotations

import asyncio
import time

import torch

from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.controller.batch import Batch, object_array
from hpcrl.environments.base import Turn
from hpcrl.importing import import_object

_ROW_FIELDS = ("prompt_ids", "prompt_mask", "episode", "action")


class Environments(Checkpointed, Worker):
    """Episodes of `cls(**kwargs)` on this rank; `timeout`: seconds for an environment's start or step."""
    frozen = True    # no trained state; an episode's state does not outlive its step
    elastic = True   # any number of ranks (hpcrl scale env=N) between steps
    uses_gpus = False   # beside the rollout on a GPU node too, without taking a GPU

    def __init__(self, cls: str, kwargs: dict, timeout: float):
        try:
            self.cls = import_object(cls)
        except ValueError as e:
            raise ValueError(f"train.environment.cls: {e}") from None
        self.kwargs, self.timeout = dict(kwargs), timeout
        try:        # one now, so that a wrong argument or a missing sandbox stops the role's start, not each episode
            self.cls(**self.kwargs)
        except Exception as e:   # noqa: BLE001 - the user's environment: anything may fail
            raise ValueError(f"train.environment: {cls}(**kwargs) raised {type(e).__name__}: {e}") from None
        self.loop = asyncio.new_event_loop()   # one loop for the process: environments may keep loop-bound resources
        self.episodes: dict[str, object] = {}

    @register(Dispatch.DP_COMPUTE)
    def start_episodes(self, batch: Batch) -> Batch:
        """A new episode per sample (batch["episode"] names it), from the sample's dataset row.
        Returns `failure` ("" or why the episode could not start) and env_seconds."""
        rows = [{k: batch[k][i] for k in batch.arrays if k not in _ROW_FIELDS} for i in range(len(batch))]
        names = list(batch["episode"])

        async def start(name: str, row: dict) -> str:
            try:
                env = self.cls(**self.kwargs)
                await asyncio.wait_for(env.start(row), self.timeout)
            except Exception as e:   # noqa: BLE001 - the user's environment: anything may fail
                return self._failed(name, "start", e)
            self.episodes[name] = env
            return ""
        return self._run([start(n, r) for n, r in zip(names, rows)], len(batch))

    @register(Dispatch.DP_COMPUTE)
    def step_episodes(self, batch: Batch) -> Batch:
        """Each episode's answer to batch["action"] (the model's turn; None: the episode is over and
        is closed here). Returns observation, reward, done, info, failure and env_seconds."""
        async def step(name: str, action: str | None):
            env = self.episodes.get(name)
            if action is None:
                if env is not None:
                    await self._close(name)
                return None
            if env is None:
                return f"{name}: its environment was lost (the env rank that held it was rebuilt)"
            try:
                turn = await asyncio.wait_for(env.step(action), self.timeout)
                if not isinstance(turn, Turn):
                    raise TypeError(f"step returned {type(turn).__name__}, not hpcrl.environments.Turn")
            except Exception as e:   # noqa: BLE001
                await self._close(name)
                return self._failed(name, "step", e)
            if turn.done:
                await self._close(name)
            return turn
        return self._run([step(n, a) for n, a in zip(batch["episode"], batch["action"])], len(batch))

    def _run(self, coroutines: list, n: int) -> Batch:
        t0 = time.perf_counter()
        async def every():
            return await asyncio.gather(*coroutines)
        results = self.loop.run_until_complete(every())
        turns = [r if isinstance(r, Turn) else Turn(done=True) for r in results]
        failures = [r if isinstance(r, str) else "" for r in results]
        return Batch({"env_reward": torch.tensor([t.reward for t in turns], dtype=torch.float32),
                      "env_done": torch.tensor([t.done for t in turns], dtype=torch.bool),
                      "env_seconds": torch.full((n,), (time.perf_counter() - t0) / max(n, 1))},
                     {"observation": object_array([t.observation for t in turns]), "info": object_array([t.info for t in turns]),
                      "failure": object_array(failures)})

    async def _close(self, name: str) -> None:
        env = self.episodes.pop(name, None)
        if env is not None:
            try:
                await asyncio.wait_for(env.close(), self.timeout)
            except Exception as e:   # noqa: BLE001 - said, never fatal: the episode is over
                print(f"{name}: its environment's close raised {type(e).__name__}: {e}", flush=True)

    def _failed(self, name: str, what: str, e: Exception) -> str:
        why = f"timed out after {self.timeout:g} s" if isinstance(e, (asyncio.TimeoutError, TimeoutError)) \
            else f"raised {type(e).__name__}: {e}"
        message = f"{name}: the environment's {what} {why}"
        print(message, flush=True)     # the env role's log (hpcrl logs RUN_DIR env)
        return message

