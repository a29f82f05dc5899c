"""KL between the policy and the reference, per token, and the controllers of its coefficient β."""
from __future__ import annotations

import math

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π, with d = log π − log π_ref:

        k1 = d                      unbiased, can be negative
        k2 = ½ d²                   biased, low variance
        k3 = exp(−d) − 1 + d        unbiased, always ≥ 0 ("low-var"; Schulman 2020), clamped to [−10, 10]
    """
    d = log_probs - ref_log_probs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator in ("k3", "low_var"):
        return (torch.exp(-d) - 1 + d).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}: use one of {KL_ESTIMATORS}")


class FixedKLController:
    """β stays where it was set."""

    def __init__(self, value: float):
        self.value = value

    def update(self, current_kl: float, n_samples: int) -> None:
        pass


class AdaptiveKLController:
    """β follows a KL target (Ziegler et al. 2019):
        e = clip(KL/target − 1, −0.2, 0.2);   β ← β · (1 + e · n_samples / horizon)"""

    def __init__(self, value: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target > 0 and horizon > 0")
        self.value, self.target, self.horizon = value, target, horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_samples / self.horizon
