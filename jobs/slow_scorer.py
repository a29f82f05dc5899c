"""Slow scorers, like a remote verifier (an API, a sandbox that runs the code) would be.

`score`: the copy task's rule as the reward role's function, 20 ms a sample (batched), the scorer of
jobs/tiny-cpu-elastic.yaml, whose reward role `hpcrl scale` grows: three ranks score a batch in a
third of the time (`python bench/elastic.py` measures it).

`SlowRuleEngine`: jobs/rule_engine.py's rule as a role of its own, answered after `seconds` per batch:

    roles:
      verifier: {partition: cpu, worker: hpcrl.jobs.slow_scorer:SlowRuleEngine, worker_args: {seconds: 5}}
    train:
      rewards: [{role: reward}, {role: verifier, method: compute_rule_score, weight: 0.5}]

Sequentially (train.rollout.pipeline: off) every step waits `seconds` for it. Pipelined (one_step_off,
with a separate rollout role) it scores batch k+1 while step k trains, so it costs the step only
what it takes beyond the training: a verifier slower than the step still sets the step
(`python bench/pipeline.py --slow-scorer S` measures both).
"""
import time

import hpcrl
from hpcrl.jobs.rule_engine import RuleEngineWorker
from hpcrl.ppo.tasks.copy_digits import score as copy_score

SECONDS_PER_SAMPLE = 0.02


def score(prompts: list[str], responses: list[str], **_) -> list[float]:
    time.sleep(SECONDS_PER_SAMPLE * len(prompts))
    return [copy_score(p, r) for p, r in zip(prompts, responses)]


class SlowRuleEngine(RuleEngineWorker):
    def __init__(self, seconds: float = 5.0, length_bonus: float = 1.0):
        super().__init__(length_bonus)
        self.seconds = seconds

    @hpcrl.register(dispatch=hpcrl.Dispatch.DP_COMPUTE)
    def compute_rule_score(self, batch: hpcrl.Batch) -> hpcrl.Batch:
        time.sleep(self.seconds)
        return super().compute_rule_score(batch)
