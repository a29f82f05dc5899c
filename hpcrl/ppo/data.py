"""Prompts from JSONL or Parquet (verl's format, read as it is), with a deterministic, resumable cursor.

A row is one of
    {"prompt": "text"}                                         encoded as it is
    {"prompt": [{"role": "user", "content": "..."}, ...]}      chat messages: the tokenizer's chat
                                                               template, with the generation prompt
    {"prompt_ids": [1, 2, 3]}                                  token ids
and every other field travels with the sample to the reward function. verl's columns are read
as verl writes them: `data_source`, `prompt` (messages), `ability`, `reward_model` ({style,
ground_truth}) and `extra_info`; the reward also gets `ground_truth` as a field of its own.

Prompts longer than `max_prompt_length` tokens are left out, counted and said once; a prompt is
never cut, since a cut question is a different question.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch

from hpcrl.controller.batch import Batch, object_array
from hpcrl.environments.tool_calls import with_tool_prompt

PARQUET = (".parquet", ".pq")


def read_rows(path: str | Path) -> list[dict]:
    """Every row of a JSONL or Parquet file, as dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such dataset file")
    if path.suffix in PARQUET:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    for k, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{k + 1}: not a JSON object ({e})") from None
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Rows to JSONL or Parquet (by the suffix), written under a temporary name and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix in PARQUET:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def prompt_ids(row: dict, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """The row's prompt as token ids; chat messages with `tools` (JSON schemas: the environment's)
    rendered by the chat template, or described in the system message where it does not render them."""
    if "prompt_ids" in row:
        return [int(i) for i in row["prompt_ids"]]
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if tools and not tokenizer.renders_tools:
        return tokenizer.encode_chat(with_tool_prompt(list(prompt), tools))
    return tokenizer.encode_chat(list(prompt), tools or None)


def reward_fields(row: dict) -> dict:
    """What the reward function gets of a row besides the prompt: every field, and verl's
    reward_model.ground_truth as `ground_truth`."""
    fields = {k: v for k, v in row.items() if k not in ("prompt", "prompt_ids")}
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model and "ground_truth" not in fields:
        fields["ground_truth"] = reward_model["ground_truth"]
    return fields


class PromptDataset:
    """Epoch e visits the kept prompts in the order permutation(seed, e); the cursor (epoch,
    offset) is all that is needed to continue exactly. `in_order` walks them once, unshuffled
    (validation)."""

    def __init__(self, path: Path, tokenizer, batch_size: int, seed: int, max_prompt_length: int = 0,
                 tools: list[dict] | None = None):
        rows = read_rows(path)
        if not rows:
            raise ValueError(f"{path}: no prompts")
        ids = []
        for i, r in enumerate(rows):
            if "prompt_ids" not in r and "prompt" not in r:
                raise ValueError(f"{path}: row {i + 1} needs 'prompt' (text or chat messages) or 'prompt_ids' "
                                 f"(it has: {', '.join(r) or 'nothing'})")
            try:
                ids.append(prompt_ids(r, tokenizer, tools))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}: row {i + 1}: {e}") from None
        keep = [i for i, seq in enumerate(ids) if not max_prompt_length or len(seq) <= max_prompt_length]
        self.too_long = len(rows) - len(keep)
        if not keep:
            raise ValueError(f"{path}: every one of its {len(rows)} prompts is longer than max_prompt_length "
                             f"{max_prompt_length} tokens (the longest has {max(map(len, ids))})")
        self.rows, self.ids, self.index = [rows[i] for i in keep], [ids[i] for i in keep], keep
        self.tokenizer, self.batch_size, self.seed = tokenizer, batch_size, seed
        self.epoch, self.offset = 0, 0

    def __len__(self) -> int:
        return len(self.rows)

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
        return self.batch(picked)

    def in_order(self, size: int, fill: bool = False):
        """Every kept prompt once, in file order, `size` at a time. fill: the last piece filled up to
        `size` rows with its own prompts again (an engine that captured a graph for `size` rows
        replays it); the rows past len(self) - start are the repeats."""
        for start in range(0, len(self.rows), size):
            picked = list(range(start, min(start + size, len(self.rows))))
            yield self.batch(list(itertools.islice(itertools.cycle(picked), size)) if fill else picked)

    def batch(self, picked: list[int]) -> Batch:
        """Left-padded prompt ids (every prompt ends where the response starts) and the rows' fields."""
        ids = [self.ids[i] for i in picked]
        rows = [self.rows[i] for i in picked]
        fields = [reward_fields(r) for r in rows]
        names = sorted({k for f in fields for k in f})
        arrays = {"index": np.array([self.index[i] for i in picked]),
                  "prompt": object_array([r["prompt"] if "prompt" in r else self.tokenizer.decode(seq)
                                      for r, seq in zip(rows, ids)]),
                  **{k: object_array([f.get(k) for f in fields]) for k in names}}
        return left_padded(ids, self.tokenizer.pad_id).union(Batch(arrays=arrays))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def left_padded(ids: list[list[int]], pad_id: int, meta: dict | None = None) -> Batch:
    """Token id sequences as prompt_ids/prompt_mask, left-padded: every one ends where the next token goes."""
    width = max(map(len, ids))
    prompt = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for k, seq in enumerate(ids):
        prompt[k, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[k, width - len(seq):] = 1
    return Batch({"prompt_ids": prompt, "prompt_mask": mask}, meta=meta)
