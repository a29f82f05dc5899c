"""The PPO pieces on a real tiny Qwen2 (torch, CPU), and the whole loop on a real local Ray."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import LEARNING_STEPS, ROOT, comparable, run_local, start_local_training

from hpcrl.controller import local_worker
from hpcrl.controller.batch import Batch
from hpcrl.models import CharTokenizer, response_log_probs
from hpcrl.observe.metrics import read_metrics
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.loop import compute_advantages, prepare_inputs
from hpcrl.ppo.roles import ActorRollout, Critic, RewardModel, RuleReward
from hpcrl.ppo.tasks import copy_digits as copy_task

TOK = CharTokenizer(copy_task.ALPHABET)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    run = tmp_path_factory.mktemp("ppo")
    cfg = TrainConfig(batch_size=16, mini_batch_size=16, micro_batch_size=8, ppo_epochs=1, warmup_steps=0)
    model_dir, prompts = prepare_inputs(cfg, run)
    return cfg, model_dir, prompts


def test_sampler_log_probs_equal_a_full_forward_with_left_padding(inputs):
    cfg, model_dir, _ = inputs
    actor = local_worker(ActorRollout, str(model_dir), cfg)
    ids = [TOK.encode("7="), TOK.encode("12345="), TOK.encode("40=")]
    width = max(map(len, ids))
    prompt = torch.tensor([[0] * (width - len(s)) + s for s in ids])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
    gen = actor.generate_sequences(Batch({"prompt_ids": prompt, "prompt_mask": mask}, meta={"step": 3}))
    # the KV-cache sampler's log-probs vs. one forward over the whole sequence, per row unpadded
    for i, seq in enumerate(ids):
        n = int(gen["response_mask"][i].sum())
        full = torch.tensor([seq + gen["responses"][i, :n].tolist()])
        ref, _ = response_log_probs(actor.engine.module, full, torch.ones_like(full), gen["responses"][i:i + 1, :n])
        torch.testing.assert_close(gen["rollout_log_probs"][i, :n], ref[0], atol=1e-5, rtol=1e-5)
    assert gen["responses"].shape[1] == cfg.rollout.max_new_tokens
    again = actor.generate_sequences(Batch({"prompt_ids": prompt, "prompt_mask": mask}, meta={"step": 3}))
    assert torch.equal(again["responses"], gen["responses"])   # seeded by (seed, step, rank)


def one_batch(cfg, model_dir, prompts):
    actor = local_worker(ActorRollout, str(model_dir), cfg)
    data = PromptDataset(prompts, TOK, cfg.data.batch_size, cfg.seed)
    batch = actor.generate_sequences(data.next_batch())
    batch = batch.union(actor.compute_log_prob(batch))
    return actor, batch


def test_a_ppo_step_raises_the_log_prob_of_advantaged_tokens(inputs):
    cfg, model_dir, prompts = inputs
    actor, batch = one_batch(cfg, model_dir, prompts)
    sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)[:, None]
    batch["advantages"] = sign * batch["response_mask"]
    stats = actor.update_actor(batch)
    after = actor.compute_log_prob(batch)["old_log_probs"]
    delta = (after - batch["old_log_probs"]) * batch["response_mask"]
    assert delta[0::2].sum() > 0 and delta[1::2].sum() < 0
    # first step from π_old: the ratio is 1, so the loss is −mean(A) over valid tokens
    m = batch["response_mask"].float()
    assert stats["pg_loss"] == pytest.approx(float(-(batch["advantages"] * m).sum() / m.sum()), abs=1e-5)


def test_a_critic_step_lowers_the_value_loss(inputs):
    cfg, model_dir, prompts = inputs
    _, batch = one_batch(cfg, model_dir, prompts)
    critic = local_worker(Critic, str(model_dir), cfg.updated(algorithm={'vf_clip': 0.0}, optim={'critic_lr': 1e-4}))
    batch = batch.union(critic.compute_values(batch))
    batch["returns"] = torch.ones_like(batch["values"]) * batch["response_mask"]
    m = batch["response_mask"].float()

    def mse():
        v = critic.compute_values(batch)["values"]
        return float(((v - batch["returns"]) ** 2 * m).sum() / m.sum())

    before = mse()
    for _ in range(3):
        critic.update_critic(batch)
    assert mse() < before


def test_rule_reward_and_advantages_on_a_real_batch(inputs):
    cfg, model_dir, prompts = inputs
    _, batch = one_batch(cfg, model_dir, prompts)
    reward = local_worker(RuleReward, str(model_dir), cfg.reward_function())
    scores = reward.compute_scores(batch)["scores"]
    expected = [copy_task.score(p, TOK.decode(r)) for p, r in zip(batch["prompt"], batch["responses"])]
    assert scores.tolist() == pytest.approx(expected)
    batch["scores"], batch["values"] = scores, torch.zeros_like(batch["old_log_probs"])
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    from hpcrl.algo import FixedKLController

    kl = compute_advantages(batch, cfg.updated(whiten_advantages=False, gamma=1.0, lam=1.0),
                            FixedKLController(0.5))
    assert kl["kl"] == pytest.approx(0.1, abs=1e-5)
    # γ = λ = 1, V = 0: the advantage of the first token is the sum of the row's rewards
    m = batch["response_mask"].float()
    expected_first = scores - 0.5 * 0.1 * m.sum(dim=1)
    torch.testing.assert_close(batch["advantages"][:, 0], expected_first, atol=1e-5, rtol=1e-5)


def test_copy_task_reward_bounds():
    rng = np.random.default_rng(0)
    prompts = ["".join(rng.choice(list("0123456789"), 2)) + "=" for _ in range(4000)]
    random_policy = [copy_task.score(p, TOK.decode(rng.integers(0, TOK.vocab_size, 3))) for p in prompts]
    assert np.mean(random_policy) <= 0.15
    assert all(copy_task.score(p, p[:-1]) == 1.0 for p in prompts)
    assert np.mean([copy_task.score(p, "00") for p in prompts]) < 0.2   # a fixed answer does not win


def test_dataset_cursor_resumes_exactly(inputs):
    _, _, prompts = inputs
    a = PromptDataset(prompts, TOK, 100, seed=3)
    for _ in range(45):   # crosses an epoch boundary (4096 prompts)
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch()["index"].tolist() for _ in range(3)]
    b = PromptDataset(prompts, TOK, 100, seed=3)
    b.load_state_dict(state)
    assert [b.next_batch()["index"].tolist() for _ in range(3)] == expected


def test_reward_model_scores_the_last_real_token(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hpcrl.models import tiny_qwen2_config

    cfg = tiny_qwen2_config(TOK.vocab_size)
    cfg.num_labels = 1
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path / "rm")
    rm = local_worker(RewardModel, str(tmp_path / "rm"))
    rows = [TOK.encode("12=") + [5, 6, TOK.eos_id], TOK.encode("1234=") + [7]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    got = rm.compute_scores(Batch({"input_ids": ids, "attention_mask": mask}))["scores"]
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([r])).logits[0, 0] for r in rows]
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-5)


def test_split_colocated_and_separate_rollout_layouts_give_identical_metrics(tmp_path):
    """The same seeds draw the same samples wherever generation runs: in actor_rollout, in a process
    shared with ref, or in a separate rollout role that gets the actor's weights after each update."""
    cfg = TrainConfig(total_steps=3, progress=False)
    layouts = {"split": cfg, "fused": cfg.updated(colocate=[["actor_rollout", "ref"], ["critic", "reward"]]),
               "apart": cfg.updated(rollout_role=True)}
    # the three at once, each on its own local Ray: a 3-step run is mostly its start
    runs = [start_local_training(tmp_path / name, c) for name, c in layouts.items()]
    assert [p.wait(timeout=900) for p in runs] == [0, 0, 0]
    split, fused, apart = (read_metrics(tmp_path / name / "metrics.jsonl") for name in layouts)
    assert len(split) == 3 and comparable(split) == comparable(fused) == comparable(apart)
    assert split[-1]["actor/pg_loss"] is not None and split[-1]["critic/vf_loss"] is not None


