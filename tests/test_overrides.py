"""Overrides on the command line (`hpcrl validate|render|submit|run SPEC PATH=VALUE ...`): they
reach the batch script and the driver's settings, are checked as the file's values are, and an
unknown path is refused, naming the nearest known one, before anything is written."""
import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from hpcrl.spec import SpecError, load_spec
from hpcrl.spec.overrides import parse_overrides
from hpcrl.observe.metrics import read_metrics

SPEC = str(ROOT / "jobs" / "tiny-cpu.yaml")


def hpcrl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, cwd=ROOT)


def test_values_are_read_as_yaml_scalars():
    assert parse_overrides(["a=1e-6", "b=3.0e-4", "c=2", "d=true", "e=[x, y]", "f=null", "g=text", "h=-2E3"]) == \
        {"a": 1e-6, "b": 3e-4, "c": 2, "d": True, "e": ["x", "y"], "f": None, "g": "text", "h": -2000.0}


def test_unknown_paths_and_bad_values_are_refused_naming_each(tmp_path):
    with pytest.raises(SpecError) as refused:
        load_spec(SPEC, overrides=["train.actor_l=1e-6", "roles.critc.nodes=2", "roles.critic.node=2",
                                   "trian.seed=2", "signal_lead.x=1", "train.kl_coef=-1"])
    assert refused.value.problems == [
        "override train.actor_l: train has no field 'actor_l'; did you mean actor_lr?",
        "override roles.critc.nodes: no role 'critc' in the spec; did you mean critic? "
        "(roles: actor_rollout, critic, ref, reward)",
        "override roles.critic.node: roles.critic has no field 'node'; did you mean nodes?",
        "override trian.seed: the spec has no field 'trian'; did you mean train?",
        "override signal_lead.x: signal_lead is a value, not a mapping",
        "train.kl_coef: -1 is out of range; it must be ≥ 0",     # a merged value, checked as in the file
    ]
    run = tmp_path / "run"
    out = hpcrl("submit", SPEC, "train.actor_l=1e-6", "--run-dir", str(run))
    assert out.returncode == 2 and "did you mean actor_lr?" in out.stderr and not run.exists()


def test_overrides_reach_the_script_and_the_record():
    script = hpcrl("render", "--offline", SPEC, "roles.critic.nodes=2", "roles.critic.time=00:20:00").stdout
    critic = next(block for block in script.split("#SBATCH hetjob") if "--partition=h100" in block)
    assert "#SBATCH --nodes=2" in critic and "#SBATCH --time=00:20:00" in critic, critic
    spec = load_spec(SPEC, overrides=["train.actor_lr=1e-6", "roles.critic.nodes=2"])
    assert spec.train["actor_lr"] == 1e-6 and spec.roles["critic"].nodes == 2
    assert spec.as_data()["overridden"] == {"train.actor_lr": 1e-6, "roles.critic.nodes": 2}


def test_a_run_trains_with_the_overridden_settings_and_status_shows_them(tmp_path):
    run = tmp_path / "run"
    out = hpcrl("run", SPEC, "train.total_steps=3", "train.batch_size=16", "train.mini_batch_size=16",
                "train.micro_batch_size=16", "train.progress=false", "--local", "--num-cpus", "2", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    recorded = yaml.safe_load((run / "spec.yaml").read_text())
    assert recorded["train"]["batch_size"] == 16 and recorded["overridden"]["train.total_steps"] == 3
    assert 'overrides: train.total_steps=3 train.batch_size=16' in hpcrl("status", str(run)).stdout
    assert json.loads(hpcrl("status", str(run), "--json").stdout)["overridden"]["train.batch_size"] == 16
