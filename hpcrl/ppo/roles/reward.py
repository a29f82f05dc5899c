"""Reward roles: a Python rule named by import path, or a sequence-scoring model."""
from __future__ import annotations

import importlib

import torch

from hpcrl.algo import last_token_index
from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.controller.batch import Batch
from hpcrl.models import CharTokenizer


def import_function(path: str):
    """"package.module:function" -> the function, or a ValueError that says what is wrong."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"reward function {path!r}: write it as 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {path!r} cannot be imported: {e}") from None


class RuleReward(Checkpointed, Worker):
    """score = fn(prompt_text, response_text, **the sample's other dataset fields)."""
    frozen = True   # no state: its file only records that the role took part

    def __init__(self, model_dir: str, reward_fn: str):
        self.fn = import_function(reward_fn)
        self.tok = CharTokenizer.load(model_dir)

    @register(Dispatch.DP_COMPUTE)
    def compute_scores(self, batch: Batch) -> Batch:
        extra = [k for k in batch.arrays if k not in ("prompt", "index")]
        scores = []
        for i in range(len(batch)):
            prompt = batch["prompt"][i] if "prompt" in batch else self.tok.decode(batch["prompt_ids"][i])
            response = self.tok.decode(batch["responses"][i])
            scores.append(float(self.fn(prompt, response, **{k: batch[k][i] for k in extra})))
        return Batch({"scores": torch.tensor(scores, dtype=torch.float32)})


class RewardModel(Checkpointed, Worker):
    """A Hugging Face sequence-classification model (one label): its score at the last real token."""
    frozen = True

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
