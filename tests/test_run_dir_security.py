"""The run directory as a trust boundary: modes that honour the umask (new run directories 0700),
secrets that reach the job but no file or command line, checkpoints that hold data and never code,
manifest paths confined to ckpt/, private temporary folders."""
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, job_finished, wait_until

import hpcrl
from hpcrl.checkpoint.format import write_role_file
from hpcrl.checkpoint.inflight import PickledInflight
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.controller.batch import Batch
from hpcrl.files import UnsafePath, atomic_write_text, private_dir
from hpcrl.jobspec import SpecError, parse_spec
from hpcrl.raycluster.node import RAY_TEMP_ROOM, ray_temp_dir
from hpcrl.slurm.sbatch import SubmitError, submit_hetjob, write_spec

TINY = ROOT / "jobs" / "tiny-cpu.yaml"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def test_files_and_run_directories_honour_the_umask(tmp_path, umask):
    umask(0o077)
    write_spec(tmp_path / "a" / "run", {"name": "x"})
    atomic_write_text(tmp_path / "a" / "run" / "job.sbatch", "#!/bin/bash\n", mode=0o777)
    write_role_file(tmp_path / "a" / "run" / "ckpt" / "r.h5", {"w": torch.ones(2)}, {"step": 1})
    assert mode(tmp_path / "a" / "run") == 0o700 and mode(tmp_path / "a" / "run" / "spec.yaml") == 0o600
    assert mode(tmp_path / "a" / "run" / "job.sbatch") == 0o700 and mode(tmp_path / "a" / "run" / "ckpt" / "r.h5") == 0o600
    umask(0o022)
    write_spec(tmp_path / "b", {"name": "x"})                       # private: 0700 whatever the umask
    write_spec(tmp_path / "c", {"name": "x"}, group_access=True)    # the group's as far as the umask lets
    assert mode(tmp_path / "b") == 0o700 and mode(tmp_path / "c") == 0o750
    assert mode(tmp_path / "b" / "spec.yaml") == 0o644               # no forced 0644 either way: the umask's
    (tmp_path / "d").mkdir(mode=0o755)
    write_spec(tmp_path / "d", {"name": "x"})                        # an existing folder keeps its mode
    assert mode(tmp_path / "d") == 0o755
    atomic_write_text(tmp_path / "b" / "secret", "x", mode=0o600)
    umask(0)
    atomic_write_text(tmp_path / "b" / "secret", "y", mode=0o600)    # replaced: never wider, not for an instant
    assert mode(tmp_path / "b" / "secret") == 0o600


def commit_role(store: CheckpointStore, step: int, relative: str | None = None) -> None:
    path = store.role_path(step, "actor")
    info = write_role_file(path, {"w": torch.full((3,), float(step))}, {"step": step})
    store.commit(step, {"actor": {"path": relative or str(path.relative_to(store.root)), **info}}, {"step": step})


