"""Job spec parsing and its errors (pure logic: no cluster)."""
import pytest

from hpcrl.jobspec import SpecError, load_spec, parse_spec
from hpcrl.slurm.job import Gres, parse_mem_mb, parse_time_minutes

GOOD = {"name": "t", "run_dir": "/tmp/x",
        "roles": {"actor_rollout": {"partition": "a100", "gpus_per_node": 1, "gpu_type": "a100"},
                  "critic": {"partition": "h100"}, "ref": {"partition": "cpu"},
                  "reward": {"same_nodes_as": "ref"}}}


@pytest.mark.parametrize("text,minutes", [("30", 30), ("1:30", 2), ("02:00:00", 120), ("1-00", 1440),
                                          ("1-02:30", 1590), ("2-00:00:01", 2881)])
def test_slurm_time_syntax(text, minutes):
    assert parse_time_minutes(text) == minutes


@pytest.mark.parametrize("text,mb", [("512", 512), ("512M", 512), ("4G", 4096), ("1.5G", 1536), ("1T", 1048576)])
def test_memory_syntax(text, mb):
    assert parse_mem_mb(text) == mb


def test_gres_syntax():
    assert Gres.parse("gpu:a100:4") == Gres("gpu", "a100", 4)
    assert Gres.parse("gpu:2(S:0-1)") == Gres("gpu", None, 2)
    with pytest.raises(ValueError):
        Gres.parse("gpu:a100:x")


def test_components_group_roles_in_spec_order():
    spec = parse_spec(GOOD)
    assert spec.component_roles() == [["actor_rollout"], ["critic"], ["ref", "reward"]]
    job = spec.to_hetjob(python="python3")
    assert [c.partition for c in job.components] == ["a100", "h100", "cpu"]
    assert job.members() == {"actor_rollout": 0, "critic": 1, "ref": 2, "reward": 2}
    assert str(job.components[0].gres) == "gpu:a100:1" and job.components[2].gres is None


def bad(**roles_patch):
    data = {**GOOD, "roles": {**GOOD["roles"], **roles_patch}}
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return str(e.value)


def test_every_problem_is_listed_with_its_field_path():
    msg = bad(critic={"partition": "h100", "nodes": 0, "gpus": 2, "time": "soon"})
    assert "roles.critic.nodes" in msg and "roles.critic.gpus: unknown field" in msg
    assert "roles.critic.time" in msg and "HH:MM:SS" in msg


def test_cross_field_problems():
    assert "roles.reward.same_nodes_as: unknown role 'nobody'" in bad(reward={"same_nodes_as": "nobody"})
    assert "drop them" in bad(reward={"same_nodes_as": "ref", "partition": "cpu"})
    assert "roles.critic.partition: missing" in bad(critic={"nodes": 1})
    assert "cycle" in bad(ref={"same_nodes_as": "reward"}, reward={"same_nodes_as": "ref"})
    assert "roles.critic.gres: given together" in bad(critic={"partition": "h100", "gres": "gpu:h100:1",
                                                               "gpus_per_node": 1})


def test_unknown_top_level_field_and_wrong_yaml(tmp_path):
    with pytest.raises(SpecError, match=r"requeu: unknown field \(valid fields: name, run_dir"):
        parse_spec({**GOOD, "requeu": True})
    f = tmp_path / "s.yaml"
    f.write_text("name: t\nroles: [a, b\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(f)


def test_duplicate_role_is_an_error_not_an_override(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: t\nrun_dir: /tmp/x\nroles:\n  critic: {partition: h100}\n  critic: {partition: a100}\n")
    with pytest.raises(SpecError, match="duplicate key 'critic'"):
        load_spec(f)


def test_run_dir_override_and_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_spec({**GOOD, "run_dir": "runs/a"}).run_dir == tmp_path / "runs" / "a"
    assert parse_spec(GOOD, run_dir="other").run_dir == tmp_path / "other"


def test_megatron_needs_gpus_that_its_layout_divides():
    gpu = {"partition": "h100", "gpus_per_node": 2}
    roles = {"actor_rollout": gpu, "critic": gpu, "ref": gpu, "reward": {"same_nodes_as": "ref"}}
    megatron = {"backend": "megatron", "tensor_parallel": 2}
    ok = parse_spec({**GOOD, "roles": roles, "train": {"engine": megatron}})
    assert ok.train.engine.tensor_parallel == 2
    with pytest.raises(SpecError, match=r"roles.ref: no GPUs, but train.engine.backend: megatron runs role ref"):
        parse_spec({**GOOD, "roles": {**roles, "ref": {"partition": "cpu"}}, "train": {"engine": {"backend": "megatron"}}})
    with pytest.raises(SpecError, match=r"= 4 GPUs per model does not divide the 2 GPUs of role actor_rollout"):
        parse_spec({**GOOD, "roles": roles, "train": {"engine": {**megatron, "pipeline_parallel": 2}}})
    with pytest.raises(SpecError, match=r"train.engine.tensor_parallel: 2 needs backend: megatron"):
        parse_spec({**GOOD, "train": {"engine": {"tensor_parallel": 2}}})


def test_parallel_checkpoints_need_an_h5py_with_mpi_in_the_jobs_python(tmp_path):
    """Checked before submission (validate, render, submit; also offline), not each time a spec loads."""
    import subprocess
    import sys

    from hpcrl.launch.submit import checked_hetjob

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = parse_spec({**GOOD, "python": str(tmp_path / "bare" / "bin" / "python"), "train": {"checkpoint": {"io": "parallel"}}})
    with pytest.raises(SpecError, match=r"train.checkpoint.io: parallel, but h5py does not import in .*bare.*"
                                        r"or use checkpoint.io: auto"):
        checked_hetjob(bare, offline=True)
    with pytest.raises(SpecError, match=r"train.checkpoint.io: Input should be 'auto', 'parallel' or 'serial' \(got 'always'\)"):
        parse_spec({**GOOD, "train": {"checkpoint": {"io": "always"}}})
    assert parse_spec({**GOOD, "train": {"checkpoint": {"io": "parallel"}}}).train.checkpoint.io == "parallel"


def test_an_mpi_step_names_its_own_component_and_puts_rank_i_on_hosts_i():
    from hpcrl.checkpoint.parallel import rows
    from hpcrl.slurm.mpi_step import step_command

    het = {"SLURM_JOB_ID": "324", "SLURM_JOB_NODELIST": "h100n[1-2]", "SLURM_JOB_ID_HET_GROUP_0": "323",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "a100n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "h100n[1-2]"}
    cmd = step_command(["h100n2", "h100n1"], ["python", "x.py"], "pmix", het, "hpcrl-mpi-1", 61)
    assert cmd[:3] == ["srun", "--jobid=323", "--het-group=1"] and "--ntasks=2" in cmd and cmd[-2:] == ["python", "x.py"]
    assert "--distribution=arbitrary" in cmd and "--overlap" in cmd and "--mpi=pmix" in cmd
    assert "--job-name=hpcrl-mpi-1" in cmd and "--time=3" in cmd     # Slurm's own limit: a minute past the bound
    plain = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    assert step_command(["n1"], ["p"], "pmi2", plain, "s", 1)[1:2] == ["--jobid=7"]
    for n, world in [(0, 2), (1, 2), (5, 2), (7, 3), (2, 4)]:     # every row exactly once, in order
        parts = [rows(n, r, world) for r in range(world)]
        assert parts[0][0] == 0 and parts[-1][1] == n and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
