"""megatron-core's local layer spec as hpcrl builds its GPTModel: core attention through PyTorch's
SDPA, and row-parallel linears that name their own tensor-parallel group.

megatron's own `DotProductAttention` makes the (b, heads, s, s) scores, a masked softmax and a
second product, each a pass over memory; SDPA runs flash or memory-efficient kernels that never
make the scores. A batch without padding (attention_mask None, as MegatronEngine gives it then)
takes the causal flash kernel with the KV heads as they are; with padding, the memory-efficient
kernel needs the KV heads repeated per query head, as megatron's own path repeats them.

megatron-core 0.19's `RowParallelLinear` (the attention's output projection and the MLP's second
linear) passes `tp_group=None` to its matmul, which then looks the group up and, on global rank 0,
warns with a DeprecationWarning on every call. Under `torch.compile` that warning cannot be traced:
each layer's graph broke at both linears, and inside megatron's activation-offloading context the
rest of the function ran eager. Passing the layer's own group leaves one graph per layer.
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


def layer_spec():
    """megatron's local GPT layer spec (RMSNorm) with SDPA core attention and row-parallel linears
    that pass their own TP group (megatron-core, an optional package, is imported on the first call)."""
    import dataclasses

    import megatron.core
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp
    # megatron-core 0.19 gives the MLP's submodules to a partial of MLP.as_mlp_submodule
    if not (isinstance(mlp, functools.partial) and dataclasses.is_dataclass(mlp.keywords.get("submodules"))):
        raise RuntimeError(f"megatron-core {megatron.core.__version__}: its local layer spec no longer gives the MLP "
                           "its submodules as 0.19 does; install megatron-core 0.19 (pip install 'megatron-core~=0.19.2')")
    attention.core_attention, attention.linear_proj = _sdpa_attention_class(), _row_linear_class()
    spec.submodules.mlp = functools.partial(mlp, submodules=dataclasses.replace(mlp.keywords["submodules"],
                                                                                linear_fc2=_row_linear_class()))
    return spec


@functools.cache
def _row_linear_class() -> type:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class RowParallelLinearWithGroup(RowParallelLinear):
        def _forward_impl(self, input, weight, *args, **kwargs):
            return super()._forward_impl(input, weight, *args, **{**kwargs, "tp_group": self.tp_group})

    return RowParallelLinearWithGroup


@functools.cache
def _sdpa_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("SdpaAttention takes neither packed sequences nor an attention bias")
            return sdpa_attention(query, key, value, attention_mask, self.softmax_scale)

    return SdpaAttention
