"""Rollout in plain torch: batched sampling with a KV cache."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from hpcrl.algo import truncate_at_eos
from hpcrl.models.causal_lm import position_ids


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0: no top-k


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


class TorchRollout:
    def __init__(self, model, pad_id: int, eos_ids: list[int]):
        self.model, self.pad_id, self.eos_ids = model, pad_id, list(eos_ids)
        # transformers 5 renamed past_key_values to cache (in and out); 4.x has the old name
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, cache, **inputs):
        out = self.model(**inputs, **({self.cache_kw: cache} if cache is not None else {}), use_cache=True)
        return out[self.cache_kw], out.logits[:, -1]

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
        generator = torch.Generator().manual_seed(seed)
        self.model.eval()
        b = prompt_ids.shape[0]
        mask = prompt_mask.long()
        cache, logits = self._forward(None, input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids(mask))
        next_pos = mask.sum(dim=1, keepdim=True)
        tokens, logps = [], []
        done = torch.zeros(b, dtype=torch.bool)
        for _ in range(params.max_new_tokens):
            scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
            probs = torch.softmax(scaled, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            logps.append(torch.log(probs.gather(1, tok[:, None]).squeeze(1).clamp_min(1e-30)))
            tokens.append(tok)
            done |= torch.isin(tok, torch.tensor(self.eos_ids))
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            cache, logits = self._forward(cache, input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos)
            next_pos = next_pos + 1
        responses = torch.stack(tokens, dim=1)
        pad = params.max_new_tokens - responses.shape[1]    # all stopped early: same width every call
        responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_id)
        logp = torch.nn.functional.pad(torch.stack(logps, dim=1), (0, pad))
        responses, response_mask, has_eos = truncate_at_eos(responses, self.eos_ids, self.pad_id)
        return {"responses": responses, "response_mask": response_mask, "has_eos": has_eos,
                "rollout_log_probs": logp * response_mask}
