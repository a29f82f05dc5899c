"""megatron-core's core attention through PyTorch's SDPA, for the local (no Transformer Engine) layer spec.

megatron's own `DotProductAttention` makes the (b, heads, s, s) scores, a masked softmax and a
second product, each a pass over memory; SDPA runs flash or memory-efficient kernels that never
make the scores. A batch without padding (attention_mask None, as MegatronEngine gives it then)
takes the causal flash kernel with the KV heads as they are; with padding, the memory-efficient
kernel needs the KV heads repeated per query head, as megatron's own path repeats them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s, b, heads, d], key and value [s, b, kv heads, d], attention_mask [b, 1, s, s]
        True where a query may not look (megatron's sense), or None: causal. Returns [s, b, heads·d]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention takes neither packed sequences nor an attention bias")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))      # [b, heads, s, d]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
