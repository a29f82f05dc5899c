"""A slow scorer as a role of its own: jobs/rule_engine.py's rule, answered after `seconds` per
batch, like a remote verifier (an API, a sandbox that runs the code) would be.

    roles:
      verifier: {partition: cpu, worker: hpcrl.jobs.slow_scorer:SlowRuleEngine, worker_args: {seconds: 5}}
    train:
      rewards: [{role: reward}, {role: verifier, method: compute_rule_score, weight: 0.5}]

Sequentially (train.pipeline: off) every step waits `seconds` for it. Pipelined (one_step_off,
with a separate rollout role) it scores batch k+1 while step k trains, so it costs the step only
what it takes beyond the training: a verifier slower than the step still sets the step
(`python bench/pipeline.py --slow-scorer S` measures both).
"""
import time

import hpcrl
from hpcrl.jobs.rule_engine import RuleEngineWorker


class SlowRuleEngine(RuleEngineWorker):
    def __init__(self, seconds: float = 5.0, length_bonus: float = 1.0):
        super().__init__(length_bonus)
        self.seconds = seconds

    @hpcrl.register(dispatch=hpcrl.Dispatch.DP_COMPUTE)
    def compute_rule_score(self, batch: hpcrl.Batch) -> hpcrl.Batch:
        time.sleep(self.seconds)
        return super().compute_rule_score(batch)
