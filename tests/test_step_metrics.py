"""A step's record (hpcrl/ppo/step_metrics.py) from a hand-made batch: the policy versions its
samples carry give its staleness, checked against lags counted by hand."""
import numpy as np
import torch

from hpcrl.controller.batch import Batch
from hpcrl.ppo.step_metrics import entry, step_record


def batch(versions: list[int]) -> Batch:
    n = len(versions)
    return Batch({"response_mask": torch.ones(n, 3), "prompt_mask": torch.ones(n, 2), "scores": torch.arange(n).float(),
                  "entropy": torch.zeros(n, 3), "has_eos": torch.ones(n, dtype=torch.bool),
                  "policy_version": torch.tensor(versions)},
                 {"group": np.repeat(np.arange(n // 2), 2)}, meta={"policy_version": versions[0]})


def test_a_step_whose_refill_was_sampled_with_older_weights_logs_its_staleness_histogram():
    # the step's batch (version 5: one group) and a refill (version 3: two groups); dynamic sampling
    # kept the refill's groups
    both = Batch.concat([batch([5, 5]), batch([3, 3, 3, 3])])
    trained = both.index(torch.tensor([False, False, True, True, True, True]))
    record = step_record(7, both, trained, ["reward"], {}, {}, None, 6, {}, 1.0, 1.0, {})
    # trained by the actor of version 6: lags 3, 3, 3, 3; the samples dropped (lag 1) do not count
    assert (record["policy/version"], record["policy/lag"]) == (3, 3)
    assert {k: v for k, v in record.items() if k.startswith("policy/lag/")} == {"policy/lag/3": 1.0}
    # the batch's group and the refill's first: lags 1, 1, 3, 3
    trained = both.index(torch.tensor([True, True, True, True, False, False]))
    record = step_record(7, both, trained, ["reward"], {}, {}, None, 6, {}, 1.0, 1.0, {})
    assert (record["policy/lag"], record["policy/lag/1"], record["policy/lag/3"]) == (3, 0.5, 0.5)
    assert all(entry(k) for k in record)          # every key is in the registry


def test_a_step_that_kept_no_group_counts_the_samples_it_generated():
    both = batch([4, 4])
    record = step_record(5, both, both.index(torch.tensor([False, False])), ["reward"], {}, {}, None, 5, {}, 1.0, 1.0, {})
    assert (record["policy/lag"], record["policy/lag/1"]) == (1, 1.0)
