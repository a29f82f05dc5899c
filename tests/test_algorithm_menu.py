"""The algorithm menu (docs/pages/algorithms/menu.md) on a real tiny Qwen2 (torch, CPU): each
critic-free estimator and each loss option of the spec takes a PPO step from one real sampled batch
through the built-in loop's functions (compute_advantages, groups_to_train, the actor's loss), and
one of them learns the tiny task in the built-in loop (tests/test_ppo.py learns GRPO and PPO)."""
import math

import numpy as np
import pytest
import torch
from conftest import LEARNING_STEPS, run_local
from test_ppo import TOK, learning_spec

from hpcrl.algo import FixedKLController
from hpcrl.controller import local_worker
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.loop import compute_advantages, groups_to_train, prepare_inputs
from hpcrl.ppo.roles import ActorRollout

N_SAMPLES = 4
BASE = dict(batch_size=8, n_samples=N_SAMPLES, mini_batch_size=32, micro_batch_size=16, ppo_epochs=1, warmup_steps=0,
            actor_lr=1e-3, entropy_coef=0.0, kl_coef=0.01, kl_in_reward=True)

MENU = {       # algorithm: settings (the menu's own exist only in the section, not as flat keys)
    "rloo": dict(advantage="rloo"),
    "reinforce_pp": dict(advantage="reinforce_pp", gamma=0.9),
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline"),
    "dr_grpo": dict(advantage="grpo", grpo_std_normalize=False, loss_agg_mode="seq-mean-token-sum-norm"),
    "gspo": dict(advantage="grpo", policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
                 loss_agg_mode="seq-mean-token-mean"),
    "dapo": dict(advantage="grpo", clip_high=0.28, dynamic_sampling=True, overlong_buffer=1, overlong_penalty=0.5),
}


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """A real batch of 8 prompts × 4 responses with the initial weights' log-probs, seeded random
    scores (an untrained policy scores 0 on almost everything), all equal in group 0."""
    cfg = TrainConfig().updated(**BASE)
    model_dir, prompts = prepare_inputs(cfg, tmp_path_factory.mktemp("menu"))
    actor = local_worker(ActorRollout, str(model_dir), cfg)
    prompts = PromptDataset(prompts, TOK, cfg.data.batch_size, cfg.seed).next_batch().repeat(N_SAMPLES)
    prompts["group"] = np.repeat(np.arange(cfg.data.batch_size), N_SAMPLES)
    batch = actor.generate_sequences(prompts)
    batch = batch.union(actor.compute_log_prob(batch))
    scores = torch.as_tensor(np.random.default_rng(44).uniform(size=len(batch)), dtype=torch.float32)
    scores[:N_SAMPLES] = 1.0
    batch["scores"] = scores
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.05
    return model_dir, batch


@pytest.mark.parametrize("name", MENU)
def test_each_algorithm_takes_a_step_that_follows_its_advantages(sampled, name):
    model_dir, batch = sampled
    cfg = TrainConfig().updated(**BASE, algorithm=MENU[name])
    assert not cfg.problems() and not cfg.algorithm.uses_critic
    trained = groups_to_train(batch, cfg)
    assert len(trained) == len(batch) - (N_SAMPLES if cfg.algorithm.dynamic_sampling else 0)
    compute_advantages(trained, cfg, FixedKLController(cfg.algorithm.kl_coef))
    adv, mask = trained["advantages"], trained["response_mask"].float()
    assert torch.isfinite(adv).all() and (adv * mask).abs().sum() > 0
    actor = local_worker(ActorRollout, str(model_dir), cfg)       # the initial weights, as `sampled`'s
    stats = actor.update_actor(trained)
    assert math.isfinite(stats["pg_loss"]) and math.isfinite(stats["grad_norm"])
    moved = (actor.compute_log_prob(trained)["old_log_probs"] - trained["old_log_probs"]) * mask
    assert moved.abs().max() > 0, "the update left the policy as it was"
    # one optimizer step from π_old raises the log-probs where the advantages are positive, to first order
    assert float((adv * moved).sum()) > 0, (name, float((adv * moved).sum()))


def test_rloo_with_dynamic_sampling_learns_the_tiny_task_locally(tmp_path):
    """jobs/tiny-cpu-grpo.yaml with advantage rloo and dynamic_sampling (one refill a step at most),
    LEARNING_STEPS of it, in the built-in loop: the bar is the GRPO test's (tests/test_ppo.py). The other estimators take one step
    above; each learning run costs about as much as this one, so only this one runs in CI."""
    cfg = TrainConfig.parse(learning_spec("tiny-cpu-grpo.yaml")).updated(
        total_steps=LEARNING_STEPS, progress=False, algorithm={"advantage": "rloo", "dynamic_sampling": True, "refills": 1})
    records = run_local(tmp_path, cfg)
    first = np.mean([r["reward/mean"] for r in records[:5]])
    last = np.mean([r["reward/mean"] for r in records[-10:]])
    assert first <= 0.15, first
    assert last >= 0.9, (first, last)
    kept, refills = [r["batch/kept_groups"] for r in records], [r["batch/refills"] for r in records]
    assert max(refills) == 1 and min(kept) < cfg.data.batch_size     # some steps refilled, some still fell short
    # a step trains on a full batch of groups unless its refill was spent
    assert all(k == cfg.data.batch_size or r == 1 for k, r in zip(kept, refills)), list(zip(kept, refills))
