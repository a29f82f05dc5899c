"""From sampled tokens and a sequence score to per-token rewards."""
from __future__ import annotations

import torch


def truncate_at_eos(responses: torch.Tensor, eos_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token (the stop token is kept and counted).

    Returns (responses with pad after the stop, response_mask, has_eos). pad_id must not be a stop
    token, or padding would read as stopping."""
    if pad_id in eos_ids:
        raise ValueError(f"pad id {pad_id} is also a stop token; give the tokenizer a separate pad")
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= responses == e
    # positions strictly after the first stop token
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    mask = ~after
    return responses.masked_fill(after, pad_id), mask.long(), is_eos.any(dim=1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row (0 for an empty row)."""
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (idx * mask.long()).amax(dim=1)


def token_level_rewards(scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """r_t = −β·KL_t on every valid token, plus the sequence score on the last valid token:

        r_t = −β·kl_t·m_t + score·[t = last valid t]"""
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    if kl is not None and beta:
        rewards = rewards - beta * kl.to(scores.dtype) * mask
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] += scores
    return rewards
