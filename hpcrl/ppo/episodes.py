"""Multi-turn rollouts: the generating role and the `env` role take turns on every episode of a batch.

    env.start_episodes(rows)                                    one environment per sample
    repeat up to environment.max_turns:
        generating role: generate_sequences(each open episode's context so far)   one turn each
        env role: step_episodes(each turn's text) -> observation, reward, done
        context += the turn's tokens, as sampled (never re-encoded), then the observation's tokens
                   as the chat template renders them after the turn's stop token (encode_followup)

An episode ends when its environment says so, at its turn limit, when its next turn or observation
would not fit its token budget (environment.max_tokens), or when its environment fails (then it is
named in the log and scored environment.failed_score). A turn cut at rollout.max_new_tokens still
goes to the environment, and the stop token it lacks is put after it, as part of the observation
(the model is not trained on it): the template renders every turn with one.
The result is one Batch laid out as a single-turn one — [left-padded prompt | response] — whose
response holds every turn and observation: `response_mask` marks the model's tokens only (the loss,
KL and advantages see nothing else), the attention mask every token, `turn_rewards` each turn's
reward on the turn's last token, `final_turn` where the last turn starts (the reward role scores
that text). Each turn is a generate_sequences call on the whole context: vLLM's prefix cache keeps
what it already encoded, the torch engines encode the context again (one prefill per turn).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch, object_array
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import left_padded


class Episodes:
    """generate(prompts) for a run with train.environment: `generator` (actor_rollout or rollout)
    writes the turns, `env` (the env role) answers them; `said(message)` hears each failed episode."""

    def __init__(self, cfg: TrainConfig, generator: WorkerGroup, env: WorkerGroup, tokenizer, said=print):
        self.generator, self.env, self.tok, self.said = generator, env, tokenizer, said
        self.max_turns, self.budget = cfg.environment.max_turns, cfg.environment.tokens(cfg.rollout.max_new_tokens)

    def generate(self, prompts: Batch) -> Batch:
        n, step = len(prompts), prompts.meta.get("step", 0)
        kind = "validation " if prompts.meta.get("validation") else ""
        rows = prompts["index"] if "index" in prompts else range(n)
        names = object_array([f"{kind}step {step} sample {i} (dataset row {r})" for i, r in enumerate(rows)])
        prompt = [ids[mask.bool()].tolist() for ids, mask in zip(prompts["prompt_ids"], prompts["prompt_mask"])]
        ep = [Episode() for _ in range(n)]
        env_s = 0.0
        t0 = time.perf_counter()
        started = self.env.start_episodes(Batch(arrays={**{k: v for k, v in prompts.arrays.items()}, "episode": names}))
        env_s += time.perf_counter() - t0
        for i, why in enumerate(started["failure"]):
            if why:
                ep[i].fail(why)
        meta = dict(prompts.meta)
        for turn in range(self.max_turns):
            open_ = [i for i in range(n) if not ep[i].done]
            if not open_:
                break
            # as many rows as the generating role has ranks at least: a rank with none would sample nothing
            contexts, padding = left_padded([prompt[i] + ep[i].tokens for i in open_], self.tok.pad_id,
                                             {**prompts.meta, "turn": turn}).pad_to_multiple(self.generator.world_size)
            out = self.generator.generate_sequences(contexts).index(slice(0, padding.size))
            meta["policy_version"] = out.meta.get("policy_version", 0)
            actions = [None] * n
            for j, i in enumerate(open_):
                text = ep[i].add_turn(out["responses"][j], out["response_mask"][j], out["rollout_log_probs"][j],
                                      bool(out["has_eos"][j]), self.budget, self.tok)
                if not ep[i].done and turn + 1 < self.max_turns:
                    actions[i] = text
                else:
                    ep[i].done = True
            t0 = time.perf_counter()
            answers = self.env.step_episodes(Batch(arrays={"episode": names, "action": object_array(actions)}))
            env_s += time.perf_counter() - t0
            for i in (i for i in range(n) if actions[i] is not None):
                ep[i].answer(answers, i, self.budget, self.tok)
        t0 = time.perf_counter()
        self.env.step_episodes(Batch(arrays={"episode": names, "action": object_array([None] * n)}))   # closes the rest
        env_s += time.perf_counter() - t0
        for e in ep:
            if e.failure:
                self.said(e.failure)
        meta["environment_seconds"] = env_s
        return prompts.union(assemble(ep, prompts, self.budget, self.tok.pad_id, meta))


class Episode:
    """One episode's response so far: tokens, which are the model's, the sampler's log-probs, rewards."""

    def __init__(self):
        self.tokens: list[int] = []
        self.model: list[int] = []           # 1: the model's token, 0: an observation's
        self.logp: list[float] = []
        self.rewards: dict[int, float] = {}   # position -> reward of the turn ending there
        self.info: dict[str, float] = defaultdict(float)
        self.final, self.turns, self.eos, self.done, self.failure = 0, 0, False, False, ""

    def fail(self, why: str) -> None:
        self.failure, self.done = why, True

    def add_turn(self, tokens, mask, logp, eos: bool, budget: int, tok) -> str:
        """The turn's sampled tokens, cut to the budget (which ends the episode); returns its text."""
        length = int(mask.sum())
        take = min(length, budget - len(self.tokens))
        self.final, self.turns = len(self.tokens), self.turns + 1
        self.tokens += tokens[:take].tolist()
        self.model += [1] * take
        self.logp += logp[:take].tolist()
        self.eos = eos and take == length
        self.done = take < length or len(self.tokens) >= budget
        return tok.decode(tokens[:take].tolist())

    def answer(self, answers: Batch, i: int, budget: int, tok) -> None:
        """The environment's answer to the last turn: its reward on the turn's last token, then the
        observation, unless the episode is over or it would leave no room for another turn."""
        if answers["failure"][i]:
            self.fail(answers["failure"][i])
            return
        self.rewards[len(self.tokens) - 1] = self.rewards.get(len(self.tokens) - 1, 0.0) + float(answers["env_reward"][i])
        for k, v in (answers["info"][i] or {}).items():
            if isinstance(v, (int, float)):
                self.info[k] += v
        if bool(answers["env_done"][i]):
            self.done = True
            return
        seen = ([] if self.eos else tok.stop_ids[:1]) + tok.encode_followup(answers["observation"][i])
        if len(self.tokens) + len(seen) >= budget:
            self.done = True
            return
        self.tokens += seen
        self.model += [0] * len(seen)
        self.logp += [0.0] * len(seen)


