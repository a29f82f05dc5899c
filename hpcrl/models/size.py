"""How big a model is, for the memory plan: its parameters counted, from an HF config.json or a
named shape of a published model, without reading weights (or importing transformers, for the
decoders whose layout is known).

    size = ModelSize.of(model_fields("qwen2.5-7b"))      # or model_fields("/path/to/model")
    size.params, size.lora_params(16, "all-linear")
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from hpcrl.models.shape import Shape

_QWEN = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768)
_LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072)
NAMED_SHAPES = {
    "qwen2.5-0.5b": {**_QWEN, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {**_QWEN, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-3b": {**_QWEN, "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "intermediate_size": 11008, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False},
    "qwen2.5-32b": {**_QWEN, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "intermediate_size": 27648, "vocab_size": 152064, "tie_word_embeddings": False},
    "smollm2-135m": {**_LLAMA, "rope_theta": 1e5, "max_position_embeddings": 8192, "hidden_size": 576,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True},
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False},
}
"""The published configs' sizes (../shared/notes/model-shapes.md; Qwen2.5-32B's and SmolLM2-135M's config.json),
for planning and benches before the weights are at hand."""


def tiny_qwen2_fields(vocab_size: int, hidden_size: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                      intermediate_size: int = 256, max_positions: int = 128) -> dict:
    """The config fields of the tiny Qwen2 a run builds when it is given no model (hpcrl.models.causal_lm)."""
    return dict(model_type="qwen2", vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
                max_position_embeddings=max_positions, tie_word_embeddings=False)


def model_fields(source: str | Path) -> dict:
    """An HF config's fields: a named shape's (NAMED_SHAPES) or a model folder's config.json. A
    ValueError says which was looked for, when neither."""
    if str(source) in NAMED_SHAPES:
        return dict(NAMED_SHAPES[str(source)])
    try:
        fields = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{source}: neither a named shape ({', '.join(NAMED_SHAPES)}) nor a model folder with a "
                         f"readable config.json ({e.__class__.__name__})") from None
    if "model_type" not in fields:
        raise ValueError(f"{source}/config.json: no model_type (not a Hugging Face model's config)")
    return fields


DECODERS = frozenset({"llama", "qwen2", "mistral"})
"""Decoders counted by their layout (`ModelSize.of`); tests/test_memory_plan.py holds the count
against the model transformers builds."""


@dataclass(frozen=True)
class ModelSize:
    """A causal LM's parameters and the sizes that activations and the KV cache grow with."""
    shape: Shape
    params: int
    """every parameter once (a tied output layer is the embedding)"""
    linears: tuple[tuple[str, int, int], ...]
    """(module name, in, out) of every linear layer but the output layer: where LoRA adapters go"""

    @classmethod
    def of(cls, fields: dict) -> ModelSize:
        """Counted from the layout of a Llama/Qwen2/Mistral decoder (q, k, v, o, gate, up, down,
        two norms a layer; Qwen2's q, k, v with biases); any other model built by transformers on
        the meta device (no memory, no weights) and counted there."""
        config = SimpleNamespace(**{"num_key_value_heads": fields.get("num_attention_heads"),
                                    "tie_word_embeddings": False, **fields})
        shape = Shape.of(config)
        if fields.get("model_type", "qwen2") not in DECODERS:
            return cls._built(fields, shape)
        d, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn
        attention = (("q_proj", d, q), ("k_proj", d, kv), ("v_proj", d, kv), ("o_proj", q, d))
        mlp = (("gate_proj", d, f), ("up_proj", d, f), ("down_proj", f, d))
        linears = tuple((f"model.layers.{i}.{part}.{name}", n_in, n_out) for i in range(shape.layers)
                        for part, names in (("self_attn", attention), ("mlp", mlp)) for name, n_in, n_out in names)
        biases = (q + 2 * kv) * shape.layers if shape.qkv_bias else 0
        params = (sum(i * o for _, i, o in linears) + biases + 2 * d * shape.layers + d
                  + shape.vocab * d * (1 if shape.tied else 2))
        return cls(shape, params, linears)

    @classmethod
    def _built(cls, fields: dict, shape: Shape) -> ModelSize:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
        head = model.get_output_embeddings()
        linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and m is not head)
        return cls(shape, sum(p.numel() for p in model.parameters()), linears)

    @property
    def embedding(self) -> int:
        """The input embedding's parameters (vocab × hidden)."""
        return self.shape.vocab * self.shape.hidden

    @property
    def output_layer(self) -> int:
        """The output layer's own parameters (0 when tied to the embedding)."""
        return 0 if self.shape.tied else self.embedding

    @property
    def per_layer(self) -> int:
        """One decoder layer's parameters."""
        return (self.params - self.embedding - self.output_layer - self.shape.hidden) // self.shape.layers

    @property
    def value_model(self) -> int:
        """A critic's: the backbone without the output layer, and a scalar head (hidden + 1)."""
        return self.params - self.output_layer + self.shape.hidden + 1

    def lora_params(self, rank: int, targets: str | list[str]) -> int:
        """Adapter parameters, rank × (in + out) per adapted linear layer, the layers chosen as peft
        chooses them: "all-linear" is every linear layer but the output layer; a list names modules
        by name or name suffix."""
        def chosen(name: str) -> bool:
            return targets == "all-linear" or any(name == t or name.endswith("." + t) for t in targets)
        return sum(rank * (i + o) for name, i, o in self.linears if chosen(name))
