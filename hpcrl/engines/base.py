"""The two interfaces every engine implements; roles hold an engine and call nothing else of it.

    TrainEngine     what a training or scoring role runs its model with: torch (DDP/FSDP2,
                    hpcrl/engines/train/torch_trainer.py) or megatron-core (train/megatron.py)
    RolloutEngine   what generates responses: the training module itself, a CUDA-graph static
                    cache (rollout/static_cache.py) or vLLM (rollout/vllm_rollout.py)

A TrainEngine is built around what the role computes, `forward(module, micro_batch) -> {name:
per-token tensor}` (log-probs, entropy, values), and trains on a loss of those outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from hpcrl.controller.batch import Batch

LossFn = Callable[[dict, Batch, float, float], tuple[torch.Tensor, dict[str, float]]]
"""loss_fn(out, micro_batch, total_tokens, total_seqs) -> (loss, stats): the micro-batch's loss as
its share of the whole mini-batch (the totals span every micro-batch and every rank)."""


class TrainEngine(Protocol):
    state_replicated: bool
    """Every rank holds the whole state (one rank, DDP), so any rank may write any part of it."""

    def infer(self, batch: Batch, micro_batch_size: int, micro_batch_tokens: int = 0) -> Batch:
        """forward over the batch without gradients, in micro-batches of at most this many samples
        (and tokens, where the engine can: hpcrl/engines/micro_batches.py); float32 results on the CPU."""

    def train_step(self, batch: Batch, loss_fn: LossFn, mask_key: str = "response_mask") -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; the stats summed over its pieces."""

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters by HF name, whole on every rank (a collective when sharded)."""

    def state_dict(self) -> dict:
        """Parameters, optimizer and schedule state, for the role's checkpoint file."""

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0    # 0: greedy
    top_p: float = 1.0
    top_k: int = 0          # 0: no top-k


class RolloutEngine(Protocol):
    shares_module: bool
    """It samples with the training module itself, so new weights need no load."""
    dtype: torch.dtype
    """What it samples in: weights sent to it in this dtype lose nothing (bf16 halves what travels)."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 seed: int) -> dict[str, torch.Tensor]:
        """prompt_ids (B, P) left-padded -> responses (B, max_new_tokens) padded after the first stop
        token, response_mask, has_eos, and the sampler's log-probs of its tokens; seeded by `seed`."""

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """New parameters by HF name, in place."""

    def sleep(self) -> None:
        """Free what the engine holds on the device until the next generate (a colocated trainer needs it)."""
