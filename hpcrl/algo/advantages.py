"""Advantages: GAE with a critic; without one, scores against their group (GRPO, Dr.GRPO, RLOO,
REINFORCE++-baseline) or whitened returns (REINFORCE++); and whitening."""
from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) over the valid entries, var with Bessel's correction; padding is 0."""
    mask_f = mask.to(x.dtype)
    n = mask_f.sum()
    mean = (x * mask_f).sum() / n
    var = ((x - mean).square() * mask_f).sum() / (n - 1).clamp_min(1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask_f


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation, backwards over the valid tokens of each row (padding, even
    inside a row, is skipped: the next valid token's value and advantage carry over it):

        δ_t = r_t + γ·V_next − V_t,     A_t = δ_t + γλ·A_next,     returns_t = A_t + V_t

    V_next and A_next are those of the next valid token, 0 after the last. Returns (advantages,
    returns), both 0 on padding, before any whitening."""
    mask_f = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask_f[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv + (1 - m) * next_adv
    return advantages, (advantages + values) * mask_f


def _per_group(scores: torch.Tensor, group: torch.Tensor, fn) -> torch.Tensor:
    """fn(s) on the scores s of each group of ≥ 2 responses; 0 for a group of 1 (nothing to compare with)."""
    out = torch.zeros_like(scores)
    for g in torch.unique(group):
        sel = group == g
        if int(sel.sum()) > 1:
            out[sel] = fn(scores[sel])
    return out


def grpo_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6,
                    norm_by_std: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024): each response's score against the other responses to its prompt,

        A_i = (s_i − mean_group(s)) / (std_group(s) + eps)     (std unbiased; a group of 1 gives 0)
        A_i = s_i − mean_group(s)                             norm_by_std False (Dr.GRPO, Liu et al. 2025)

    the same A_i on every valid token of response i."""
    def centred(s):
        return (s - s.mean()) / (s.std() + eps) if norm_by_std else s - s.mean()
    return _per_group(scores, group, centred)[:, None] * mask.to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each response's score against the mean of the others to its prompt,

        A_i = s_i − 1/(n−1) · Σ_{j≠i} s_j          (n responses in i's group; a group of 1 gives 0)

    the same A_i on every valid token of response i."""
    return _per_group(scores, group, lambda s: s - (s.sum() - s) / (s.numel() - 1))[:, None] * mask.to(scores.dtype)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_next backwards over each row's valid tokens (G_next that of the next valid
    token, 0 after the last); 0 on padding."""
    mask_f = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask_f[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): the discounted returns of the (KL-shaped) token rewards, whitened over
    the batch's valid tokens, no critic and no group:

        A_t = whiten_batch(G_t),   G_t = Σ_{k≥t valid} γ^(k−t) r_k"""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (verl's reinforce_plus_plus_baseline): the group mean taken off each
    score, on every valid token, then whitened over the batch's valid tokens:

        A_i,t = whiten_batch(s_i − mean_group(s))      (a group of 1 gives 0 before whitening)"""
    return masked_whiten(grpo_advantages(scores, group, mask, norm_by_std=False), mask)
