"""Prompts from a JSONL file with a deterministic, resumable cursor."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hpcrl.controller.batch import Batch


class PromptDataset:
    """Each line {"prompt": text} or {"prompt_ids": [...]}; other fields travel with the sample to the
    reward function. Epoch e visits the prompts in the order permutation(seed, e); the cursor
    (epoch, offset) is all that is needed to continue exactly."""

    def __init__(self, path: Path, tokenizer, batch_size: int, seed: int):
        self.rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not self.rows:
            raise ValueError(f"{path}: no prompts")
        for i, r in enumerate(self.rows):
            if "prompt_ids" not in r and "prompt" not in r:
                raise ValueError(f"{path}:{i + 1}: a line needs 'prompt' (text) or 'prompt_ids'")
        self.tokenizer, self.batch_size, self.seed = tokenizer, batch_size, seed
        self.epoch, self.offset = 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def next_batch(self) -> Batch:
        picked = []
        while len(picked) < self.batch_size:
            order = self._order()
            take = order[self.offset:self.offset + self.batch_size - len(picked)]
            picked += take.tolist()
            self.offset += len(take)
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        rows = [self.rows[i] for i in picked]
        ids = [r["prompt_ids"] if "prompt_ids" in r else self.tokenizer.encode(r["prompt"]) for r in rows]
        width = max(map(len, ids))
        prompt_ids = torch.full((len(ids), width), self.tokenizer.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, seq in enumerate(ids):   # left padding: every prompt ends where the response starts
            prompt_ids[i, width - len(seq):] = torch.tensor(seq)
            prompt_mask[i, width - len(seq):] = 1
        extra = sorted({k for r in rows for k in r} - {"prompt", "prompt_ids"})
        arrays = {"index": np.array(picked), "prompt": np.array([r["prompt"] if "prompt" in r else self.tokenizer.decode(seq)
                                                    for r, seq in zip(rows, ids)], dtype=object),
                  **{k: np.array([r.get(k) for r in rows], dtype=object) for k in extra}}
        return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}, arrays)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
