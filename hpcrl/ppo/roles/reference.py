"""Reference: the frozen initial policy, for the KL term."""
from __future__ import annotations

from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register
from hpcrl.controller.batch import Batch
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import CompilesAhead, ModelRole, make_train_engine


class Reference(Checkpointed, CompilesAhead, ModelRole, Worker):
    frozen = elastic = True     # a new rank loads the same initial policy

    def __init__(self, model_dir: str, cfg: TrainConfig):
        self.cfg = cfg
        self.engine = make_train_engine(self.cfg, model_dir, "log_probs", self.device, lr=None)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return Batch({"ref_log_probs": self.engine.infer(batch, self.cfg.optim.micro_batch_size, self.cfg.optim.micro_batch_tokens)["log_probs"]})

    def checkpoint_state(self) -> dict:
        return self.engine.state_dict()

    def load_checkpoint_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)
