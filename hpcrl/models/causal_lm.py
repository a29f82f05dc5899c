"""Models are Hugging Face causal LMs in a local directory (config + weights + tokenizer): never a
hub download at run time. On CPU a tiny Qwen2 is built from its config, once, into the run
directory, so every role loads the same initial weights (and once into the user's cache, from
which the next run with the same one copies it)."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from hpcrl.files import cache_dir
from hpcrl.models import plain_decoder
from hpcrl.models.packing import PACKED, Packed, to_rows
from hpcrl.models.size import tiny_qwen2_fields
from hpcrl.models.tokenizer import CharTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # no load reports in every worker's log
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def tiny_qwen2_config(vocab_size: int, **sizes):
    """Qwen2-shaped, of the sizes hpcrl.models.size.tiny_qwen2_fields takes; head_dim = hidden_size /
    heads must be ≥ 32 (vLLM's CPU attention needs it)."""
    from transformers import Qwen2Config

    fields = tiny_qwen2_fields(vocab_size, **sizes)
    if fields["hidden_size"] // fields["num_attention_heads"] < 32:
        raise ValueError(f"head_dim {fields['hidden_size'] // fields['num_attention_heads']} < 32: raise hidden_size "
                         "or lower heads")
    del fields["model_type"]
    return Qwen2Config(**fields, bos_token_id=CharTokenizer.bos_id, eos_token_id=CharTokenizer.eos_id,
                       pad_token_id=CharTokenizer.pad_id)


def create_model_dir(path: Path, tokenizer: CharTokenizer, seed: int, **config) -> Path:
    """Random tiny Qwen2 weights (seeded) + tokenizer, saved in HF format. Kept if already there.
    Copied from the user's cache where an earlier run built the same one (same bytes): building it
    imports transformers, seconds of every fresh run's start otherwise."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cached = _cached_tiny_model(tokenizer, seed, config)
    if cached is not None:
        shutil.copytree(cached, tmp)
    else:
        _build_tiny_model(tmp, tokenizer, seed, config)
    os.replace(tmp, path)   # a crash leaves no half model that others would load
    return path


def _build_tiny_model(path: Path, tokenizer: CharTokenizer, seed: int, config: dict) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(tokenizer.vocab_size, **config))
    model.save_pretrained(path)
    tokenizer.save(path)


def _cached_tiny_model(tokenizer: CharTokenizer, seed: int, config: dict) -> Path | None:
    """The tiny model under cache_dir(), built there first if missing: one per alphabet, seed,
    shape and the transformers and torch versions that build it. None where the cache cannot be
    written (the run builds its own)."""
    from importlib.metadata import version

    key = json.dumps({"chars": tokenizer.chars, "seed": seed, "config": config, "torch": torch.__version__,
                      "transformers": version("transformers")}, sort_keys=True)
    cached = cache_dir() / "tiny-models" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (cached / "config.json").exists():
        return cached
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        _build_tiny_model(tmp, tokenizer, seed, config)
        os.replace(tmp, cached)
    except OSError:   # read-only cache, or another run's copy landed first
        shutil.rmtree(tmp, ignore_errors=True)
    return cached if (cached / "config.json").exists() else None


def load_causal_lm(path: Path, dtype=torch.float32, device: torch.device | str | None = None, plain: bool = False):
    """The causal LM in `path`, in `dtype`; straight onto a GPU `device` where it can be (straight_to).
    `plain`: in plain torch where `path` holds a model hpcrl.models.plain_decoder loads (the tiny model a run
    builds, a small Qwen2 or Llama: no transformers import); not for a module peft adapts, which takes
    transformers' classes only."""
    if plain and plain_decoder.loads(path):
        return plain_decoder.load(path, dtype, device)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **straight_to(device))


