"""Pipelined steps (train.pipeline: one_step_off, async) on real local Ray: the rollout generates
ahead, weight-free scoring runs while the step before trains, the recorded policy versions, a role
rebuilt while the rollout goes on, and an asynchronous run's buffer kept by its checkpoint. Times
come from the roles' own calls files (logs/<role>/rank0.calls.jsonl, written by each worker process)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import LEARNING_STEPS, ROOT, comparable, kill_dead, run_local, start_local_training, wait_until

from hpcrl.observe.logs import read_calls
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.status import read_events
from hpcrl.ppo.config import TrainConfig

PIPELINED = dict(rollout_role=True, pipeline="one_step_off", progress=False)

SLOW_SCORER = '''
import time
from hpcrl.ppo.tasks.copy_digits import score as copy_score

def score(prompts, responses, **_):
    time.sleep(0.5)           # a slow verifier: half a second per batch
    return [copy_score(p, r) for p, r in zip(prompts, responses)]
'''


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_a_slow_scorer_scores_batches_ahead_while_the_step_before_trains(tmp_path, monkeypatch):
    (tmp_path / "slow_scorer.py").write_text(SLOW_SCORER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))        # the driver's, and so the Ray workers'
    cfg = TrainConfig(total_steps=8, max_staleness=2, reward_fn="slow_scorer:score", reward_batched=True, tis_cap=2.0,
                    **PIPELINED).updated(algorithm={"mis_band": [0.5, 2.0]})
    records = run_local(tmp_path / "run", cfg)
    # two batches in flight: step k trains on weights k-1, on a batch sampled with weights k-3
    assert [r["policy/lag"] for r in records] == [0, 1, 2, 2, 2, 2, 2, 2]
    assert [r["policy/version"] for r in records] == [0, 0, 0, 1, 2, 3, 4, 5]
    # the sampler's log-probs equal the actor's while their weights are the same, and differ after
    assert records[0]["rollout/log_prob_diff"] < 1e-4 < records[-1]["rollout/log_prob_diff"]
    # masked importance sampling drops no token while the two policies are one (ratio 1)
    assert records[0]["actor/mis_masked"] == 0 and all(0 <= r["actor/mis_masked"] < 1 for r in records), records
    calls = read_calls(tmp_path / "run")
    scored = {c["step"]: c for c in calls["reward"] if c["method"] == "compute_scores"}
    updated = {c["step"]: c for c in calls["actor_rollout"] if c["method"] == "update_actor"}
    assert sorted(scored) == sorted(updated) == list(range(1, 9))
    # while the actor trained step k, the reward role was scoring a batch of a later step (sequentially:
    # never). Not every step: on a loaded machine a batch's generation can start late (three tests at a
    # time on 2 cores: steps 2-6 but 5 once)
    hidden = [k for k in range(2, 7) if any(overlap(scored[j], updated[k]) for j in (k + 1, k + 2))]
    assert len(hidden) >= 3, {k: (scored[k], updated[k]) for k in scored}


def test_an_async_run_stays_within_its_staleness_bound_and_resumes_its_buffer_bitwise(tmp_path):
    """pipeline: async, max_staleness 2, a checkpoint at step 4 holding the buffer. Which weights a
    batch gets depends on how fast each side runs; what a resumed run trains does not: the
    buffered batches bitwise, and every later step whose batch got the same weights as in the run
    that went on uninterrupted (a batch is its prompts, its seed and its weights)."""
    k, total = 2, 8
    cfg = TrainConfig(total_steps=total, max_staleness=k, save_every=4, rollout_role=True, pipeline="async",
                      progress=False, tis_cap=2.0).updated(checkpoint={"keep_last": 2})
    once, twice = tmp_path / "once", tmp_path / "twice"
    records = run_local(once, cfg)
    lags, versions = [r["policy/lag"] for r in records], [r["policy/version"] for r in records]
    assert lags[0] == 0 and all(0 <= lag <= k for lag in lags), lags
    assert versions == sorted(versions), versions      # each batch samples with weights no older than the one before
    assert all(0 <= r["buffer/depth"] <= k + 1 and r["timing/rollout_idle"] >= 0 for r in records), records
    generated = sorted((c for c in read_calls(once)["rollout"] if c["method"] == "generate_sequences"),
                       key=lambda c: c["start"])
    # batches 1..8 (numbered as drawn), each generated once, one at a time: the next given to the
    # rollout only once the one before was done, so the weights sent meanwhile came first
    assert [c["step"] for c in generated] == list(range(1, total + 1))
    assert all(a["end"] <= b["start"] for a, b in zip(generated, generated[1:])), generated
    # the rollout's throughput with its newest version so far: its batches' tokens over their calls' seconds
    # as the driver saw them, which hold the rollout's own (its calls log): never more than the fastest of
    # those batches by the rollout's own seconds (batch b trained at step b here)
    seconds = {c["step"]: c["end"] - c["start"] for c in generated}
    said = [(r["step"], r["throughput/rollout_version"], r["throughput/rollout_tokens_per_s"]) for r in records
            if "throughput/rollout_version" in r]
    for step, version, rate in said:
        rates = [r["response_length/mean"] * cfg.data.batch_size * cfg.rollout.n_samples / seconds[r["step"]]
                 for r in records[:step] if r["policy/version"] == version]
        assert rates and 0 < rate <= max(rates) + 0.1, (step, version, rate, rates)
    assert said and [v for _, v, _ in said] == sorted(v for _, v, _ in said), said
    manifest = json.loads((once / "ckpt" / "step_00000004" / "MANIFEST.json").read_text())
    assert "inflight" in manifest, manifest

    # the same run from its checkpoint of step 4: the buffer (batches 5 and 6) comes back with it
    shutil.copytree(once, twice, ignore=shutil.ignore_patterns("ray", "logs"))
    shutil.rmtree(twice / "ckpt" / "step_00000008")
    (twice / "ckpt" / "LATEST").write_text("step_00000004\n")
    resumed = run_local(twice, cfg)
    assert [r["step"] for r in resumed] == list(range(1, total + 1))
    again = [c["step"] for c in read_calls(twice)["rollout"] if c["method"] == "generate_sequences"]
    assert sorted(again) == [7, 8], again      # 5 and 6 were in the checkpoint
    same = next((i for i in range(4, total) if resumed[i]["policy/version"] != versions[i]), total)
    assert same >= 6, (versions, [r["policy/version"] for r in resumed])
    assert comparable(resumed[:same]) == comparable(records[:same])


def test_the_score_before_training_is_the_first_weights_answered_while_the_first_step_trains(tmp_path):
    """validation.before_train with a rollout role of its own: the held-out prompts go to the rollout
    behind the first step's batch and before the first update's weights (the order of its calls), and
    the score is the untrained policy's: a run whose updates change nothing (lr 1e-30, below a float32
    ulp of every weight) scores the same before training, while this run's updates change the score."""
    held_out = tmp_path / "held_out.jsonl"
    rng = np.random.default_rng(7)
    held_out.write_text("".join(json.dumps({"prompt": f"{n}="}) + "\n" for n in rng.integers(10, 100, 24)))
    cfg = TrainConfig(total_steps=4, val_dataset=str(held_out), val_before_train=True, val_every=4, save_every=0,
                      actor_lr=3e-2, **PIPELINED)
    records = run_local(tmp_path / "trained", cfg)
    frozen = run_local(tmp_path / "frozen", cfg.updated(optim={"actor_lr": 1e-30}))
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    val = lambda r: {k: v for k, v in r.items() if k.startswith("val/")}   # noqa: E731
    assert val(records[0]) == val(frozen[0]) == val(frozen[-1]), (records[0], frozen[0], frozen[-1])
    assert val(records[-1]) != val(frozen[-1]), (records[-1], frozen[-1])   # the updates do change the score
    calls = [c for c in read_calls(tmp_path / "trained")["rollout"]
             if c["method"] in ("generate_sequences", "receive_weights")]
    order = [(c["method"], c["step"]) for c in sorted(calls, key=lambda c: c["start"])]   # weights: no step
    first = order.index(("generate_sequences", 1))
    update = next(i for i, (method, _) in enumerate(order) if method == "receive_weights" and i > first)
    held_out = [i for i, call in enumerate(order) if call == ("generate_sequences", 0)]
    assert held_out and first < min(held_out) and max(held_out) < update, order


