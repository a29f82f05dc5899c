"""The local cluster on a GPU machine: its configuration for 1 and 8 GPUs against golden files
(HPCRL_UPDATE_GOLDEN=1 rewrites them after a reviewed change), the task prolog that gives each virtual
node's tasks their own devices, the same cluster from carried .deb files running a hetjob (on device
files that stand in for eight GPUs), and the parts that carry files to the GPU machine."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CLUSTER, ROOT

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(ROOT / "bench"))


def cluster_config(state: Path, gpus: list[str]) -> dict[str, str]:
    """What `slurm/cluster up` writes for these GPU device files, without starting anything: state
    directory and host name replaced by placeholders."""
    code = ("import importlib.machinery as m, importlib.util as u, socket\n"
            f"l = m.SourceFileLoader('cluster', {str(CLUSTER)!r}); s = u.spec_from_loader('cluster', l)\n"
            "c = u.module_from_spec(s); l.exec_module(c)\n"
            "c.write_config(None)\n")
    env = {**os.environ, "HPCRL_SLURM_STATE": str(state), "HPCRL_SLURM_GPUS": ",".join(gpus)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    host = __import__("socket").gethostname().split(".")[0]
    return {f.name: f.read_text().replace(str(state), "STATE").replace(f"={host}", "=HOST")
            for f in sorted(state.iterdir()) if f.name in ("slurm.conf", "gres.conf", "task_prolog")}


@pytest.mark.parametrize("n", [1, 8])
def test_gpu_machine_config_matches_golden(n, tmp_path):
    files = cluster_config(tmp_path, [f"/dev/nvidia{k}" for k in range(n)])
    assert set(files) == {"slurm.conf", "gres.conf", "task_prolog"}
    for name, text in files.items():
        golden = GOLDEN / f"cluster-{n}gpu-{name.replace('.', '-')}"
        if os.environ.get("HPCRL_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert text == golden.read_text(), name


def test_without_gpus_nodes_get_dev_null_links_and_no_prolog(tmp_path):
    files = cluster_config(tmp_path, [])
    assert "task_prolog" not in files and "TaskProlog" not in files["slurm.conf"]
    assert "NodeName=a100n2 Name=gpu Type=a100 File=STATE/dev/a100n2/nvidia0,STATE/dev/a100n2/nvidia1," in files["gres.conf"]
    assert os.readlink(tmp_path / "dev" / "h100n1" / "nvidia3") == "/dev/null"


@pytest.mark.parametrize("node, ids, want", [
    ("h100n1", "0,1", "0,1"), ("h100n2", "0,1", "2,3"), ("h100n2", "1", "3"), ("a100n1", "1", "5"),
    ("a100n2", "0", "6"), ("a100n2", "1,0", "7,6")])
def test_task_prolog_turns_slurm_numbers_into_device_numbers(node, ids, want, tmp_path):
    cluster_config(tmp_path, [f"/dev/nvidia{k}" for k in range(8)])
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):     # a step's, or the batch step's (which has only the job's)
        out = subprocess.run(["sh", str(tmp_path / "task_prolog")], env={"SLURMD_NODENAME": node, var: ids},
                             capture_output=True, text=True, check=True).stdout.split("\n")
        assert out[:2] == ["export CUDA_DEVICE_ORDER=PCI_BUS_ID", f"export CUDA_VISIBLE_DEVICES={want}"], (var, out)


def test_task_prolog_says_nothing_for_a_task_without_gpus(tmp_path):
    cluster_config(tmp_path, [f"/dev/nvidia{k}" for k in range(8)])
    for env in ({"SLURMD_NODENAME": "cpun1", "SLURM_JOB_GPUS": "0,1"},   # the batch shell's GPUs leak into a cpu step
                {"SLURMD_NODENAME": "h100n1"}):
        out = subprocess.run(["sh", str(tmp_path / "task_prolog")], env=env, capture_output=True, text=True, check=True)
        assert out.stdout == "", env


@pytest.mark.slurm
def test_carried_cluster_gives_each_virtual_node_its_own_gpus(slurm_cluster, tmp_path):
    """Slurm from .deb files unpacked under the state directory (as on the GPU machine, without apt),
    beside the test session's cluster on ports of its own, on eight device files (links to /dev/null:
    Slurm needs character devices, this machine has no GPU). A hetjob's GPU components see their
    own devices' numbers; the carried libraries do not reach the job's environment."""
    # the state in a short folder of its own: a job step's socket is STATE/spool/NODE/NODE_JOB.STEP, and Unix
    # socket paths end at 108 bytes (under pytest-xdist, tmp_path is 10 longer: the step could not start)
    debs, state, fake = tmp_path / "debs", Path(tempfile.mkdtemp(prefix="hpcrl-cc-")), tmp_path / "gpus"
    fake.mkdir()
    for k in range(8):
        (fake / f"nvidia{k}").symlink_to("/dev/null")
    env = {**os.environ, "HPCRL_SLURM_STATE": str(state), "HPCRL_SLURM_PORT": "17817",
           "HPCRL_SLURM_GPUS": ",".join(str(fake / f"nvidia{k}") for k in range(8))}
    env.pop("SLURM_CONF", None)

    def cluster(*args):
        return subprocess.run([str(CLUSTER), *args], env=env, capture_output=True, text=True)
    got = cluster("fetch", str(debs))
    assert got.returncode == 0, got.stdout + got.stderr
    try:
        up = cluster("up", "--packages", str(debs))
        assert up.returncode == 0, up.stdout + up.stderr
        assert "Slurm: carried packages" in cluster("status").stdout
        exports = dict(line.removeprefix("export ").split("=", 1) for line in cluster("env").stdout.splitlines())
        # a submitter without LD_LIBRARY_PATH, explicitly: the pytest process's may hold what an imported
        # package added (cv2 adds its lib64), and the job must get none, the carried prefix least of all
        job_env = {k: v for k, v in env.items() if k != "LD_LIBRARY_PATH"}
        job_env.update(SLURM_CONF=exports["SLURM_CONF"], PATH=exports["PATH"].replace("$PATH", os.environ["PATH"]))
        out = tmp_path / "out"
        script = tmp_path / "het.sh"
        script.write_text("#!/bin/bash\n#SBATCH -p h100 -w h100n2 --gres=gpu:h100:2\n#SBATCH hetjob\n"
                          "#SBATCH -p a100 -w a100n2 --gres=gpu:a100:1\n#SBATCH hetjob\n#SBATCH -p cpu\n"
                          "for g in 0 1 2; do srun --het-group=$g bash -c 'echo $SLURMD_NODENAME "
                          "${SLURM_STEP_GPUS:-none} ${CUDA_VISIBLE_DEVICES:-none} ${LD_LIBRARY_PATH:-none}' & done; wait\n")
        try:
            sbatch = subprocess.run(["sbatch", "--parsable", "-W", "-o", str(out), str(script)], env=job_env,
                                    capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            queue = subprocess.run(["squeue", "-o", "%i %T %R %N"], env=job_env, capture_output=True, text=True)
            logs = "".join(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]) + "\n"
                           for f in sorted((state / "log").glob("*")) if f.is_file())
            pytest.fail(f"the second cluster's hetjob did not end in 120 s\n{queue.stdout}{queue.stderr}\n{logs}")
        assert sbatch.returncode == 0, sbatch.stderr
        seen = {line.split()[0]: line.split()[1:] for line in out.read_text().splitlines() if line.strip()}
        assert seen["h100n2"] == ["0,1", "2,3", "none"]     # Slurm's numbers on the node; the devices' own
        assert seen["a100n2"] == ["0", "6", "none"]
        assert seen["cpun1"][0] == "none" and seen["cpun1"][2] == "none"
    finally:
        down = cluster("down")
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, down.stdout + down.stderr


def test_carried_parts_join_back_to_the_packed_files(tmp_path):
    """bench/gpu_carry.py: files cut into parts of a call's size come back whole, one part a call,
    a tar unpacked; a changed piece is refused."""
    from gpu_carry import split, take, write_parts

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    src = tmp_path / "src"
    (src / "whl").mkdir(parents=True)
    (src / "whl" / "a.whl").write_bytes(rng.randbytes(3000))
    subprocess.run(["tar", "-C", str(src), "-cf", str(tmp_path / "small.tar"), "whl"], check=True)
    big = tmp_path / "model.whl"
    big.write_bytes(rng.randbytes(10_000))
    parts, manifest = split([tmp_path / "small.tar", big], part_bytes=4096)
    assert all(sum(len(b) for _, b in p) <= 4096 for p in parts), seed
    write_parts(parts, manifest, tmp_path / "carry")
    last_part = {f["name"]: max(k for k, part in enumerate(parts) for name, _ in part if name in f["pieces"])
                 for f in manifest}
    assert len(parts) > 2 and last_part["small.tar"] < last_part["model.whl"], (parts, seed)
    where = tmp_path / "there"
    for k in range(len(parts)):
        call = tmp_path / f"call{k}"       # a call carries one part
        (call / str(k)).mkdir(parents=True)
        for f in (tmp_path / "carry" / str(k)).iterdir():
            (call / str(k) / f.name).write_bytes(f.read_bytes())
        assert take(where, call) == 0, seed
        assert (where / "whl" / "a.whl").exists() == (k >= last_part["small.tar"]), (k, seed)
        assert (where / "model.whl").exists() == (k >= last_part["model.whl"]), (k, seed)
    assert (where / "whl" / "a.whl").read_bytes() == (src / "whl" / "a.whl").read_bytes(), seed
    assert (where / "model.whl").read_bytes() == big.read_bytes(), seed
    bad = tmp_path / "bad"
    wrong = tmp_path / "carry2"
    write_parts(parts, manifest, wrong)
    piece = next(p for p in (wrong / "0").iterdir() if p.name.startswith("small.tar"))
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    assert take(bad, wrong) == 1, seed
