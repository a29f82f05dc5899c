"""Models are Hugging Face causal LMs in a local directory (config + weights + tokenizer): never a
hub download at run time. On CPU a tiny Qwen2 is built from its config, once, into the run
directory, so every role loads the same initial weights."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from hpcrl.models.tokenizer import CharTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # no load reports in every worker's log
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def tiny_qwen2_config(vocab_size: int, hidden_size: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                      intermediate_size: int = 256, max_positions: int = 128):
    """Qwen2-shaped; head_dim = hidden_size / heads must be ≥ 32 (vLLM's CPU attention needs it)."""
    from transformers import Qwen2Config

    if hidden_size // heads < 32:
        raise ValueError(f"head_dim {hidden_size // heads} < 32: raise hidden_size or lower heads")
    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=max_positions, tie_word_embeddings=False,
                       bos_token_id=CharTokenizer.bos_id, eos_token_id=CharTokenizer.eos_id,
                       pad_token_id=CharTokenizer.pad_id)


def create_model_dir(path: Path, tokenizer: CharTokenizer, seed: int, **config) -> Path:
    """Random tiny Qwen2 weights (seeded) + tokenizer, saved in HF format. Kept if already there."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(tokenizer.vocab_size, **config))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save(tmp)
    os.replace(tmp, path)   # a crash leaves no half model that others would load
    return path


def load_causal_lm(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on the first real token of left-padded rows."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp_min(0)


def response_log_probs(model, input_ids, attention_mask, responses, temperature: float = 1.0,
                       with_entropy: bool = False):
    """log π(response token | everything before it) under `model` at `temperature`, for sequences
    laid out as [left-padded prompt | right-padded response]. Returns (log_probs, entropy or None)."""
    from hpcrl.algo import entropy_from_logits

    r = responses.shape[1]
    # only the positions that predict the response go through the output layer (a 150k vocabulary
    # over the whole prompt would be most of the step)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                   use_cache=False, logits_to_keep=r + 1).logits
    logits = logits[:, -r - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return logp, (entropy_from_logits(logits) if with_entropy else None)


def log_probs_head(temperature: float, with_entropy: bool):
    """The actor's and reference's forward for an engine: {"log_probs"[, "entropy"]} of a micro-batch."""
    def forward(model, mb) -> dict:
        logp, ent = response_log_probs(model, mb["input_ids"], mb["attention_mask"], mb["responses"], temperature,
                                       with_entropy)
        return {"log_probs": logp} | ({"entropy": ent} if with_entropy else {})
    return forward