def learning_spec(name):
    import yaml

    return yaml.safe_load((ROOT / "jobs" / name).read_text())["train"]


def test_the_tiny_grpo_job_learns_locally(tmp_path):
    """jobs/tiny-cpu-grpo.yaml in local mode, LEARNING_STEPS of it (about 30 s on 2 cores; PPO's
    jobs/tiny-cpu.yaml learns as a hetjob below, and pipelined in tests/test_pipeline.py). The mean
    of the last 10 of 200 steps over seeds 1-5 (PPO) and 1-3 (GRPO, PPO with vLLM) was 0.970-0.999, the
    hetjob's equal to the local run's (pipelined PPO, seeds 1-3: 0.987, 0.998, 0.938); the earlier settings (actor_lr 1e-3,
    entropy_coef 0.01), whose policy grew sure of wrong digits, ended at 0.80-0.89 on most seeds.
    So the bar of 0.9 sits below every run seen (seed 1 at step 160: 0.96) and still fails such a collapse."""
    cfg = TrainConfig.parse(learning_spec("tiny-cpu-grpo.yaml")).updated(total_steps=LEARNING_STEPS, progress=False)
    records = run_local(tmp_path, cfg)
    first = np.mean([r["reward/mean"] for r in records[:5]])
    last = np.mean([r["reward/mean"] for r in records[-10:]])
    assert first <= 0.15, first           # a random policy
    assert last >= 0.9, (first, last)


