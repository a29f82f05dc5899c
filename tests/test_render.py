"""Rendered scripts against golden files (HPCRL_UPDATE_GOLDEN=1 rewrites them after a reviewed change)."""
import os
from pathlib import Path

import pytest

from hpcrl.jobspec import load_spec
from hpcrl.slurm.render import render_hetjob

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", ["tiny-cpu", "ppo-7b-hetero", "grpo-32b-hetero", "containers-hetero",
                                  "tiny-cpu-containers"])
def test_render_matches_golden(name, monkeypatch):
    monkeypatch.chdir("/")        # relative paths of a spec (an image, mounts) are taken from here
    spec = load_spec(ROOT / "jobs" / f"{name}.yaml", run_dir=f"/shared/runs/{name}")
    spec._source = f"jobs/{name}.yaml"
    text = render_hetjob(spec.to_hetjob(python="python3"))
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_script_structure():
    job = load_spec(ROOT / "jobs" / "tiny-cpu.yaml").to_hetjob(python="python3")
    lines = render_hetjob(job).splitlines()
    assert lines[0] == "#!/bin/bash"
    assert sum(line == "#SBATCH hetjob" for line in lines) == len(job.components) - 1
    assert "#SBATCH --signal=B:USR1@60" in lines and "#SBATCH --requeue" in lines
    assert [line for line in lines if line.startswith("srun --het-group=")][2].startswith("srun --het-group=2 --nodes=1")
    job.requeue = False
    no_requeue = render_hetjob(job)
    assert "#SBATCH --no-requeue" in no_requeue and "--signal" not in no_requeue


def test_a_single_component_job_is_not_a_hetjob():
    from hpcrl.jobspec import parse_spec

    job = parse_spec({"name": "one", "run_dir": "/tmp/one", "roles": {"actor_rollout": {"partition": "a100"}}}) \
        .to_hetjob(python="python3")
    text = render_hetjob(job)
    assert "#SBATCH hetjob" not in text and "--het-group" not in text  # srun refuses it outside a hetjob
    assert "srun --nodes=1 --ntasks-per-node=1 --overlap python3 -m hpcrl.raycluster node" in text
