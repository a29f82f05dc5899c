"""Overrides on the command line (`hpcrl validate|render|submit|run SPEC PATH=VALUE ...`): they
reach the batch script and the driver's settings, are checked as the file's values are, and an
unknown path is refused, naming the nearest known one, before anything is written."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from hpcrl.jobspec import SpecError, load_spec
from hpcrl.jobspec.overrides import parse_overrides
from hpcrl.observe.metrics import read_metrics

SPEC = str(ROOT / "jobs" / "tiny-cpu.yaml")


def hpcrl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, cwd=ROOT)


def test_values_are_read_as_yaml_scalars():
    assert parse_overrides(["a=1e-6", "b=3.0e-4", "c=2", "d=true", "e=[x, y]", "f=null", "g=text", "h=-2E3"]) == \
        {"a": 1e-6, "b": 3e-4, "c": 2, "d": True, "e": ["x", "y"], "f": None, "g": "text", "h": -2000.0}


def test_unknown_paths_and_bad_values_are_refused_naming_each(tmp_path):
    with pytest.raises(SpecError) as refused:
        load_spec(SPEC, overrides=["train.optim.actor_l=1e-6", "roles.critc.nodes=2", "roles.critic.node=2",
                                   "trian.seed=2", "signal_lead.x=1", "train.algorithm.kl_coef=-1",
                                   "train.actor_l=1e-6"])
    assert refused.value.problems == [
        "override train.optim.actor_l: train.optim has no field 'actor_l'; did you mean actor_lr?",
        "override roles.critc.nodes: no role 'critc' in the spec; did you mean critic? "
        "(roles: actor_rollout, critic, ref, reward)",
        "override roles.critic.node: roles.critic has no field 'node'; did you mean nodes?",
        "override trian.seed: the spec has no field 'trian'; did you mean train?",
        "override signal_lead.x: signal_lead is a value, not a mapping",
        "override train.actor_l: train has no field 'actor_l'; did you mean train.optim.actor_lr?",  # a flat key
        "override train.algorithm.kl_coef: -1 is out of range; it must be ≥ 0",     # checked as in the file
    ]
    run = tmp_path / "run"
    out = hpcrl("submit", SPEC, "train.optim.actor_l=1e-6", "--run-dir", str(run))
    assert out.returncode == 2 and "did you mean actor_lr?" in out.stderr and not run.exists()


def test_overrides_of_related_settings_are_checked_together():
    """One model is built once with all of its overrides: lowering mini_batch_size below today's
    micro_batch_size is fine when micro_batch_size comes down with it, in either order."""
    for order in ([16, 8], [8, 16]):
        paths = ["train.optim.mini_batch_size", "train.optim.micro_batch_size"][::1 if order[0] == 16 else -1]
        spec = load_spec(SPEC, overrides=[f"{p}={v}" for p, v in zip(paths, order)])
        assert (spec.train.optim.mini_batch_size, spec.train.optim.micro_batch_size) == (16, 8)
    with pytest.raises(SpecError, match="micro_batch_size: 32 is larger than mini_batch_size 16"):
        load_spec(SPEC, overrides=["train.optim.mini_batch_size=16"])


def test_a_flat_training_key_still_sets_its_sections_field_with_a_note(tmp_path):
    spec = load_spec(SPEC, overrides=["train.actor_lr=1e-6"])
    assert spec.train.optim.actor_lr == 1e-6
    assert spec.notes == ["train.actor_lr: now train.optim.actor_lr (the flat key is read until hpcrl 0.3)"]
    flat = tmp_path / "flat.yaml"
    flat.write_text(Path(SPEC).read_text().replace("  optim:\n    actor_lr: 3.0e-4", "  actor_lr: 1.0e-5\n  optim:"))
    out = hpcrl("validate", "--offline", str(flat))
    assert out.returncode == 0, out.stderr
    assert "note: train.actor_lr: now train.optim.actor_lr" in out.stderr
    assert load_spec(flat).train.optim.actor_lr == 1e-5
    # a section added since that shares a name (train.judge's max_new_tokens and temperature) leaves
    # the flat keys where they were
    spec = load_spec(SPEC, overrides=["train.max_new_tokens=12", "train.temperature=0.7"])
    t = spec.train
    assert (t.rollout.max_new_tokens, t.rollout.temperature) == (12, 0.7)
    assert (t.judge.max_new_tokens, t.judge.temperature) == (256, 0.0)


def test_overrides_reach_the_script_and_the_record():
    script = hpcrl("render", "--offline", SPEC, "roles.critic.nodes=2", "roles.critic.time=00:20:00").stdout
    critic = next(block for block in script.split("#SBATCH hetjob") if "--partition=h100" in block)
    assert "#SBATCH --nodes=2" in critic and "#SBATCH --time=00:20:00" in critic, critic
    spec = load_spec(SPEC, overrides=["train.optim.actor_lr=1e-6", "roles.critic.nodes=2"])
    assert spec.train.optim.actor_lr == 1e-6 and spec.roles["critic"].nodes == 2
    assert spec.as_data()["overridden"] == {"train.optim.actor_lr": 1e-6, "roles.critic.nodes": 2}


def test_a_run_trains_with_the_overridden_settings_and_status_shows_them(tmp_path):
    run = tmp_path / "run"
    out = hpcrl("run", SPEC, "train.total_steps=3", "train.data.batch_size=16", "train.optim.mini_batch_size=16",
                "train.optim.micro_batch_size=16", "train.progress=false", "--local", "--num-cpus", "2", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    recorded = yaml.safe_load((run / "spec.yaml").read_text())
    assert recorded["train"]["data"]["batch_size"] == 16 and recorded["overridden"]["train.total_steps"] == 3
    assert 'overrides: train.total_steps=3 train.data.batch_size=16' in hpcrl("status", str(run)).stdout
    assert json.loads(hpcrl("status", str(run), "--json").stdout)["overridden"]["train.data.batch_size"] == 16
    # its Ray ran in a private folder of its own (ray_temp_dir, as a job's nodes), not Ray's shared
    # /tmp/ray; its logs were kept in the run directory and the folder removed
    raylet = (run / "logs" / "ray" / "local" / "raylet.out").read_text()
    folders = set(re.findall(r"(/\S+/hpcrl-ray-local-\w+)/ray/session_", raylet))
    assert len(folders) == 1 and "/tmp/ray/" not in raylet, raylet[:2000]
    assert not Path(folders.pop()).exists()