def test_while_the_critic_is_rebuilt_the_rollout_has_the_next_batch_in_hand(tmp_path):
    run = tmp_path / "run"
    proc = start_local_training(run, TrainConfig(total_steps=30, **PIPELINED))
    wait_until(lambda: len(read_metrics(run / "metrics.jsonl")) >= 3, 300, "3 steps")
    pid = json.loads((run / "status.json").read_text())["roles"]["critic"]["ranks"][0]["pid"]
    calls = run / "logs" / "critic" / "rank0.calls.jsonl"

    def frozen_before_its_update() -> bool:
        """Freeze the critic and look: its last finished call computed a step's values, so that
        step's update is running or next. Otherwise let it go on. Frozen, it cannot move on between
        the look and the kill (a fast step ends between two polls of a file)."""
        os.kill(pid, signal.SIGSTOP)
        lines = calls.read_text().split("\n")[:-1]     # whole lines only
        if lines and json.loads(lines[-1])["method"] == "compute_values":
            return True
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
        return False
    wait_until(frozen_before_its_update, 120, "the critic between its values and its update", poll=0)
    kill_dead(pid)
    assert proc.wait(timeout=600) == 0
    assert len(read_metrics(run / "metrics.jsonl")) == 30
    events = read_events(run)
    down = next(e for e in events if e["event"] == "rebuild" and e["role"] == "critic")
    back = next(e for e in events if e["event"] == "rebuilt" and e["role"] == "critic")
    step = down["step"]
    assert down["generating"] == [step + 1] and back["step"] == step
    # where the rebuild went: a new process's phases, within the rebuild's seconds
    assert list(back["phases"]) == ["process", "group", "imports", "model", "engine", "built"], back
    assert 0 < sum(back["phases"].values()) <= back["seconds"] <= back["time"] - down["time"] + 0.01, back
    # then, one after the other, its state back, the calls since it made again, what waits for it
    restore = back["restore"]
    assert set(restore) == {"state", "replay", "calls", "after"} and restore["state"] > 0, back
    assert sum(back["phases"].values()) + restore["state"] + restore["replay"] + restore["after"] <= back["seconds"] + 0.05
    generated = {c["step"]: c for c in read_calls(run)["rollout"] if c["method"] == "generate_sequences"}
    # sequentially, the batch of step+1 would be generated only after the critic was back and had trained
    assert generated[step + 1]["start"] < back["time"], (generated[step + 1], down, back)
    # a real rebuild: another process
    assert json.loads((run / "status.json").read_text())["roles"]["critic"]["ranks"][0]["pid"] != pid