def saved_weights(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor] | None:
    """The weights of the model folder `path` by their Hugging Face names, read from its safetensors
    file or shards straight onto `device`, without building the model (a GPU rollout engine keeps
    its own copy); None where the folder keeps them otherwise (pytorch_model.bin)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        return None
    from safetensors.torch import load_file

    return {name: t for f in files for name, t in load_file(folder / f, device=str(device)).items()}


def straight_to(device: torch.device | str | None) -> dict:
    """from_pretrained's keywords that load a model straight onto a GPU `device` (a 7B model never
    whole in host memory): transformers does it through accelerate, where that is installed; without
    it (or on the host) the model loads on the host, and the engine moves it."""
    if device is None or torch.device(device).type == "cpu" or importlib.util.find_spec("accelerate") is None:
        return {}
    return {"device_map": device}


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on the first real token of left-padded rows."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp_min(0)


# Causal LMs whose logits are exactly lm_head(final hidden state): the chunked head below is only
# exact for those. Any other model (soft-capped or scaled logits, …) takes the full-logits path.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# the fp32 logits of one chunk of positions, by device type: on a GPU fewer, larger products (an
# actor update of bench/gpu_ppo.py's shape 7% sooner on an H200 than with 256 MiB chunks)
HEAD_CHUNK_BYTES = {"cuda": 2**30, "cpu": 256 * 2**20}


def response_log_probs(model, input_ids, attention_mask, responses, temperature: float = 1.0,
                       with_entropy: bool = False, chunk_tokens: int | None = None, compile: bool = False,
                       packed: bool = False):
    """log π(response token | everything before it) under `model` at `temperature`, for sequences
    laid out as [left-padded prompt | right-padded response]. Returns (log_probs, entropy or None),
    fp32, (b, r).

    Per response position, with final hidden state h, output weight W, next token y and temperature T:

        z = float(h·Wᵀ) / T                  (h·Wᵀ in the autocast dtype, as the model's own head)
        log p = z − logsumexp(z)
        log π(y) = log p[y],    H = −Σ p·log p

    The output layer runs on chunks of `chunk_tokens` positions (default: as many as keep a chunk's
    fp32 logits within HEAD_CHUNK_BYTES: 1,766 positions on a GPU, 441 on CPU for a 151,936-token
    vocabulary), and its backward recomputes each chunk's logits: no (b, r, vocab) tensor is ever
    made or kept, the saved activations are the hidden states. Models without a plain linear head (not in
    PLAIN_HEAD_MODEL_TYPES) take the full logits instead. `compile`: on CUDA, each chunk's work after
    its matmul (softmax, gather, entropy; in the backward the gradient of the logits) is one
    Inductor kernel instead of a pass over the chunk's logits per operation. `packed`: the forward
    runs on the rows packed into one without padding (hpcrl.models.packing), the results the same."""
    from torch.nn.parallel import DistributedDataParallel

    lm = model.module if isinstance(model, DistributedDataParallel) else model
    head = _plain_output_layer(lm)
    # Only the positions that predict the response go through the output layer (a 150k vocabulary
    # over the whole prompt would be most of the step): the last r + 1 of each padded row (the first r
    # of them predict), or, packed, the n that predict the real response tokens.
    if packed:
        pk = Packed.of(input_ids, attention_mask)
        keep, valid = pk.response_positions(responses.shape[1])
        inputs = {"input_ids": pk.input_ids, "position_ids": pk.position_ids, "logits_to_keep": keep}
        labels = responses[valid][None]
    else:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "position_ids": position_ids(attention_mask), "logits_to_keep": responses.shape[1] + 1}
        labels = responses
    if head is None:
        logp, ent = _full_logits_log_probs(model, inputs, labels, temperature, with_entropy)
    else:
        # The scorer takes the head's place inside the model's forward, where a data-parallel wrapper
        # has the head's weight gathered (FSDP2) and counts it as used (DDP).
        with _output_layer(lm, _ResponseScorer(head, labels, temperature, with_entropy, chunk_tokens, compile)):
            scores = model(**inputs, use_cache=False).logits
        logp, ent = scores[..., 0], (scores[..., 1] if with_entropy else None)
    if packed:
        logp, ent = to_rows(logp, valid), (to_rows(ent, valid) if with_entropy else None)
    return logp, ent


def _full_logits_log_probs(model, inputs: dict, labels, temperature, with_entropy):
    """response_log_probs from the model's own logits of the positions that `inputs` keeps."""
    from hpcrl.algo import entropy_from_logits

    logits = model(**inputs, use_cache=False).logits
    logits = logits[:, :labels.shape[1]].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, (entropy_from_logits(logits) if with_entropy else None)


def _plain_output_layer(lm):
    """The causal LM's output layer when its logits are that bias-free linear layer of the final
    hidden states; None otherwise."""
    if getattr(getattr(lm, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = lm.get_output_embeddings()
    return head if isinstance(head, torch.nn.Linear) and head.bias is None else None


@contextmanager
def _output_layer(lm, layer: torch.nn.Module):
    """`layer` is lm's output layer for the duration."""
    original = lm.get_output_embeddings()
    lm.set_output_embeddings(layer)
    try:
        yield
    finally:
        lm.set_output_embeddings(original)


class _ResponseScorer(torch.nn.Module):
    """In place of the output layer during one forward whose first r kept positions predict the
    (b, r) response tokens: their (b, r, 1) log-probs, or (b, r, 2) log-probs and entropy."""

    def __init__(self, head: torch.nn.Linear, responses, temperature: float, with_entropy: bool,
                 chunk_tokens: int | None, compile: bool):
        super().__init__()
        self.head, self.responses, self.temperature = head, responses, temperature
        self.with_entropy, self.chunk_tokens, self.compile = with_entropy, chunk_tokens, compile

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, r = self.responses.shape
        h = hidden[:, :r].reshape(b * r, hidden.shape[-1])   # a padded row's last kept position predicts nothing of the response
        logp, ent = head_log_probs(h, self.head.weight, self.responses.reshape(-1), self.temperature,
                                   self.with_entropy, self.chunk_tokens, self.compile)
        return torch.stack([logp, ent] if self.with_entropy else [logp], dim=-1).view(b, r, 1 + self.with_entropy)


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                   with_entropy: bool, chunk_tokens: int | None = None, compile: bool = False):
    """(log π(y), H or None), fp32, of n positions from their final hidden states (n, d), the output
    layer's weight (V, d) and the next tokens (n,), as response_log_probs computes them: in chunks of
    positions, the matmuls in the autocast dtype (else the hidden states'), never all logits at once."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    chunk = chunk_tokens or max(1, HEAD_CHUNK_BYTES.get(device, HEAD_CHUNK_BYTES["cpu"]) // (4 * weight.shape[0]))
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, labels, temperature, dtype, chunk, with_entropy,
                                       compile and hidden.is_cuda)
    return logp, (ent if with_entropy else None)


def _chunk_log_softmax(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p of a chunk of positions: fp32 logits at the temperature, normalised."""
    return torch.log_softmax((h.to(w.dtype) @ w.T).float().div_(temperature), dim=-1)


def _chunk_scores(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float, with_entropy: bool):
    """log π(y) and, with_entropy, H of a chunk of positions (else None)."""
    lp = _chunk_log_softmax(h, w, temperature)
    return lp.gather(1, y[:, None]).squeeze(1), (-(lp.exp() * lp).sum(dim=-1) if with_entropy else None)


def _chunk_logit_grads(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float, g: torch.Tensor,
                       e: torch.Tensor | None, ent: torch.Tensor) -> torch.Tensor:
    """∂L/∂(h·Wᵀ) of a chunk in W's dtype, from g and e (already / T; e None: the loss has no entropy)."""
    lp = _chunk_log_softmax(h, w, temperature)
    p = lp.exp()
    dz = -g[:, None] * p if e is None else p * (-g[:, None] - e[:, None] * (lp + ent[:, None]))
    return dz.scatter_add(1, y[:, None], g[:, None]).to(w.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


class _ChunkedLogProbs(torch.autograd.Function):
    """(log π(y), H) of n positions from their hidden states (n, d) and the output weight (V, d),
    `chunk` positions at a time; the matmuls run in `dtype`. Saves the inputs only: the backward
    recomputes each chunk's log p and applies, with g = ∂L/∂log π(y) and e = ∂L/∂H,

        ∂L/∂z = g·(onehot(y) − p) − e·p·(log p + H)

    then ∂L/∂h = (∂L/∂z / T)·W and ∂L/∂W = Σ_chunks (∂L/∂z / T)ᵀ·h (summed in fp32, whatever W's dtype)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, dtype, chunk, with_entropy, fused):
        w = weight.to(dtype)      # once, not per chunk
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        scores = _compiled(_chunk_scores) if fused else _chunk_scores
        for s in range(0, hidden.shape[0], chunk):
            lp, h = scores(hidden[s:s + chunk], w, labels[s:s + chunk], temperature, with_entropy)
            logp[s:s + chunk] = lp
            if with_entropy:
                ent[s:s + chunk] = h
        ctx.save_for_backward(hidden, weight, labels, ent)
        ctx.temperature, ctx.dtype, ctx.chunk, ctx.fused = temperature, dtype, chunk, fused
        ctx.set_materialize_grads(False)    # an entropy that the loss leaves out costs no backward pass
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, labels, ent = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        # 1/T folded into the per-position factors: ∂L/∂(h·Wᵀ) = ∂L/∂z / T
        g = (grad_logp if grad_logp is not None else hidden.new_zeros(hidden.shape[0], dtype=torch.float32))
        g = g / ctx.temperature
        e = grad_ent / ctx.temperature if grad_ent is not None and ent.numel() else None
        logit_grads = _compiled(_chunk_logit_grads) if ctx.fused else _chunk_logit_grads
        for s in range(0, hidden.shape[0], ctx.chunk):
            part = slice(s, s + ctx.chunk)
            h = hidden[part].to(ctx.dtype)
            dz = logit_grads(h, w, labels[part], ctx.temperature, g[part], None if e is None else e[part], ent[part])
            if grad_h is not None:
                grad_h[part] = dz @ w
            if grad_w is not None:
                grad_w += dz.T @ h
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def log_probs_head(temperature: float, with_entropy: bool, compile: bool = False):
    """The actor's and reference's forward for an engine: {"log_probs"[, "entropy"]} of a micro-batch."""
    def forward(model, mb) -> dict:
        logp, ent = response_log_probs(model, mb["input_ids"], mb["attention_mask"], mb["responses"], temperature,
                                       with_entropy, compile=compile, packed=mb.meta.get(PACKED, False))
        return {"log_probs": logp} | ({"entropy": ent} if with_entropy else {})
    return forward
