"""A role of your own: a rule engine that adds a format score, on its own partition.

    roles:
      rule_engine: {partition: cpu, worker: hpcrl.jobs.rule_engine:RuleEngineWorker,
                    worker_args: {length_bonus: 1.0}}
    train:
      rewards: [{role: reward}, {role: rule_engine, method: compute_rule_score, weight: 0.5}]

The driver calls `compute_rule_score` on every generated batch (the batch goes from the rollout's
ranks to this role's without passing through the driver), logs its mean as score/rule_engine and
adds 0.5 × it to each sample's score. No line of hpcrl changes (jobs/tiny-cpu-rules.yaml runs it).
"""
import torch

import hpcrl


class RuleEngineWorker(hpcrl.Worker):
    """score = length_bonus when the response stops (the stop token) right after as many tokens as
    the prompt has digits: the copy task's answer format, whatever the digits."""

    def __init__(self, length_bonus: float = 1.0):
        # batches scored: its state, saved in the role's checkpoint file and restored on resume
        self.length_bonus, self.batches = length_bonus, 0

    # each rank scores its share of the batch; the call changes the role's state (its count): a rank
    # rebuilt before the next snapshot takes its state back, and the calls since are made again
    @hpcrl.register(dispatch=hpcrl.Dispatch.DP_COMPUTE, changes_state=True)
    def compute_rule_score(self, batch: hpcrl.Batch) -> hpcrl.Batch:
        self.batches += 1
        digits = torch.tensor([len(p.rstrip("=")) for p in batch["prompt"]])
        answered = batch["response_mask"].sum(dim=1) - batch["has_eos"].long()   # tokens before the stop
        right = batch["has_eos"] & (answered == digits)
        return hpcrl.Batch({"scores": right.float() * self.length_bonus})

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]