def assemble(ep: list[Episode], prompts: Batch, width: int, pad_id: int, meta: dict) -> Batch:
    """The episodes as one batch of [prompt | response] rows, `width` response tokens each."""
    n = len(ep)
    responses = torch.full((n, width), pad_id, dtype=torch.long)
    model, seen = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    logp, rewards = torch.zeros((n, width)), torch.zeros((n, width))
    for i, e in enumerate(ep):
        k = len(e.tokens)
        responses[i, :k] = torch.tensor(e.tokens, dtype=torch.long)
        model[i, :k], seen[i, :k] = torch.tensor(e.model), 1
        logp[i, :k] = torch.tensor(e.logp)
        for pos, r in e.rewards.items():
            rewards[i, pos] = r
    keys = sorted({k for e in ep for k in e.info})
    tensors = {"responses": responses, "response_mask": model, "rollout_log_probs": logp, "turn_rewards": rewards,
               "has_eos": torch.tensor([e.eos for e in ep]), "final_turn": torch.tensor([e.final for e in ep]),
               "input_ids": torch.cat([prompts["prompt_ids"], responses], dim=1),
               "attention_mask": torch.cat([prompts["prompt_mask"], seen], dim=1),
               "env/turns": torch.tensor([float(e.turns) for e in ep]),
               "env/reward": torch.tensor([sum(e.rewards.values()) for e in ep], dtype=torch.float32),
               "env/failed": torch.tensor([bool(e.failure) for e in ep]),
               **{f"env/{k}": torch.tensor([float(e.info.get(k, 0.0)) for e in ep]) for k in keys}}
    return Batch(tensors, meta=meta)


def episode_scores(batch: Batch, failed_score: float) -> torch.Tensor:
    """The batch's scores (an agent's episodes: the agents' rewards) with every failed episode's
    replaced by `failed_score` (a single-turn batch: as they are)."""
    scores = batch["agent_reward"] if "agent_reward" in batch else batch["scores"]
    if "env/failed" not in batch:
        return scores
    return torch.where(batch["env/failed"], torch.full_like(scores, failed_score), scores)


def turn_rewards(batch: Batch) -> torch.Tensor | None:
    """The environment's per-turn rewards (B, R), none for a failed episode; None for a single-turn batch."""
    if "turn_rewards" not in batch:
        return None
    return batch["turn_rewards"] * (~batch["env/failed"])[:, None].float()

