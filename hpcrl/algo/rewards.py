"""From sampled tokens and a sequence score to per-token rewards; the shaping and filtering of
scores before advantages (DAPO)."""
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


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025): a response within `buffer` tokens of the
    longest allowed (L_max = max_length) loses up to `factor`, linearly in how far it reaches in:

        R(|y|) = factor · clip((L_max − buffer − |y|) / buffer, −1, 0)

    0 up to L_max − buffer tokens, −factor at L_max; added to the scores."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in 1..{max_length} (the longest response), got {buffer}")
    return factor * ((max_length - buffer - lengths.to(torch.float32)) / buffer).clamp(-1.0, 0.0)


def varied_groups(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling filter: True for the responses whose group's scores are not all equal.
    A group of equal scores (all right, all wrong) has no advantage against itself, so it only adds
    tokens that dilute the others' gradient."""
    keep = torch.zeros_like(group, dtype=torch.bool)
    for g in torch.unique(group):
        sel = group == g
        keep[sel] = bool(scores[sel].max() > scores[sel].min())
    return keep
