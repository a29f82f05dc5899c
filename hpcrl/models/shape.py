"""What the engines need to know of a Llama/Qwen2-shaped HF decoder, read from its config."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """Sizes of the model (from its HF config), and whether a TP × PP split of it exists."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_bias: bool
    tied: bool

    @classmethod
    def of(cls, config) -> Shape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size,
                   qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """The KV cache of one token, every layer: keys and values."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp

    def check(self, tp: int, pp: int) -> None:
        """A ValueError naming the setting when the model cannot be split this way."""
        if self.kv_heads % tp or self.heads % tp or self.ffn % tp:
            raise ValueError(f"tensor_parallel: {tp} must divide the KV heads ({self.kv_heads}), heads "
                             f"({self.heads}) and FFN width ({self.ffn}) of the model")
        if self.layers % pp:
            raise ValueError(f"pipeline_parallel: {pp} must divide the model's {self.layers} layers")


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}     # transformers 5 keeps it here
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
