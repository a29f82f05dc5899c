"""Reward roles: a Python rule named by import path, or a sequence-scoring model."""
from __future__ import annotations

import asyncio
import inspect

import torch

from hpcrl.algo import last_token_index
from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.controller.batch import Batch
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.importing import import_object


def response_texts(batch: Batch, tok) -> list[str]:
    """Each sample's response as text: a multi-turn episode's last turn, its answer (`final_turn`)."""
    starts = batch["final_turn"].tolist() if "final_turn" in batch else [0] * len(batch)
    return [tok.decode(r[s:]) for r, s in zip(batch["responses"], starts)]


class RewardError(RuntimeError):
    """The reward function raised on a sample (or gave no usable score): the step fails, naming it."""


class RuleReward(Checkpointed, Worker):
    """score = fn(prompt, response_text, **the sample's other dataset fields), one sample at a time;
    with `batched`, scores = fn(prompts, responses, **each field as a list), one call per batch.
    `prompt` is the dataset's prompt as written (text, or chat messages).

    With a judge (train.judge.enabled; `judge_key` its endpoint's key, hpcrl/ppo/roles/judge.py) fn
    is async and is awaited with `judge=` an openai.AsyncOpenAI of one of the judge's ranks (sample i
    the rank i mod their number): the batch's calls run at once, on one event loop, so the judge
    samples their requests together."""
    frozen = True   # no state: its file only records that the role took part
    elastic = True  # any number of ranks score alike (hpcrl scale)
    uses_gpus = False   # a rule: on a GPU node it runs beside the GPU roles, holding no GPU

    def __init__(self, model_dir: str, reward_fn: str, batched: bool = False, judge_key: str = ""):
        try:
            self.fn = import_object(reward_fn)
        except ValueError as e:
            raise ValueError(f"train.reward.fn: {e}") from None
        self.path, self.batched, self.judge_key = reward_fn, batched, judge_key
        self.tok = load_tokenizer(model_dir)
        if inspect.iscoroutinefunction(self.fn) and not judge_key:
            raise ValueError(f"train.reward.fn: {reward_fn} is an async function, which the reward role awaits only "
                             "with a judge; set train.judge.enabled: true (and place roles.judge), or make it a plain def")
        if judge_key:
            if not inspect.iscoroutinefunction(self.fn):
                raise ValueError(f"train.reward.fn: {reward_fn} is not an async function, but train.judge.enabled gives "
                                 "it a judge to await; write `async def score(prompt, response, judge, **fields)`")
            try:
                import openai
            except ImportError:
                raise ValueError("train.judge.enabled: the reward function's judge client is the `openai` package, "
                                 "which does not import in the reward role's Python; pip install 'hpcrl[agents]' "
                                 "(or openai) there") from None
            self.openai, self.judges = openai, {}      # judges: URL -> its client, made once
            self.loop = asyncio.new_event_loop()    # one loop for the process: the clients' connections are bound to it

    @register(Dispatch.DP_COMPUTE)
    def compute_scores(self, batch: Batch) -> Batch:
        names = [k for k in batch.arrays if k not in ("prompt", "index")]
        prompts = [batch["prompt"][i] if "prompt" in batch else self.tok.decode(batch["prompt_ids"][i])
                   for i in range(len(batch))]
        responses = response_texts(batch, self.tok)
        fields = {k: list(batch[k]) for k in names}
        calls = [((prompts, responses), fields)] if self.batched else \
            [((prompts[i], responses[i]), {k: v[i] for k, v in fields.items()}) for i in range(len(batch))]
        results = self._awaited(calls) if self.judge_key else self._called(calls)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                raise RewardError(self._failure(batch, None if self.batched else i, result))
        try:
            scores = list(results[0]) if self.batched else results
        except TypeError as e:      # a batched fn's result that is not a sequence
            raise RewardError(self._failure(batch, None, e)) from None
        if self.batched and len(scores) != len(batch):
            raise RewardError(f"reward function {self.path} (batched) gave {len(scores)} scores for "
                              f"{len(batch)} samples")
        out = torch.tensor([float(s) for s in scores], dtype=torch.float32)
        bad = torch.nonzero(~torch.isfinite(out)).flatten().tolist()
        if bad:
            raise RewardError(f"reward function {self.path} gave {out[bad[0]].item()} for {self._sample(batch, bad[0])}; "
                              "a score must be a finite number")
        return Batch({"scores": out})

    def _called(self, calls: list[tuple[tuple, dict]]) -> list:
        """fn's result of each call, up to the first that raised (its exception, last)."""
        results = []
        for args, kwargs in calls:
            try:
                results.append(self.fn(*args, **kwargs))
            except Exception as e:   # noqa: BLE001 - the user's code: anything may come
                results.append(e)
                break
        return results

    def _awaited(self, calls: list[tuple[tuple, dict]]) -> list:
        """fn's result (or exception) of each call, awaited all at once, each with a judge client."""
        from hpcrl.ppo.roles.judge import judge_urls

        urls = judge_urls()
        if not urls:
            raise RewardError("train.judge.enabled, but no rank of the judge role has published its endpoint (is "
                              "roles.judge placed, and did its ranks start? hpcrl logs RUN_DIR judge)")
        for url in urls:
            if url not in self.judges:
                self.judges[url] = self.openai.AsyncOpenAI(base_url=url, api_key=self.judge_key)

        async def every():
            return await asyncio.gather(*(self.fn(*args, judge=self.judges[urls[i % len(urls)]], **kwargs)
                                          for i, (args, kwargs) in enumerate(calls)), return_exceptions=True)
        return self.loop.run_until_complete(every())

    def _sample(self, batch: Batch, i: int) -> str:
        where = [f"sample {i} of the batch"]
        if "index" in batch:
            where.append(f"dataset row {batch['index'][i]}")
        if "data_source" in batch:
            where.append(f"data_source {batch['data_source'][i]}")
        return ", ".join(where)

    def _failure(self, batch: Batch, i: int | None, e: Exception) -> str:
        """The scorer's traceback, then (as the last line, which status.json shows) what failed; also
        written to this role's log (hpcrl logs RUN_DIR reward)."""
        import sys
        import traceback

        where = self._sample(batch, i) if i is not None else f"a batch of {len(batch)} samples"
        message = (f"{''.join(traceback.format_exception(e)).rstrip()}\n"
                   f"reward function {self.path} raised on {where}: {type(e).__name__}: {e}")
        print(message, file=sys.stderr, flush=True)
        return message


class RewardModel(Checkpointed, Worker):
    """A Hugging Face sequence-classification model (one label): its score at the last real token."""
    frozen = elastic = True

    def __init__(self, model_dir: str):
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).eval()

    @register(Dispatch.DP_COMPUTE)
    def compute_scores(self, batch: Batch) -> Batch:
        from hpcrl.models import position_ids

        mask = batch["attention_mask"]
        with torch.no_grad():
            hidden = self.model.base_model(input_ids=batch["input_ids"], attention_mask=mask,
                                           position_ids=position_ids(mask)).last_hidden_state
            logits = self.model.score(hidden)[..., 0].float()
        return Batch({"scores": logits[torch.arange(len(batch)), last_token_index(mask)]})

    def checkpoint_state(self) -> dict:
        return {"model": self.model.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
