"""Reference: the frozen initial policy, for the KL term."""
from __future__ import annotations

import torch

from hpcrl.config import PPOConfig
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.models import load_causal_lm, response_log_probs
from hpcrl.protocol import Batch
from hpcrl.workers.common import Checkpointed


class Reference(Checkpointed, Worker):
    frozen = True

    def __init__(self, model_dir: str, cfg: dict):
        self.cfg = PPOConfig(**cfg)
        self.model = load_causal_lm(model_dir).eval().requires_grad_(False)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        with torch.no_grad():
            logp, _ = response_log_probs(self.model, batch["input_ids"], batch["attention_mask"], batch["responses"],
                                         self.cfg.temperature)
        return Batch({"ref_log_probs": logp})

    def checkpoint_state(self) -> dict:
        return {"model": self.model.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
