"""PPO's policy and value losses, entropy, and how token losses become one number."""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IMPORTANCE_LEVELS = ("token", "sequence")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float | None = None,
              total_seqs: float | None = None, max_length: int | None = None) -> torch.Tensor:
    """Per-token losses (B, T) → a scalar.

        token-mean               Σ loss·m / N_tokens
        seq-mean-token-sum       Σ_seq (Σ_t loss·m) / N_seqs
        seq-mean-token-mean      Σ_seq (Σ_t loss·m / Σ_t m) / N_seqs
        seq-mean-token-sum-norm  Σ_seq (Σ_t loss·m / L) / N_seqs     (Dr.GRPO; L = max_length, a constant)

    N_tokens and N_seqs are those of the whole mini-batch across micro-batches and data-parallel
    ranks (given by the training engine), so splitting a mini-batch does not change its loss; they
    default to this piece's own counts. L is the longest a response may be (not this piece's padded
    width, which changes from batch to batch), so no response's length rescales its tokens."""
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * m).sum() / (m.sum() if total_tokens is None else total_tokens)
    n_seqs = loss.shape[0] if total_seqs is None else total_seqs
    if mode == "seq-mean-token-sum":
        return (loss * m).sum(dim=1).sum() / n_seqs
    if mode == "seq-mean-token-mean":
        return ((loss * m).sum(dim=1) / m.sum(dim=1).clamp_min(1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if not max_length:
            raise ValueError("seq-mean-token-sum-norm needs max_length, the longest a response may be")
        return (loss * m).sum(dim=1).sum() / (n_seqs * max_length)
    raise ValueError(f"unknown loss aggregation {mode!r}: use one of {AGG_MODES}")


def policy_loss(log_probs, old_log_probs, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                agg="token-mean", total_tokens=None, total_seqs=None, is_weights=None, importance="token",
                max_length=None):
    """Clipped surrogate (Schulman et al. 2017) with separate low/high ε and dual clip (Ye et al. 2020):

        ρ = exp(d),  d = clamp(log π − log π_old, −20, 20)               importance "token" (PPO)
        ρ = exp(clamp(sg[log s_i] + log π − sg[log π], −20, 20))         importance "sequence" (GSPO,
            log s_i = mean of d over i's valid tokens                   Zheng et al. 2025): the value
                                                                         of every token of response i
                                                                         is s_i, its gradient s_i·∇log π
        L = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
        if A < 0 and dual_clip c > 1:  L = min(L, −A·c)
        L = w·L  with is_weights w (no gradient), e.g. truncated_is_weights

    aggregated as `agg` says (aggregate). Returns (loss, stats) with stats clipfrac (share of valid
    tokens where the ε clip was active), approx_kl (mean of −d) and dual_clipfrac."""
    token_log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    m = mask.to(log_probs.dtype)
    if importance == "token":
        log_ratio = token_log_ratio
    elif importance == "sequence":
        seq = (token_log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp_min(1)
        log_ratio = seq.detach()[:, None] + log_probs - log_probs.detach()
    else:
        raise ValueError(f"unknown importance ratio {importance!r}: use one of {IMPORTANCE_LEVELS}")
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.zeros_like(clipped, dtype=torch.bool)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss3 = -advantages * dual_clip
        dual = (advantages < 0) & (loss3 < clipped)
        clipped = torch.where(advantages < 0, torch.minimum(clipped, loss3), clipped)
    if is_weights is not None:
        clipped = clipped * is_weights.detach()
    loss = aggregate(clipped, mask, agg, total_tokens, total_seqs, max_length)
    with torch.no_grad():
        stats = {"clipfrac": _frac(loss2 > loss1, m),
                 "approx_kl": float((-token_log_ratio * m).sum() / m.sum().clamp_min(1)), "dual_clipfrac": _frac(dual, m)}
    return loss, stats


def truncated_is_weights(old_log_probs, rollout_log_probs, cap: float):
    """Truncated importance sampling (Yao et al. 2025, verl's TIS): the sampler's weights or kernels
    differ from the actor's, so its tokens came from π_rollout, not π_old:

        w = min(exp(log π_old − log π_rollout), cap)"""
    return torch.exp((old_log_probs - rollout_log_probs).clamp(-20.0, 20.0)).clamp(max=cap)


def masked_is_weights(old_log_probs, rollout_log_probs, low: float, high: float):
    """Masked importance sampling (verl's rollout correction in its "mask" mode): a token sampled by a
    policy too far from the one that trains (stale weights, the sampler's own numerics) is dropped
    from the policy loss rather than reweighted:

        w = 1  if low ≤ exp(log π_old − log π_rollout) ≤ high,  else 0"""
    ratio = torch.exp((old_log_probs - rollout_log_probs).clamp(-20.0, 20.0))
    return ((ratio >= low) & (ratio <= high)).to(old_log_probs.dtype)


def value_loss(values, old_values, returns, mask, clip=None, agg="token-mean", total_tokens=None, total_seqs=None,
               max_length=None):
    """½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, −c, c) (no clip when c is None).
    Returns (loss, stats) with clipfrac (share of tokens where the clipped error was larger)."""
    err = (values - returns).square()
    if clip is None:
        per_token, frac_mask = err, torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns).square()
        per_token, frac_mask = torch.maximum(err, err_clip), err_clip > err
    loss = 0.5 * aggregate(per_token, mask, agg, total_tokens, total_seqs, max_length)
    return loss, {"clipfrac": _frac(frac_mask, mask.to(values.dtype))}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z, per position."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def _frac(flags: torch.Tensor, m: torch.Tensor) -> float:
    return float((flags.to(m.dtype) * m).sum() / m.sum().clamp_min(1))
