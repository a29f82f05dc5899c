"""Responses generated a segment at a time (`train.rollout.partial_rollout: continue`): the rows
of the rollout's next call, and what each row's segments add up to.

A static-batch engine decodes every row of a call until the longest has stopped, so a batch of
long-tailed responses keeps it busy for the few longest ones. Cut into segments of
`segment_tokens`, a call ends after that many tokens; the rows that stopped leave, the others
come back in the next call (their prompt then is prompt + tokens so far) beside new rows, and
the engine always decodes a full batch. Between two calls the rollout loads whatever weights the
actor sent meanwhile, so a response's tokens may come from several policy versions: each token
keeps the version that sampled it and the log-probability the sampler gave it (the behaviour
policy of the importance correction: algorithm.tis_cap, mis_band).

Pure bookkeeping over lists of token ids: no Ray, no engine (hpcrl/ppo/generation.py drives it).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hpcrl.controller.batch import Batch, object_array
from hpcrl.ppo.data import left_padded


@dataclasses.dataclass
class Row:
    """One response in the making: its prompt's token ids and per-sample fields (group, reward
    fields, ...), the tokens sampled so far with their log-probs and policy versions."""
    prompt: list[int]
    fields: dict
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    eos: bool = False
    done: bool = False

    @property
    def first_version(self) -> int | None:
        """The policy version of its first token (None before any)."""
        return self.versions[0] if self.versions else None


def rows_of(batch: Batch) -> list[Row]:
    """The rows of a prompts batch (left-padded prompt_ids/prompt_mask and per-sample arrays), or of a
    batch `to_batch` made (its responses, log-probs, versions and `done` read back)."""
    fields = [k for k in batch.arrays]
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    rows = [Row(p, {k: batch.arrays[k][i] for k in fields}) for i, p in enumerate(prompts)]
    if "responses" in batch:
        for i, row in enumerate(rows):
            n = int(batch["response_mask"][i].sum())
            row.tokens = batch["responses"][i, :n].tolist()
            row.logps = batch["rollout_log_probs"][i, :n].tolist()
            row.versions = batch["token_versions"][i, :n].tolist()
            row.eos, row.done = bool(batch["has_eos"][i]), bool(batch["done"][i]) if "done" in batch else True
    return rows


def continuation(rows: list[Row], pad_id: int) -> Batch:
    """The next call's prompts: each row's prompt followed by its tokens so far, left-padded (every
    prompt ends where the next token goes). Token ids only: the rows' fields stay on the driver's side."""
    return left_padded([r.prompt + r.tokens for r in rows], pad_id)


def absorb(rows: list[Row], out: Batch, version: int, max_new_tokens: int) -> int:
    """Add a call's segment to each of its rows (in the order `continuation` gave them): its tokens
    up to the row's budget of max_new_tokens, each with `version`; a row is done at its stop token
    or at the budget. Returns the number of tokens added."""
    # as lists once: the driver's thread does this between two calls of the rollout, which waits meanwhile
    lengths, eos = out["response_mask"].sum(dim=1).tolist(), out["has_eos"].tolist()
    tokens, logps = out["responses"].tolist(), out["rollout_log_probs"].tolist()
    added = 0
    for i, row in enumerate(rows):
        n = min(lengths[i], max_new_tokens - len(row.tokens))
        added += n
        row.tokens += tokens[i][:n]
        row.logps += logps[i][:n]
        row.versions += [version] * n
        # the segment's stop token is its last one; cut at the budget, it is not there
        row.eos = eos[i] and n == lengths[i]
        row.done = row.eos or len(row.tokens) >= max_new_tokens
    return added


def to_batch(rows: list[Row], max_new_tokens: int, pad_id: int, meta: dict | None = None) -> Batch:
    """The layout every engine's generate_sequences returns (prompt_ids, prompt_mask, responses,
    response_mask, has_eos, rollout_log_probs, input_ids, attention_mask, the fields), plus each
    token's version (token_versions, −1 past the response), each sample's oldest one
    (policy_version: the weights it is furthest behind by) and whether the row is done."""
    n = len(rows)
    prompts = left_padded([r.prompt for r in rows], pad_id)
    responses = torch.full((n, max_new_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros((n, max_new_tokens), dtype=torch.long)
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32)
    versions = torch.full((n, max_new_tokens), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r.tokens)
        if k:
            responses[i, :k] = torch.tensor(r.tokens, dtype=torch.long)
            logps[i, :k] = torch.tensor(r.logps, dtype=torch.float32)
            versions[i, :k] = torch.tensor(r.versions, dtype=torch.long)
            mask[i, :k] = 1
    tensors = {"responses": responses, "response_mask": mask, "rollout_log_probs": logps,
               "has_eos": torch.tensor([r.eos for r in rows], dtype=torch.bool),
               "token_versions": versions,
               "policy_version": torch.tensor([r.first_version or 0 for r in rows], dtype=torch.long),
               "done": torch.tensor([r.done for r in rows], dtype=torch.bool),
               "input_ids": torch.cat([prompts["prompt_ids"], responses], dim=1),
               "attention_mask": torch.cat([prompts["prompt_mask"], mask], dim=1)}
    return prompts.union(Batch(tensors, _arrays(rows), meta))


def _arrays(rows: list[Row]) -> dict:
    """The rows' per-sample fields as arrays: numbers as numpy's numbers, anything else as objects."""
    out = {}
    for k in rows[0].fields if rows else ():
        values = [r.fields[k] for r in rows]
        numeric = all(isinstance(v, (int, float, np.integer, np.floating, np.bool_)) and not isinstance(v, bool)
                      for v in values)
        out[k] = np.asarray(values) if numeric else object_array(values)
    return out
