"""Rollout in plain torch: batched sampling with a KV cache."""
from __future__ import annotations

import inspect

import torch

from hpcrl.algo import truncate_at_eos
from hpcrl.engines.base import SamplingParams
from hpcrl.models.causal_lm import position_ids


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the top_k largest, then the smallest set whose probability reaches top_p; the rest −inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= top_p   # mass before this token already enough
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None):
    """One token per row from the processed distribution, and its log-probability under it;
    temperature 0: the most likely token (greedy), with its log-probability at temperature 1.

    `noise`: independent Exp(1) draws shaped like `logits` (None when greedy). argmax p/E is a
    draw from p (the exponential race; Gumbel-max in another form): no host sync, no RNG state in the
    kernel, so a CUDA graph can hold the whole sampler and replay it on noise drawn outside."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    probs = torch.softmax(filter_logits(logits.float() / params.temperature, params.top_k, params.top_p), dim=-1)
    tok = (probs / noise).argmax(dim=-1)
    return tok, torch.log(probs.gather(1, tok[:, None]).squeeze(1).clamp_min(1e-30))


def draw_noise(shape, params: SamplingParams, generator: torch.Generator) -> torch.Tensor | None:
    """The Exp(1) draws sample_token needs for `shape` (None when greedy)."""
    if params.temperature == 0:
        return None
    return torch.empty(shape, device=generator.device).exponential_(generator=generator)


def sample_next(logits: torch.Tensor, noise: torch.Tensor | None, done: torch.Tensor, params: SamplingParams,
                pad_id: int, eos: torch.Tensor):
    """One decode step's sampling for every row: (token, its log-prob); rows already stopped get
    `pad_id`, and `done` (in place) marks the rows whose token is a stop token."""
    tok, logp = sample_token(logits, params, noise)
    tok = torch.where(done, torch.full_like(tok, pad_id), tok)
    done |= torch.isin(tok, eos)
    return tok, logp


def sample_loop(logits: torch.Tensor, advance, params: SamplingParams, generator: torch.Generator, pad_id: int,
                eos_ids: list[int]) -> dict[str, torch.Tensor]:
    """The sampling loop of the HF-module engine: one token per row from `logits`, pad after a row's
    stop token, `advance(tokens)` -> the next logits; stops when every row has stopped."""
    eos = torch.tensor(eos_ids, device=logits.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens, logps = [], []
    for i in range(params.max_new_tokens):
        tok, logp = sample_next(logits, draw_noise(logits.shape, params, generator), done, params, pad_id, eos)
        tokens.append(tok)
        logps.append(logp)
        if i == params.max_new_tokens - 1 or bool(done.all()):
            break
        logits = advance(tok)
    return finish_responses(torch.stack(tokens, dim=1), torch.stack(logps, dim=1), params, pad_id, eos_ids)


def finish_responses(tokens: torch.Tensor, logps: torch.Tensor, params: SamplingParams, pad_id: int,
                     eos_ids: list[int]) -> dict[str, torch.Tensor]:
    """(B, n) sampled tokens and log-probs -> the (B, max_new_tokens) layout every engine returns,
    cut after the first stop."""
    n = params.max_new_tokens
    responses, logp = tokens[:, :n].cpu(), logps[:, :n].float().cpu()
    pad = n - responses.shape[1]     # all stopped early: same width every call
    responses = torch.nn.functional.pad(responses, (0, pad), value=pad_id)
    logp = torch.nn.functional.pad(logp, (0, pad))
    responses, response_mask, has_eos = truncate_at_eos(responses, eos_ids, pad_id)
    return {"responses": responses, "response_mask": response_mask, "has_eos": has_eos,
            "rollout_log_probs": logp * response_mask}


class TorchRollout:
    """Samples with the training module itself (any HF causal LM), through its own KV cache."""
    shares_module = True     # nothing to load after an update: the trainer's module is the sampler's

    def __init__(self, model, pad_id: int, eos_ids: list[int]):
        self.model, self.pad_id, self.eos_ids = model, pad_id, list(eos_ids)
        # transformers 5 renamed past_key_values to cache (in and out); 4.x has the old name
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, cache, **inputs):
        out = self.model(**inputs, **({self.cache_kw: cache} if cache is not None else {}), use_cache=True)
        return out[self.cache_kw], out.logits[:, -1]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """New parameters (HF names). Only needed when the module is not the trainer's own."""
        self.model.load_state_dict(weights)

    def sleep(self) -> None:
        """Nothing to free: the module is the one the trainer holds."""

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 seed: int) -> dict[str, torch.Tensor]:
        """prompt_ids (B, P) left-padded. Returns responses (B, R) padded after the first stop token,
        response_mask, has_eos and the sampler's log-probs (the training engine recomputes its own).
        One generator seeded with `seed` draws every row."""
        device = next(self.model.parameters()).device
        generator = torch.Generator(device).manual_seed(seed)
        self.model.eval()
        b = prompt_ids.shape[0]
        prompt_ids, mask = prompt_ids.to(device), prompt_mask.long().to(device)
        state = {"mask": mask, "pos": mask.sum(dim=1, keepdim=True)}
        state["cache"], logits = self._forward(None, input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids(mask))

        def advance(tok):
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(b, 1)], dim=1)
            state["cache"], next_logits = self._forward(state["cache"], input_ids=tok[:, None],
                                                        attention_mask=state["mask"], position_ids=state["pos"])
            state["pos"] = state["pos"] + 1
            return next_logits

        return sample_loop(logits, advance, params, generator, self.pad_id, self.eos_ids)
