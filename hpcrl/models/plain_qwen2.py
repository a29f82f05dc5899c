"""The tiny Qwen2 a run builds (create_model_dir) in plain torch: the roles of a tiny run load it
without importing transformers, which was a third of each model role's start on CPU (2.1 of 6.3
CPU-seconds; the issue-57 table in docs/pages/benchmarks.md).

Same parameter names (state dicts, checkpoints and weight transfers are interchangeable with
transformers' Qwen2ForCausalLM), same arithmetic as transformers' Qwen2 with its SDPA attention
(tests/test_plain_qwen2.py holds logits, values, gradients and the KV cache to it), and only what the
engines ask of a model: a forward over left-padded rows (attention mask and position ids), over
packed rows (position ids that restart, no mask: hpcrl.models.packing), or one token further on a
KV cache; `logits_to_keep`; the output layer swapped (the chunked head); gradient checkpointing.

Any other model directory, or one the LoRA engine adapts (peft needs transformers' classes), loads
through transformers as before (hpcrl.models.causal_lm.load_causal_lm).
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

WEIGHTS = "model.safetensors"


def loads(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a model this module loads: the tiny Qwen2 hpcrl builds (its own
    character tokenizer beside it), plain RoPE and SiLU, one weights file."""
    from hpcrl.models.tokenizer import FILE

    d = Path(model_dir)
    try:
        c = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rope = c.get("rope_parameters") or {}
    return ((d / FILE).exists() and (d / WEIGHTS).exists() and c.get("model_type") == "qwen2"
            and c.get("architectures") == ["Qwen2ForCausalLM"] and c.get("hidden_act", "silu") == "silu"
            and rope.get("rope_type", "default") == "default" and not c.get("rope_scaling")
            and not c.get("use_sliding_window")
            and c.get("head_dim") in (None, c["hidden_size"] // c["num_attention_heads"]))


def read_config(model_dir: str | Path) -> SimpleNamespace:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    rope = c.get("rope_parameters") or {}
    return SimpleNamespace(**{**c, "rope_theta": rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                              "tie_word_embeddings": c.get("tie_word_embeddings", False)})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: SimpleNamespace, index: int):
        super().__init__()
        self.index, self.heads, self.kv_heads = index, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache):
        b, t = x.shape[:2]
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        grouped = self.heads != self.kv_heads
        if grouped and mask is not None:   # as transformers: SDPA's own grouped-query attention only where no mask is given
            k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=self.head_dim ** -0.5, enable_gqa=grouped and mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    """Named as transformers' (the engines find decoder layers by the name's ending)."""

    def __init__(self, c: SimpleNamespace, index: int):
        super().__init__()
        self.self_attn, self.mlp = Attention(c, index), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gradient_checkpointing, self.checkpoint_kwargs = False, {}

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Each layer's keys and values so far, grown by concatenation (transformers' DynamicCache)."""

    def __init__(self):
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_seq_length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def update(self, k, v, index: int):
        if index == len(self.layers):
            self.layers.append((k, v))
        else:
            old_k, old_v = self.layers[index]
            self.layers[index] = (torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2))
        return self.layers[index]


class Output(dict):
    """A forward's results by name, as attributes too (transformers' ModelOutput)."""
    __getattr__ = dict.__getitem__


def attention_mask_4d(attention_mask, position_ids, t: int, past: int, starts):
    """The (b, 1, t, past + t) boolean mask SDPA takes, or None where plain causal attention is it:
    causal over the real tokens of each row, or over each sequence of a packed row (`starts`: where
    its sequences start; None where the row is not packed)."""
    if attention_mask is None and starts is None:
        return None
    device = position_ids.device
    q = torch.arange(past, past + t, device=device)
    mask = (torch.arange(past + t, device=device)[None, :] <= q[:, None])[None, None]
    if starts is not None:
        seq = starts.cumsum(-1)
        mask = mask & (seq[:, None, :, None] == seq[:, None, None, :])
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return mask


def packed_starts(attention_mask, position_ids, cache):
    """Where the sequences of a packed row start (a position id that does not follow the one before),
    or None: transformers reads packed sequences only in one row without a mask and a cache."""
    if attention_mask is not None or cache is not None or position_ids.shape[0] != 1:
        return None
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1) != 1
    return starts if bool(starts.any()) else None


class Qwen2Model(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", inverse_frequencies(c), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Each layer recomputes its activations in the backward while training, as transformers' do."""
        for layer in self.layers:
            layer.gradient_checkpointing, layer.checkpoint_kwargs = True, dict(gradient_checkpointing_kwargs or {})

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool | None = None, **_):
        x = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = KVCache()
        cache = past_key_values if use_cache or past_key_values is not None else None
        past = cache.get_seq_length() if cache is not None else 0
        t = x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=x.device)[None]
        mask = attention_mask_4d(attention_mask, position_ids, t, past, packed_starts(attention_mask, position_ids, cache))
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            if layer.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(partial(layer, cache=None), x, cos, sin, mask, **layer.checkpoint_kwargs)
            else:
                x = layer(x, cos, sin, mask, cache)
        return Output(last_hidden_state=self.norm(x), past_key_values=cache)


def inverse_frequencies(c: SimpleNamespace) -> torch.Tensor:
    dim = c.hidden_size // c.num_attention_heads
    return 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.config = c
        self.model = Qwen2Model(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, layer: nn.Module) -> None:
        self.lm_head = layer

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0, **_):
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return Output(logits=self.lm_head(out.last_hidden_state[:, keep, :]), past_key_values=out.past_key_values)


def load(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
         backbone: bool = False) -> nn.Module:
    """The model in `model_dir` (loads() true) in `dtype` on `device`: the causal LM, or with
    `backbone` its decoder alone (the critic's; the output layer's weights are not read)."""
    from safetensors.torch import load_file

    c = read_config(model_dir)
    # built on the host (a first meta-device build costs a second of torch's own set-up), its random
    # initialisation drawn apart from the run's generator and replaced by the weights below
    with torch.random.fork_rng(devices=[]):
        module = Qwen2Model(c) if backbone else Qwen2ForCausalLM(c)
    state = load_file(Path(model_dir) / WEIGHTS)
    if backbone:
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    elif c.tie_word_embeddings:      # one parameter of two names: loaded once, tied below
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if c.tie_word_embeddings and not backbone:
        module.lm_head.weight = module.model.embed_tokens.weight
    body = module if backbone else module.model
    body.inv_freq = inverse_frequencies(c)      # a buffer is not in the state dict: made here, in fp32
    return module.to(device) if device is not None else module