@pytest.mark.slurm
def test_the_pipelined_hetjob_learns_the_tiny_task(slurm_cluster, tmp_path):
    """jobs/tiny-cpu-pipelined.yaml as a 4-component hetjob (LEARNING_STEPS of it) learns as jobs/tiny-cpu.yaml does
    sequentially (last-10 mean 0.97-0.999 over seeds; the bar is tests/test_ppo.py's), every batch
    one policy version behind the actor that trains on it."""
    run, total = tmp_path / "run", LEARNING_STEPS
    out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", "jobs/tiny-cpu-pipelined.yaml", "--run-dir", str(run),
                          f"train.total_steps={total}", "--wait"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    records = read_metrics(run / "metrics.jsonl")
    assert len(records) == total
    assert np.mean([r["reward/mean"] for r in records[:5]]) <= 0.15
    assert np.mean([r["reward/mean"] for r in records[-10:]]) >= 0.9
    assert [r["policy/lag"] for r in records] == [0] + [1] * (total - 1)
    st = json.loads(subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run), "--json"], capture_output=True,
                                   text=True, cwd=ROOT, check=True).stdout)
    assert {r: c["partition"] for c in st["components"] for r in c["roles"]} == {
        "rollout": "a100", "actor_rollout": "h100", "critic": "h100", "ref": "cpu", "reward": "cpu"}
    calls = read_calls(run)
    generated = {c["step"]: c for c in calls["rollout"] if c["method"] == "generate_sequences"}
    updated = {c["step"]: c for c in calls["actor_rollout"] if c["method"] == "update_actor"}
    # the rollout's generation of step k+1 started before the actor's update of step k ended (a loaded
    # machine may delay a start now and then)
    ahead = [k for k in range(1, total) if generated[k + 1]["start"] < updated[k]["end"]]
    assert len(ahead) >= 0.95 * (total - 1), len(ahead)     # sequentially: none
    subprocess.run([sys.executable, "-m", "hpcrl", "report", str(run)], cwd=ROOT, check=True, capture_output=True)
    assert (run / "report" / "timeline.png").stat().st_size > 10_000
