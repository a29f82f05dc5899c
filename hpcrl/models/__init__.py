"""Tiny Hugging Face models built from configs, their tokenizer, and the critic's value head.

The names below are imported when first asked for: hpcrl.models.size and .shape (what the memory
plan reads at `hpcrl validate`) need no torch, and importing them must not import it."""
import importlib

_HOME = {"create_model_dir": "causal_lm", "load_causal_lm": "causal_lm", "log_probs_head": "causal_lm",
         "position_ids": "causal_lm", "response_log_probs": "causal_lm", "saved_weights": "causal_lm",
         "tiny_qwen2_config": "causal_lm",
         "ValueModel": "critic", "response_values": "critic", "values_head": "critic", "CharTokenizer": "tokenizer"}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
