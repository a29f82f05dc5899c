"""Reference: the frozen initial policy, for the KL term."""
from __future__ import annotations

import torch

from hpcrl.config import PPOConfig
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.models import load_causal_lm, response_log_probs
from hpcrl.protocol import Batch


class Reference(Worker):
    def __init__(self, model_dir: str, cfg: dict):
        self.cfg = PPOConfig(**cfg)
        self.model = load_causal_lm(model_dir).eval().requires_grad_(False)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        with torch.no_grad():
            logp, _ = response_log_probs(self.model, batch["input_ids"], batch["attention_mask"], batch["responses"],
                                         self.cfg.temperature)
        return Batch({"ref_log_probs": logp})