@pytest.mark.slurm
def test_ppo_hetjob_learns_on_the_local_cluster(slurm_cluster, tmp_path):
    """The README's demo, jobs/tiny-cpu.yaml as a 3-component hetjob with each role on its partition,
    for LEARNING_STEPS."""
    import re

    run = tmp_path / "run"
    total = LEARNING_STEPS
    out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", "jobs/tiny-cpu.yaml", "--run-dir", str(run),
                          f"train.total_steps={total}", "--wait"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr + (run / "logs").joinpath(
        next((run / "logs").glob("slurm-*.out")).name).read_text()
    assert f"metrics: {run / 'metrics.jsonl'}" in out.stdout and "reward/mean" in out.stdout
    records = read_metrics(run / "metrics.jsonl")
    assert len(records) == total
    assert np.mean([r["reward/mean"] for r in records[:5]]) <= 0.15
    assert np.mean([r["reward/mean"] for r in records[-10:]]) >= 0.9
    alloc = json.loads((run / "allocation.json").read_text())
    for comp in alloc["components"]:
        for role in comp["members"]:
            first = (run / "logs" / role / "rank0.log").read_text().splitlines()[0]
            node_ip = re.search(r"\[" + role + r" rank0\] rank 0 of 1 on node (\S+),", first).group(1)
            assert node_ip in [n["addr"] for n in comp["nodes"]], (role, comp["partition"], first)

    # what a user sees after the job: status, one role's logs, all logs merged by time
    def hpcrl(*args):
        return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout
    st = json.loads(hpcrl("status", str(run), "--json"))
    assert [c["state"] for c in st["components"]] == ["COMPLETED"] * 3
    assert {r: c["partition"] for c in st["components"] for r in c["roles"]} == {
        "actor_rollout": "a100", "critic": "h100", "ref": "cpu", "reward": "cpu"}
    assert st["run"]["state"] == "finished" and st["run"]["step"] == total and st["checkpoint"]["step"] == total
    for role, info in st["run"]["roles"].items():
        comp = next(c for c in st["components"] if role in c["roles"])
        assert info["state"] == "alive" and [r["node"] for r in info["ranks"]] == comp["nodes"], (role, info)
    critic = hpcrl("logs", str(run), "critic").splitlines()
    assert critic and all(line.startswith("critic/rank0  ") and "[critic rank0]" in line for line in critic)
    merged = hpcrl("logs", str(run)).splitlines()
    sources = {line.split()[0] for line in merged}
    assert {"driver", "actor_rollout/rank0", "critic/rank0", "ref/rank0", "reward/rank0"} <= sources
    # by time: every role was built (in its own file) before the driver's first step (in the Slurm output)
    first_step = next(i for i, line in enumerate(merged) if f"step 1/{total} " in line)
    for role in st["run"]["roles"]:
        assert next(i for i, line in enumerate(merged) if f"[{role} rank0] rank 0 of 1 on node" in line) < first_step


def test_token_id_prompts_reach_the_reward_as_text(tmp_path):
    """A dataset of prompt_ids still gives a rule reward the prompt's text (not an empty string)."""
    path = tmp_path / "ids.jsonl"
    ids = [TOK.encode("12="), TOK.encode("345=")]
    path.write_text("".join(json.dumps({"prompt_ids": i}) + "\n" for i in ids))
    batch = PromptDataset(path, TOK, 2, seed=0).next_batch()
    assert sorted(batch["prompt"]) == ["12=", "345="]
