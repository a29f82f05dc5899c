"""Episodes of your own agent (train.environment.agent): the agents run in the env role and call
the generating role's OpenAI-compatible endpoint; what the endpoint sampled becomes the batch.

    generating role: open_episodes(secret, seeds)  -> each rank's endpoint URL
    env role:        run_agents(rows, episode keys, URLs) -> each agent's reward, info, failure
    generating role: close_episodes(names)          -> each episode's requests, as token ids
    here:            each episode's requests chained into one trajectory (`chain`)

A trajectory is laid out as a multi-turn episode of hpcrl/ppo/episodes.py: its first request's
prompt, then the model's tokens of every request (response_mask 1) with whatever the agent put
between them (tool results, user turns: response_mask 0, never trained on). Every request after
the first must continue the one before: its prompt is that request's prompt and completion, then
more (the endpoint builds such prompts from the token ids it served, never from text encoded
again: hpcrl/serving/conversation.py). An agent that forks (two requests on one history), or
rewrites its history (drops, edits or summarises turns), fails its episode, which is named in the
log: hpcrl trains one chain per episode. A trajectory longer than train.environment.max_tokens is
cut there. The agent's reward is the episode's score; a failed episode (an agent that raised,
timed out or forked) scores train.environment.failed_score and none of its tokens are trained on.
"""
from __future__ import annotations

import time

import torch

from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch, object_array
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import left_padded
from hpcrl.ppo.episodes import assemble, Episode
from hpcrl.ppo.roles.rollout import step_seed
from hpcrl.serving.keys import episode_key


class Forked(ValueError):
    """An episode's requests do not form one chain."""


def chain(requests: list[dict], budget: int) -> tuple[list[int], Episode]:
    """(the prompt, the episode) of one episode's requests in the order served (Served.as_dict):
    Forked where a request does not continue the one before it."""
    prompt = list(requests[0]["prompt_ids"])
    ep, context = Episode(), list(prompt)
    for k, r in enumerate(requests):
        if r["prompt_ids"][:len(context)] != context:
            raise Forked(f"its request {k + 1} of {len(requests)} does not continue request {k}'s conversation "
                         "(an agent that forks or rewrites its history): hpcrl trains one chain per episode")
        between, out = r["prompt_ids"][len(context):], list(r["output_ids"])
        ep.tokens += between
        ep.model += [0] * len(between)
        ep.logp += [0.0] * len(between)
        ep.final, ep.turns = len(ep.tokens), ep.turns + 1
        ep.tokens += out
        ep.model += [1] * len(out)
        ep.logp += list(r["logprobs"])
        ep.eos = bool(r["eos"])
        context = list(r["prompt_ids"]) + out
    if len(ep.tokens) > budget:
        ep.tokens, ep.model, ep.logp = ep.tokens[:budget], ep.model[:budget], ep.logp[:budget]
        ep.final, ep.eos = min(ep.final, budget), False
    return prompt, ep


class AgentEpisodes:
    """generate(prompts) for a run with train.environment.agent: `generator` (actor_rollout or
    rollout) serves the endpoint, `env` (the env role) runs the agents; `secret`: the run's
    endpoint secret (hpcrl/serving/keys.py); `said(message)` hears each failed episode."""

    def __init__(self, cfg: TrainConfig, generator: WorkerGroup, env: WorkerGroup, tokenizer, secret: bytes,
                 said=print):
        self.cfg, self.generator, self.env, self.tok, self.secret, self.said = cfg, generator, env, tokenizer, secret, said
        self.budget = cfg.environment.tokens(cfg.rollout.max_new_tokens)

    def generate(self, prompts: Batch) -> Batch:
        n, step = len(prompts), int(prompts.meta.get("step", 0))
        validation = bool(prompts.meta.get("validation"))
        kind = "validation " if validation else ""
        rows = prompts["index"] if "index" in prompts else range(n)
        names = [f"{kind}step {step} sample {i} (dataset row {r})" for i, r in enumerate(rows)]
        # each request's seed: its episode's (as a rank's in generate_sequences) + its place in the episode
        seeds = {name: step_seed(self.cfg.seed, step, i, validation, draw=int(prompts.meta.get("draw", 0)))
                 for i, name in enumerate(names)}
        urls = self.generator.open_episodes(self.secret, seeds, validation)
        t0 = time.perf_counter()
        try:
            ran = self.env.run_agents(Batch(arrays={**prompts.arrays, "episode": object_array(names),
                                                    "episode_key": object_array([episode_key(self.secret, m) for m in names]),
                                                    "endpoint": object_array([urls[i % len(urls)] for i in range(n)])}))
        finally:
            served = {}
            for records in self.generator.close_episodes(names):
                served.update(records)
        env_s = time.perf_counter() - t0
        episodes, firsts = [], []
        for i, name in enumerate(names):
            failure = ran["failure"][i] or ("" if name in served else f"{name}: the agent made no request")
            prompt, ep = [], Episode()
            if not failure:
                try:
                    prompt, ep = chain(served[name], self.budget)
                except Forked as e:
                    failure = f"{name}: {e}"
            if failure:
                ep = Episode()
                ep.fail(failure)
                self.said(failure)
            else:
                ep.info.update(ran["info"][i])
            episodes.append(ep)
            firsts.append(prompt or prompts["prompt_ids"][i][prompts["prompt_mask"][i].bool()].tolist())
        own = left_padded(firsts, self.tok.pad_id, {})     # the agents' own prompts, not the dataset's rendering
        prompts = Batch({**prompts.tensors, "prompt_ids": own["prompt_ids"], "prompt_mask": own["prompt_mask"]},
                        dict(prompts.arrays), dict(prompts.meta))
        versions = [r["policy_version"] for records in served.values() for r in records]
        meta = {**prompts.meta, "policy_version": min(versions) if versions else 0, "environment_seconds": env_s}
        out = prompts.union(assemble(episodes, prompts, self.budget, self.tok.pad_id, meta))
        out["agent_reward"] = out["env/reward"] = ran["agent_reward"]
        return out
