"""megatron-core's core attention through PyTorch's SDPA, for the local (no Transformer Engine) layer spec.

megatron's own `DotProductAttention` makes the (b, heads, s, s) scores, a masked softmax and a
second product, each a pass over memory; SDPA runs flash or memory-efficient kernels that never
make the scores. A batch without padding (attention_mask None, as MegatronEngine gives it then)
takes the causal flash kernel with the KV heads as they are; with padding, the memory-efficient
kernel needs the KV heads repeated per query head, as megatron's own path repeats them.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def attention_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """The model's mask for a micro-batch of rows (b, s) with 1 on real tokens: None without padding
    (causal), else (b, 1, s, s) True where a query may not look, megatron's sense; a pad query sees
    itself, so no row is empty (SDPA gives NaN for one, which would reach the real tokens' gradients)."""
    mask = mask.bool()
    if bool(mask.all()):
        return None
    s = mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    sees = (causal[None] & mask[:, None, :]) | torch.eye(s, dtype=torch.bool, device=mask.device)
    return ~sees[:, None]


def sdpa_attention(query, key, value, attention_mask, scale: float) -> torch.Tensor:
    """query [s, b, heads, d], key and value [s, b, kv heads, d], attention_mask [b, 1, s, s] True
    where a query may not look (megatron's sense), or None: causal. Returns [s, b, heads·d]."""
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))      # [b, heads, s, d]
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=scale)
    s, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@functools.cache
def sdpa_core_attention() -> type:
    """The core-attention class for megatron's layer spec (megatron-core, an optional package, is
    imported here, on the first call)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("SdpaAttention takes neither packed sequences nor an attention bias")
            return sdpa_attention(query, key, value, attention_mask, self.softmax_scale)

    return SdpaAttention
