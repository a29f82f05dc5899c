"""Advantages: GAE with a critic, group-normalised scores without one (GRPO), and whitening."""
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


def grpo_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6,
                    norm_by_std: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024): each response's score against the other responses to its prompt,

        A_i = (s_i − mean_group(s)) / (std_group(s) + eps)     (std unbiased; a group of 1 gives 0)

    the same A_i on every valid token of response i."""
    adv = torch.zeros_like(scores)
    for g in torch.unique(group):
        sel = group == g
        s = scores[sel]
        if s.numel() == 1:
            continue
        centred = s - s.mean()
        adv[sel] = centred / (s.std() + eps) if norm_by_std else centred
    return adv[:, None] * mask.to(scores.dtype)
