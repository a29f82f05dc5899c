"""Qwen2 and Llama decoders in plain torch: a run's roles load the tiny model it builds, and a small
Hugging Face model of either architecture (SmolLM2 is a Llama), without importing transformers, which
was a third of each model role's start on CPU (2.1 of 6.3 CPU-seconds for the tiny model, 1.6-2.6 of
4.4-5.3 for SmolLM2's roles; docs/pages/benchmarks.md).

Same parameter names (state dicts, checkpoints and weight transfers are interchangeable with
transformers' Qwen2ForCausalLM and LlamaForCausalLM), same arithmetic as transformers' with its SDPA
attention (tests/test_plain_decoder.py holds logits, values, gradients and the KV cache to it), and
only what the engines ask of a model: a forward over left-padded rows (attention mask and position
ids), over packed rows (position ids that restart, no mask: hpcrl.models.packing), or one token
further on a KV cache; `logits_to_keep`; the output layer swapped (the chunked head); gradient
checkpointing. The two architectures differ only in their linear layers' biases.

Any other model directory (another architecture, RoPE scaling, sliding windows, weights in shards or
over MAX_BYTES, which transformers builds straight onto the GPU), or one the LoRA engine adapts (peft
needs transformers' classes), loads through transformers (hpcrl.models.causal_lm.load_causal_lm).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

WEIGHTS = "model.safetensors"
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
MAX_BYTES = 2 << 30
"""The largest weights file loaded here: the module is built on the host first (a first meta-device
build costs a second of torch's own set-up), which a larger model should not cost in host memory."""


def loads(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a model this module loads: a Qwen2 or Llama causal LM with plain
    RoPE and SiLU, in one weights file of at most MAX_BYTES."""
    d = Path(model_dir)
    try:
        c = json.loads((d / "config.json").read_text())
        size = (d / WEIGHTS).stat().st_size
    except (OSError, ValueError):
        return False
    rope = c.get("rope_parameters") or {}
    arch = ARCHITECTURES.get(c.get("model_type"))
    return (arch is not None and c.get("architectures") == [arch] and size <= MAX_BYTES
            and c.get("hidden_act", "silu") == "silu" and c.get("pretraining_tp", 1) == 1
            and rope.get("rope_type", "default") == "default" and not c.get("rope_scaling")
            and not c.get("use_sliding_window")
            and c.get("head_dim") in (None, c["hidden_size"] // c["num_attention_heads"]))


def read_config(model_dir: str | Path) -> SimpleNamespace:
    """config.json as attributes, with the defaults transformers' config classes give what it leaves out."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    rope = c.get("rope_parameters") or {}
    llama = c.get("model_type") == "llama"
    return SimpleNamespace(**{"pad_token_id": None, "rms_norm_eps": 1e-6, **c,
                              "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
                              "rope_theta": rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                              "tie_word_embeddings": c.get("tie_word_embeddings", False),
                              # Qwen2: biased q, k, v; Llama: as its config says (none in the common ones)
                              "qkv_bias": bool(c.get("attention_bias", False)) if llama else True,
                              "o_bias": bool(c.get("attention_bias", False)) if llama else False,
                              "mlp_bias": bool(c.get("mlp_bias", False)) if llama else False})


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
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.o_bias)

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
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Named as the engines look for decoder layers (by the name's ending, as transformers' are)."""

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


class DecoderModel(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
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


class DecoderForCausalLM(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.config = c
        self.model = DecoderModel(c)
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


@contextmanager
def _uninitialised():
    """Modules built here keep their parameters as allocated: the initial draws the weights replace at
    once cost 0.9 CPU-seconds for SmolLM2's 135M (and would take the run's random numbers). As
    transformers builds a pretrained model."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def load(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
         backbone: bool = False) -> nn.Module:
    """The model in `model_dir` (loads() true) in `dtype` on `device`: the causal LM, or with
    `backbone` its decoder alone (the critic's; the output layer's weights are not read)."""
    from safetensors.torch import load_file

    c = read_config(model_dir)
    # built on the host (a first meta-device build costs a second of torch's own set-up), uninitialised:
    # every parameter is replaced by the weights below
    with _uninitialised():
        module = DecoderModel(c) if backbone else DecoderForCausalLM(c)
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
