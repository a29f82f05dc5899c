"""Micro-batches of a role's batch, with the padding they all share cut away.

A batch holds sequences laid out as [left-padded prompt | right-padded response]: `input_ids` and
`attention_mask` are (B, P + R), `prompt_ids`/`prompt_mask` (B, P), and `responses`,
`response_mask` and every per-token value (log-probs, values, advantages, ...) (B, R). With
responses of hundreds of tokens most of that can be padding. A micro-batch keeps only the columns
that hold a real token in some row (`trim`), and, given a token budget, holds as many rows as fit
in it (`micro_batches`), so that long and short samples neither run out of memory nor spend the
compute on padding. Outputs of a trimmed micro-batch are padded back to R (`pad_responses`).
Packed (`pack`), a micro-batch's forward runs on its rows as one row without any padding
(hpcrl.models.packing), and its token budget counts their real tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcrl.controller.batch import Batch
from hpcrl.models.packing import PACKED

_SEQUENCE = ("input_ids", "attention_mask")
_PROMPT = ("prompt_ids", "prompt_mask")


def real_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real prompt and response lengths. A multi-turn response holds the environment's
    observations between the model's turns: in its attention mask, not in its response_mask (the
    tokens trained on), so the attention mask says how long it is where the batch has one."""
    prompts = batch["prompt_mask"].sum(dim=1)
    if "attention_mask" in batch:
        return prompts, batch["attention_mask"][:, batch["prompt_mask"].shape[1]:].sum(dim=1)
    return prompts, batch["response_mask"].sum(dim=1)


def trim(mb: Batch) -> Batch:
    """mb without the prompt columns that are padding in every row (on the left) and the response
    columns that are padding in every row (on the right)."""
    if "prompt_mask" not in mb or "response_mask" not in mb:
        return mb
    width_p, width_r = mb["prompt_mask"].shape[1], mb["response_mask"].shape[1]
    prompts, responses = real_lengths(mb)
    p, r = int(prompts.max()), max(1, int(responses.max()))
    if p == width_p and r == width_r:
        return mb
    out = {}
    for k, t in mb.tensors.items():
        if k in _SEQUENCE:
            out[k] = t[:, width_p - p:width_p + r]
        elif k in _PROMPT:
            out[k] = t[:, width_p - p:]
        elif t.dim() >= 2 and t.shape[1] == width_r:
            out[k] = t[:, :r]
        else:
            out[k] = t
    return Batch(out, mb.arrays, mb.meta)


def pad_responses(out: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Per-response-token outputs of a trimmed micro-batch, padded back to the batch's width with 0."""
    return {k: torch.nn.functional.pad(v, (0, width - v.shape[1])) if v.dim() == 2 and v.shape[1] < width else v
            for k, v in out.items()}


def micro_batches(batch: Batch, size: int, tokens: int = 0, equal_across_ranks: bool = False,
                  device: torch.device | str = "cpu", pack: bool = False) -> list[Batch]:
    """Consecutive micro-batches of at most `size` rows and, with a budget, at most `tokens`
    tokens each (a row longer than the budget goes alone): once trimmed, rows × (longest prompt +
    longest response); `pack`ed, the sum of the rows' real lengths, and each micro-batch is marked
    for a packed forward (meta PACKED).
    `equal_across_ranks`: every rank of the group gets as many (sharded models run collectives in
    every forward), the ranks with fewer splitting their largest micro-batches."""
    n = len(batch)
    if tokens and "prompt_mask" in batch and "response_mask" in batch:
        bounds, start, p, r, total = [], 0, 0, 0, 0
        for i, (pi, ri) in enumerate(zip(*(x.tolist() for x in real_lengths(batch)))):
            rows = i - start
            cost = total + pi + ri if pack else (rows + 1) * (max(p, pi) + max(r, ri))
            if rows and (rows == size or cost > tokens):
                bounds.append((start, i))
                start, p, r, total = i, 0, 0, 0
            p, r, total = max(p, pi), max(r, ri), total + pi + ri
        bounds.append((start, n))
    else:
        bounds = [(s, min(s + size, n)) for s in range(0, n, max(1, size))]
    if equal_across_ranks and dist.is_initialized() and dist.get_world_size() > 1:
        count = torch.tensor([len(bounds)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(bounds) < int(count.item()):      # each rank holds as many rows, so this always ends
            k = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
            a, b = bounds[k]
            bounds[k:k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    micro = [trim(batch.index(slice(a, b))) for a, b in bounds if b > a]
    if pack:
        for mb in micro:
            mb.meta[PACKED] = True
    return micro
