"""Sequence packing: a micro-batch's sequences as one row without padding, each attending only to itself.

A micro-batch laid out as [left-padded prompt | right-padded response] computes on its padding, most
of it when response lengths vary. `Packed` holds the same sequences as one row of their real tokens
(those their attention mask marks: a multi-turn response's observations included), one after another,
with position ids that restart at 0 at each sequence and no attention mask.

Why position ids and no 4-D mask: transformers (5.x) reads the sequences' bounds from such position
ids (a position that does not follow the one before it starts a sequence) when the forward has no
attention mask and no KV cache (`use_cache=False`: a cache turns the reading off), and each attention
implementation then keeps every sequence to itself in its own way:

- `sdpa` (the torch engine's, on CPU and GPU): a block-diagonal causal (1, 1, T, T) boolean mask, made
  once per forward. Exact on CPU; on a GPU SDPA runs its memory-efficient kernel over the whole row
  (all T² scores computed, those across sequences masked).
- `flash_attention_2`/`_3` (a GPU with flash-attn installed): the varlen kernel, its cu_seqlens taken
  from the position ids: no mask, no work across sequences. The fast path on a GPU.
- `flex_attention`: a block-sparse mask that skips the blocks across sequences.

A custom 4-D mask would give every implementation a dense mask (flash attention takes none), so
position ids are the layout that is exact on CPU and lets a GPU take the varlen kernel.

Outputs return to the padded layout (`unpack`, `to_rows`), zero at padding, so the loss and everything
after it see the layout they always see.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED = "packed"
"""The Batch.meta key that marks a micro-batch for a packed forward."""


@dataclass(frozen=True)
class Packed:
    input_ids: torch.Tensor      # (1, T): the real tokens of every row, row after row
    position_ids: torch.Tensor   # (1, T): 0, 1, ... within each row
    real: torch.Tensor           # (B, L) bool: where the real tokens sit in the padded layout

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
        real = attention_mask.bool()
        # row-major boolean indexing keeps row order, and each row's tokens in order
        positions = attention_mask.long().cumsum(dim=1) - 1
        return cls(input_ids[real][None], positions[real][None], real)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) values of the packed row → (B, L, ...) in the padded layout, 0 at padding."""
        out = x.new_zeros(*self.real.shape, *x.shape[2:])
        out[self.real] = x[0]
        return out

    def response_positions(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep, valid): the packed row's places of the positions that predict the real tokens of the
        last r columns (the response), in row-major order, and which of those (B, r) tokens are real."""
        place = self.real.flatten().long().cumsum(0).view(self.real.shape) - 1
        valid = self.real[:, -r:]
        return place[:, -r - 1:-1][valid], valid


def to_rows(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(1, n, ...) values of the n real response tokens → (B, r, ...), 0 where `valid` is False."""
    out = x.new_zeros(*valid.shape, *x.shape[2:])
    out[valid] = x[0]
    return out
