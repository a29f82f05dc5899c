"""Hugging Face Llama/Qwen2 weights ⇄ megatron-core GPTModel shards, for any tensor/pipeline layout.

Pure tensor code (no megatron import, no communication), so the layouts are tested on CPU.

Megatron's local-spec GPTModel holds, per layer, one fused `linear_qkv` whose rows are grouped by
KV head ([q heads of group g | k_g | v_g] for each group g) so that tensor parallelism splits it
into whole groups, and one `linear_fc1` that is [gate | up]; under TP each rank holds
[gate shard | up shard]. Column-parallel weights (qkv, fc1, vocab) split along dim 0, row-parallel
ones (proj, fc2) along dim 1; norms are replicated. Pipeline stage s holds layers
[s·L/pp, (s+1)·L/pp), numbered from 0 within the stage; the embedding is on the first stage and
the final norm and output layer on the last. The vocabulary is padded to a multiple of TP.
"""
from __future__ import annotations

import torch

from hpcrl.models.shape import Shape


def _hf_prefix(state: dict) -> str:
    """"model." for a causal LM, "backbone." for hpcrl's ValueModel, "" for a bare decoder."""
    for p in ("model.", "backbone.", ""):
        if f"{p}embed_tokens.weight" in state:
            return p
    raise KeyError("not a Llama/Qwen2 state dict: no embed_tokens.weight")


def _fuse_qkv(q, k, v, s: Shape) -> torch.Tensor:
    """Rows [q_g | k_g | v_g] per KV group g (works for weights and biases)."""
    per = s.heads // s.kv_heads
    tail = q.shape[1:]
    q = q.reshape(s.kv_heads, per * s.head_dim, *tail)
    k = k.reshape(s.kv_heads, s.head_dim, *tail)
    v = v.reshape(s.kv_heads, s.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(fused, s: Shape):
    per = s.heads // s.kv_heads
    tail = fused.shape[1:]
    g = fused.reshape(s.kv_heads, (per + 2) * s.head_dim, *tail)
    q, k, v = g.split([per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def to_megatron(hf: dict[str, torch.Tensor], s: Shape, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0,
                value_head: bool = False) -> dict[str, torch.Tensor]:
    """The GPTModel state dict of rank (tp_rank, pp_rank). value_head: the HF dict is hpcrl's
    ValueModel and `output_layer` is its (replicated) scalar head."""
    p = _hf_prefix(hf)
    col = lambda w: w.chunk(tp, dim=0)[tp_rank]   # noqa: E731
    row = lambda w: w.chunk(tp, dim=1)[tp_rank]   # noqa: E731
    out = {}
    per_stage = s.layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = col(_pad_rows(hf[f"{p}embed_tokens.weight"], s.padded_vocab(tp)))
    for local in range(per_stage):
        h, m = f"{p}layers.{pp_rank * per_stage + local}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        qkv = [hf[f"{h}self_attn.{n}_proj.weight"] for n in "qkv"]
        out[m + "self_attention.linear_qkv.weight"] = col(_fuse_qkv(*qkv, s))
        if s.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = col(_fuse_qkv(*[hf[f"{h}self_attn.{n}_proj.bias"] for n in "qkv"], s))
        out[m + "self_attention.linear_proj.weight"] = row(hf[h + "self_attn.o_proj.weight"])
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([col(gate), col(up)])
        out[m + "mlp.linear_fc2.weight"] = row(hf[h + "mlp.down_proj.weight"])
    if last:
        out["decoder.final_layernorm.weight"] = hf[f"{p}norm.weight"]
        if value_head:
            out["output_layer.weight"], out["output_layer.bias"] = hf["head.weight"], hf["head.bias"]
        elif not s.tied:
            out["output_layer.weight"] = col(_pad_rows(hf["lm_head.weight"], s.padded_vocab(tp)))
    return out


def to_hf(shards: list[list[dict[str, torch.Tensor]]], s: Shape, value_head: bool = False,
          prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The inverse: shards[pp_rank][tp_rank] -> the HF state dict (names as the HF model's)."""
    pp, tp = len(shards), len(shards[0])
    p = prefix if prefix is not None else ("backbone." if value_head else "model.")
    cat0 = lambda key, st: torch.cat([shards[st][r][key] for r in range(tp)], dim=0)   # noqa: E731
    cat1 = lambda key, st: torch.cat([shards[st][r][key] for r in range(tp)], dim=1)   # noqa: E731
    hf = {f"{p}embed_tokens.weight": cat0("embedding.word_embeddings.weight", 0)[:s.vocab]}
    per_stage = s.layers // pp
    for st in range(pp):
        for local in range(per_stage):
            h, m = f"{p}layers.{st * per_stage + local}.", f"decoder.layers.{local}."
            hf[h + "input_layernorm.weight"] = shards[st][0][m + "input_layernorm.weight"]
            hf[h + "post_attention_layernorm.weight"] = shards[st][0][m + "pre_mlp_layernorm.weight"]
            names = ["weight"] + (["bias"] if s.qkv_bias else [])
            for n in names:
                q, k, v = _split_qkv(cat0(f"{m}self_attention.linear_qkv.{n}", st), s)
                hf[f"{h}self_attn.q_proj.{n}"], hf[f"{h}self_attn.k_proj.{n}"], hf[f"{h}self_attn.v_proj.{n}"] = q, k, v
            hf[h + "self_attn.o_proj.weight"] = cat1(m + "self_attention.linear_proj.weight", st)
            halves = [shards[st][r][m + "mlp.linear_fc1.weight"].chunk(2) for r in range(tp)]
            hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
            hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
            hf[h + "mlp.down_proj.weight"] = cat1(m + "mlp.linear_fc2.weight", st)
    hf[f"{p}norm.weight"] = shards[-1][0]["decoder.final_layernorm.weight"]
    if value_head:
        hf["head.weight"], hf["head.bias"] = shards[-1][0]["output_layer.weight"], shards[-1][0]["output_layer.bias"]
    elif s.tied:
        hf["lm_head.weight"] = hf[f"{p}embed_tokens.weight"]
    else:
        hf["lm_head.weight"] = cat0("output_layer.weight", pp - 1)[:s.vocab]
    return hf