@pytest.mark.parametrize("name", ["dotdot", "absolute", "symlink"])
def test_a_manifest_path_out_of_ckpt_is_refused_not_followed(tmp_path, name):
    outside = tmp_path / "outside.h5"
    write_role_file(outside, {"w": torch.zeros(3)}, {"step": 2})
    store = CheckpointStore(tmp_path / "run")
    commit_role(store, 1)
    relative = {"dotdot": "../../outside.h5", "absolute": str(outside), "symlink": "step_00000002/actor.h5"}[name]
    if name == "symlink":
        store.step_dir(2).mkdir(parents=True)
        (store.step_dir(2) / "actor.h5").symlink_to(outside)
    manifest = {"step": 2, "roles": {"actor": {"path": relative, "bytes": outside.stat().st_size}}, "driver": {}}
    store.step_dir(2).mkdir(parents=True, exist_ok=True)
    (store.step_dir(2) / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafePath, match=r"MANIFEST.json names .* which leads out of .*ckpt"):
        store.check(2)
    with pytest.raises(UnsafePath):
        store.latest_good()        # not passed over quietly: someone else wrote into the run directory
    out = subprocess.run([sys.executable, "-m", "hpcrl", "ckpt", "verify", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "leads out of" in out.stderr and "Traceback" not in out.stderr, out.stderr
    inside = {"path": "step_00000002/../step_00000001/actor.h5", "bytes": store.role_path(1, "actor").stat().st_size}
    (store.step_dir(2) / "MANIFEST.json").write_text(json.dumps({**manifest, "roles": {"actor": inside}}))
    if name == "symlink":
        (store.step_dir(2) / "actor.h5").unlink()
    assert store.check(2) == [] and store.latest_good()[0] == 2      # a '..' that stays inside is taken


class _Exploit:
    """What a pickle can hold: a call made as it loads."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _pickled_step(store: CheckpointStore, step: int, payload) -> None:
    """A committed step as an earlier hpcrl wrote it: its batches generated ahead in inflight.pkl."""
    import hashlib

    commit_role(store, step)
    data = pickle.dumps(payload, protocol=5)
    (store.step_dir(step) / "inflight.pkl").write_bytes(data)
    manifest = store.manifest(step)
    manifest["inflight"] = {"path": f"step_{step:08d}/inflight.pkl", "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest(), "batches": 1}
    (store.step_dir(step) / "MANIFEST.json").write_text(json.dumps(manifest))


def test_an_old_pickled_checkpoint_is_refused_until_the_user_vouches_for_it(tmp_path):
    marker = tmp_path / "code-ran"
    store = CheckpointStore(tmp_path / "run")
    _pickled_step(store, 1, [_Exploit(marker)])
    with pytest.raises(PickledInflight, match=r"inflight.pkl holds .* `hpcrl ckpt upgrade .* --trust-pickle`"):
        store.read_inflight(store.manifest(1))
    assert store.verify(1) == []               # checked by its SHA-256, never loaded
    upgrade = [sys.executable, "-m", "hpcrl", "ckpt", "upgrade", str(tmp_path / "run")]
    out = subprocess.run(upgrade, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "--trust-pickle" in out.stderr and not marker.exists(), out.stderr

    good = CheckpointStore(tmp_path / "good")
    ahead = Batch({"responses": torch.arange(6).reshape(2, 3)}, {"prompt": np.array(["1=", "2="], dtype=object)},
                  {"step": 3, "policy_version": 1})
    _pickled_step(good, 2, [ahead])
    out = subprocess.run([*upgrade[:-1], str(tmp_path / "good"), "--trust-pickle"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "steps 2: inflight.pkl is now inflight.h5" in out.stdout, out.stderr
    assert not list((tmp_path / "good").rglob("*.pkl")) and good.verify(2) == []
    back = good.read_inflight(good.manifest(2))
    assert torch.equal(back[0]["responses"], ahead["responses"]) and list(back[0]["prompt"]) == ["1=", "2="]
    assert back[0].meta == ahead.meta


def test_private_folders_are_fresh_and_ours(tmp_path, monkeypatch):
    long_tmp = tmp_path / ("x" * RAY_TEMP_ROOM)
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    made = [ray_temp_dir("hpcrl-ray-123-") for _ in range(2)]
    try:
        assert made[0] != made[1] and all(mode(d) == 0o700 and d.parent == Path("/tmp") for d in made)
        assert all(len(f"{d}/ray/session_2025-01-01_00-00-00_000000_4194304/sockets/plasma_store") <= 107 for d in made)
    finally:
        for d in made:
            d.rmdir()
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))     # a $TMPDIR that leaves room for Ray's sockets
    monkeypatch.setenv("TMPDIR", str(short))
    try:
        here = ray_temp_dir("hpcrl-ray-123-")
        assert here.parent == short and here.name.startswith("hpcrl-ray-123-") and mode(here) == 0o700
    finally:
        shutil.rmtree(short)

    assert mode(private_dir(tmp_path / "shm")) == 0o700 and private_dir(tmp_path / "shm") == tmp_path / "shm"
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)       # made by someone else, for anyone to write
    (tmp_path / "link").symlink_to(tmp_path / "shm")
    for planted in ("open", "link"):
        with pytest.raises(PermissionError, match="is there already and is not a folder of this user's"):
            private_dir(tmp_path / planted)


def test_secrets_are_declared_by_name_and_their_values_stay_out_of_spec_and_script(tmp_path, monkeypatch):
    from hpcrl.slurm.render import render_hetjob

    data = yaml.safe_load(TINY.read_text())
    data["secrets"] = ["HF_TOKEN"]
    data["container"] = {"runtime": "apptainer", "image": "/x.sif", "env": {"WANDB_API_KEY": "k", "HF_HOME": "/h"}}
    spec = parse_spec(data, run_dir=tmp_path / "run")
    assert spec.notes == ["container.env.WANDB_API_KEY: its value is written into spec.yaml, job.sbatch and the steps' "
                          "command lines; if it is a secret, remove it there, list WANDB_API_KEY under secrets: and "
                          "export it before hpcrl submit"]
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SubmitError, match="secrets: HF_TOKEN is not set in this environment: export it"):
        submit_hetjob(spec.to_hetjob(python="python3"), spec_data=spec.as_data())
    assert not (tmp_path / "run").exists()      # refused before anything was written
    script = render_hetjob(spec.to_hetjob(python="python3"))
    assert '\n. "$HPCRL_RUN_DIR/secrets.env" || exit 1    # secrets: HF_TOKEN' in script
    with pytest.raises(SpecError, match=r"secrets: .*\['HPCRL_RUN_DIR', 'a b'\]"):
        parse_spec({**data, "secrets": ["HPCRL_RUN_DIR", "a b"]})


@pytest.fixture
def sbatch_seeing_its_environment(tmp_path, monkeypatch):
    """An `sbatch` first on PATH that keeps the environment it was given (what Slurm would keep for
    the job: `scontrol show job -d`, the accounting database) and answers as Slurm's (job 41)."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "sbatch-env"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\nenv > "{seen}"\n'
        'case " $* " in *" --parsable "*) echo 41 ;; *) echo "Submitted batch job 41" ;; esac\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return seen


@pytest.mark.parametrize("via", ["sbatch", "submitit", "satellite"])
def test_sbatch_is_never_given_a_secret(tmp_path, monkeypatch, sbatch_seeing_its_environment, via):
    """The secrets are in the environment that submits: hpcrl submit's (exported for it), or a driver's
    start asking for hpcrl scale's satellites again (its batch script sourced secrets.env). Whoever
    runs sbatch (hpcrl, submitit, a satellite's submission), it is given every variable but them;
    each batch script reads them from secrets.env."""
    from hpcrl.launch.scale import satellite_job
    from hpcrl.run_dir import RunDir
    from hpcrl.slurm.satellite import submit_satellite

    data = yaml.safe_load((ROOT / "jobs" / "tiny-cpu-elastic.yaml").read_text())
    data["secrets"] = ["TEST_HF_TOKEN"]
    spec = parse_spec(data, run_dir=tmp_path / "run")
    monkeypatch.setenv("TEST_HF_TOKEN", "s3cr3t-56")
    monkeypatch.setenv("HPCRL_TEST_KEPT", "1")      # the rest of the environment goes through
    if via == "satellite":
        (tmp_path / "run" / "logs").mkdir(parents=True)
        job = satellite_job(spec, "reward", {})
        assert submit_satellite(job, "40", "start-1")["job_id"] == "41"
        script = RunDir(job.run_dir).satellite_script("reward").read_text()
    else:
        assert submit_hetjob(spec.to_hetjob(python=sys.executable), via, spec_data=spec.as_data()).job_id == "41"
        script = RunDir(tmp_path / "run").script.read_text()
    seen = sbatch_seeing_its_environment.read_text().splitlines()
    assert "HPCRL_TEST_KEPT=1" in seen and not [v for v in seen if "TEST_HF_TOKEN" in v or "s3cr3t-56" in v]
    assert '\n. "$HPCRL_RUN_DIR/secrets.env" || exit 1    # secrets: TEST_HF_TOKEN' in script
    assert "s3cr3t-56" not in script


def _processes():
    """pid -> (command line, environment or None) of every process of this host we may read."""
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            try:
                env = (p / "environ").read_bytes()
            except OSError:
                env = None
            out[int(p.name)] = (cmd, env)
    return out


@pytest.mark.slurm
def test_a_secret_reaches_the_job_and_no_file_or_command_line(slurm_cluster, tmp_path, monkeypatch, umask):
    """A Ray-only job submitted under umask 077 with secrets: [HPCRL_TEST_TOKEN_...]: while it runs, its
    node tasks have the value in their environment (read from secrets.env: sbatch was not given it),
    no process of the host has it on its command line, and afterwards no file of the run directory
    but secrets.env (0600) holds it, and nothing the job wrote is open to group or others."""
    import secrets

    value = f"s3cr3t-{secrets.token_hex(8)}"
    name = "TEST_HF_TOKEN"
    data = {"name": "secrets", "run_dir": "run", "secrets": [name],       # one node, Ray only: a few seconds
            "roles": {"actor_rollout": {"partition": "cpu", "cpus_per_task": 1, "mem": "1G", "time": "00:05:00"}}}
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = tmp_path / "run"
    monkeypatch.setenv(name, value)
    umask(0o077)
    job = hpcrl.submit(hpcrl.load_spec(spec_path, run_dir=run), via="sbatch")
    umask(0o022)
    monkeypatch.delenv(name)
    seen_env, on_command_lines, node_tasks, ray_folders = set(), [], set(), {}
    needle, assignment = value.encode(), f"{name}={value}".encode()
    folder = re.compile(rb"(/[^\0=]*/hpcrl-ray-%s-\w+)/ray\b" % job.job_id.encode())
    while not job_finished(job.job_id):
        for pid, (cmd, env) in _processes().items():
            if needle in cmd:
                on_command_lines.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
            for found in folder.findall(cmd):      # each node's Ray folder, in a private one of its own
                try:
                    st = os.lstat(found)
                    ray_folders[found.decode()] = (stat.S_IMODE(st.st_mode), st.st_uid)
                except FileNotFoundError:
                    pass
            if b"hpcrl.raycluster\0node" in cmd and str(run).encode() in cmd and env is not None:
                node_tasks.add(pid)
                if assignment in env.split(b"\0"):
                    seen_env.add(pid)
        time.sleep(0.05)
    assert job.wait(timeout=60) == {0: "COMPLETED"}, job.logs()
    assert node_tasks and seen_env == node_tasks, (node_tasks, seen_env)     # the node task had it
    assert not on_command_lines, on_command_lines
    assert len(ray_folders) == 1 and set(ray_folders.values()) == {(0o700, os.getuid())}, ray_folders
    holding = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and not p.is_symlink()
               and needle in p.read_bytes()]
    assert holding == ["secrets.env"] and mode(run / "secrets.env") == 0o600, holding
    assert name in (run / "job.sbatch").read_text() and name in (run / "spec.yaml").read_text()
    wide = [f"{p.relative_to(run)} {stat.filemode(os.lstat(p).st_mode)}" for p in [run, *run.rglob("*")]
            if not p.is_symlink() and os.lstat(p).st_mode & 0o077]
    assert not wide, wide
