"""The job's own Ray cluster inside a real hetjob: placement by role, token, isolation, teardown, failures."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import yaml
from conftest import ROOT, job_finished, job_records, sh, wait_until

import hpcrl
from hpcrl.raycluster.ports import block_starts, choose_block
from hpcrl.slurm.render import render_hetjob
from hpcrl.slurm.sbatch import HetjobExecutor, write_spec

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable in the job


def ray_processes_of(job_id: str) -> list[int]:
    """Live (non-zombie) processes whose command line names the job's Ray temp dirs."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (p / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and f"hpcrl-ray-{job_id}-" in cmd:
            pids.append(int(p.name))
    return pids


def inspect_cluster(run_dir, roles):
    """Runs in component 0 after the barrier."""
    import json

    import ray

    from hpcrl.raycluster import connect

    connect(run_dir)
    nodes = sorted((n["Labels"]["hpcrl.node"], n["NodeManagerAddress"], n["Labels"]["hpcrl.jobspec"])
                   for n in ray.nodes() if n["Alive"])

    @ray.remote(num_cpus=0)
    def where():
        return (os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_PARTITION"], ray.util.get_node_ip_address(),
                os.environ.get("CUDA_VISIBLE_DEVICES"))

    placed = {r: ray.get(where.options(resources={f"role:{r}": 0.01}).remote()) for r in roles}
    ray.shutdown()
    cluster = json.loads((Path(run_dir) / "ray" / "cluster.json").read_text())
    probe = f"import ray; ray.init(address={cluster['address']!r}); print('JOINED')"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    procs = {name: subprocess.Popen([sys.executable, "-c", probe], env={**base, **extra}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, extra in (("no token", {}),
                                 ("wrong token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}))}
    tries = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        tries[name] = (p.returncode, "JOINED" in out, "InvalidAuthToken" in err)
    token_mode = oct(os.stat(Path(run_dir) / "ray" / "token").st_mode & 0o777)
    return {"nodes": nodes, "placed": placed, "tries": tries, "token_mode": token_mode,
            "address": cluster["address"], "ray_pids": len(ray_processes_of(cluster["job_id"]))}


def four_node_spec(tmp_path, name):
    data = yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text())
    data["roles"]["actor_rollout"]["nodes"] = 2
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return hpcrl.load_spec(path, run_dir=tmp_path / name)


ROLES = ["actor_rollout", "critic", "ref", "reward"]
PARTITION = {"actor_rollout": "a100", "critic": "h100", "ref": "cpu", "reward": "cpu"}


@pytest.mark.slurm
def test_two_jobs_each_get_their_own_labelled_secured_cluster(slurm_cluster, tmp_path):
    jobs = [HetjobExecutor(four_node_spec(tmp_path, n).to_hetjob(python=sys.executable))
            .submit(inspect_cluster, str(tmp_path / n), ROLES) for n in ("one", "two")]
    results = [j.result() for j in jobs]
    for job, res in zip(jobs, results):
        alloc = {int(r["HetJobOffset"]): r["NodeList"] for r in job_records(job.job_id)}
        assert len(res["nodes"]) == 4, res["nodes"]
        # only its own nodes, every one labelled with its own job id
        assert {n[2] for n in res["nodes"]} == {job.job_id}
        assert sorted(n[0] for n in res["nodes"]) == sorted(
            sh("scontrol", "show", "hostnames", ",".join(alloc.values())).split())
        for role, (node, partition, ip, cuda) in res["placed"].items():
            # each node's own GPUs; the batch shell's CUDA_VISIBLE_DEVICES leaks nowhere
            assert cuda == "" if partition == "cpu" else re.fullmatch(r"[0-3]", cuda), (role, cuda)
            assert partition == PARTITION[role], (role, node, partition)
            assert node in sh("scontrol", "show", "hostnames", alloc[ROLES.index(role) if role != "reward" else 2])
            assert ip == sh("scontrol", "show", "node", node).split("NodeAddr=")[1].split()[0]
        assert res["tries"]["no token"][:2] != (0, True) and res["tries"]["no token"][1] is False
        assert res["tries"]["wrong token"][1] is False and res["tries"]["wrong token"][2] is True
        assert res["token_mode"] == "0o600"
        assert res["ray_pids"] >= 4
    # both ran on the same a100 nodes at the same time, on different ports
    assert results[0]["address"] != results[1]["address"]
    for job in jobs:
        wait_until(lambda: job_finished(job.job_id), 300, "job end")
        wait_until(lambda: not ray_processes_of(job.job_id), 15, f"no Ray process of job {job.job_id}")


@pytest.mark.slurm
def test_a_node_that_never_starts_fails_the_barrier_by_name(slurm_cluster, tmp_path):
    spec = hpcrl.load_spec(ROOT / "jobs" / "tiny-cpu.yaml", run_dir=tmp_path / "run")
    job = spec.to_hetjob(python=sys.executable)
    job.env["HPCRL_RAY_START_TIMEOUT"] = "20"
    script = "\n".join(line for line in render_hetjob(job).splitlines()
                       if not line.startswith("srun --het-group=2"))  # component 2's Ray node never starts
    write_spec(tmp_path / "run", spec.as_data())      # as hpcrl submit does: the driver reads it while it waits
    (tmp_path / "job.sbatch").write_text(script)
    jid = sh("sbatch", "--parsable", str(tmp_path / "job.sbatch")).strip()
    wait_until(lambda: job_finished(jid), 300, "job end")
    assert job_records(jid)[0]["JobState"] == "FAILED"
    out = (tmp_path / "run" / "logs" / f"slurm-{jid}.out").read_text()
    node = re.search(r"component 2 \(ref,reward\) on cpu: (\w+)@", out).group(1)
    assert f"Missing nodes: {node}. Their logs: {tmp_path}/run/logs/ray/{node}.log" in out
    assert "timed out after 20s" in out
    wait_until(lambda: not ray_processes_of(jid), 15, "no Ray process left after the failure")


@pytest.mark.slurm
def test_mpi_rendezvous_brings_up_the_same_cluster(slurm_cluster, tmp_path):
    """bootstrap: mpi — one srun --mpi=pmix step over the 4 nodes of 3 components: rank 0 starts the
    head and broadcasts its address, an MPI allgather is the barrier."""
    spec = four_node_spec(tmp_path, "mpi")
    spec.bootstrap = "mpi"
    job = HetjobExecutor(spec.to_hetjob(python=sys.executable)).submit(inspect_cluster, str(tmp_path / "mpi"), ROLES)
    res = job.result()
    assert len(res["nodes"]) == 4 and {n[2] for n in res["nodes"]} == {job.job_id}
    for role, (node, partition, ip, cuda) in res["placed"].items():
        assert partition == PARTITION[role], (role, node, partition)
    assert res["tries"]["wrong token"][1] is False and res["token_mode"] == "0o600"
    cluster = yaml.safe_load((tmp_path / "mpi" / "ray" / "cluster.json").read_text())
    assert cluster["bootstrap"] == "mpi"
    ready = (tmp_path / "mpi" / "ray" / f"ready.{cluster['run_id']}").read_text()
    assert re.fullmatch(r"4 nodes after [\d.]+ s \(MPI rendezvous\)\n", ready), ready
    wait_until(lambda: job_finished(job.job_id), 300, "job end")
    wait_until(lambda: not ray_processes_of(job.job_id), 15, f"no Ray process of job {job.job_id}")


@pytest.mark.slurm
def test_mpi_asked_for_without_mpi4py_is_refused_before_submission(slurm_cluster, tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    spec = four_node_spec(tmp_path, "nompi")
    spec.bootstrap, spec.python = "mpi", str(tmp_path / "bare" / "bin" / "python")
    with pytest.raises(hpcrl.SpecError) as e:
        hpcrl.submit(spec)
    assert "bootstrap: mpi, but mpi4py does not load in" in str(e.value) and "ModuleNotFoundError" in str(e.value)
    assert "or choose bootstrap: auto (polls where MPI is missing) or poll" in str(e.value)
    assert not (tmp_path / "nompi").exists()        # nothing written, nothing submitted
    spec.bootstrap = "auto"                          # auto renders both starts and decides in the job
    script = render_hetjob(spec.to_hetjob(python=sys.executable))
    assert 'if [ "$bootstrap" = mpi ]; then' in script
    assert re.search(r"srun --mpi=pmix --het-group=0 --nodes=2 --ntasks-per-node=1 --overlap \S+ -m hpcrl.raycluster node "
                     r'"\$HPCRL_RUN_DIR" : --het-group=1 --nodes=1 .* : --het-group=2 --nodes=1 ', script)


def test_port_blocks_of_one_job_never_overlap_skip_busy_ports_and_the_ephemeral_range():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    starts = block_starts()
    assert starts and all(s + 200 <= low or s > high for s in starts)   # blocks are SIZE (200) ports
    blocks = [choose_block("77", k, 4).start for k in range(4)]
    assert len(set(blocks)) == 4
    with socket.socket() as s:
        s.bind(("0.0.0.0", blocks[1] + 5))  # one busy port in node 1's block
        moved = choose_block("77", 1, 4).start
    assert moved not in blocks and (starts.index(moved) - starts.index(blocks[1])) % 4 == 0
    # every port a head binds is in its block, Ray Client's server's too (this venv has grpc; the
    # container test's image has not, and there `ray start` must not be given the port)
    head = dict(a[2:].split("=") for a in choose_block("77", 0, 4).ray_start_args(head=True))
    assert "ray-client-server-port" in head and all(blocks[0] <= int(p) < blocks[0] + 200 for p in head.values())


def test_local_mode_advertises_every_role_in_a_private_temp_dir(tmp_path):
    """`hpcrl run --local`'s Ray: every role advertised, the token 0600, and its session in a fresh
    0700 folder of this user's (ray_temp_dir, as a job's nodes), never Ray's shared /tmp/ray; at exit
    the folder is gone and Ray's logs are in the run directory."""
    script = f"""
import os, ray
from hpcrl.raycluster import start_local
start_local(["actor_rollout", "critic"], run_dir={str(tmp_path)!r}, num_cpus=1)
res = ray.cluster_resources()
@ray.remote(num_cpus=0, resources={{"role:critic": 0.01}})
def f(): return 42
print(res["role:critic"], res["role:actor_rollout"], ray.get(f.remote()), oct(os.stat({str(tmp_path)!r} + "/ray/token").st_mode & 0o777))
session = ray._private.worker._global_node.get_session_dir_path()
folder = os.stat(os.path.dirname(os.path.dirname(session)))
print(oct(folder.st_mode & 0o777), folder.st_uid == os.getuid(), session)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    *said, session = out.stdout.split()
    assert said == ["1.0", "1.0", "42", "0o600", "0o700", "True"], out.stderr[-2000:]
    session = Path(session)
    folder = session.parent.parent       # FOLDER/ray/session_...
    assert session.parent.name == "ray" and folder.name.startswith("hpcrl-ray-local-"), session
    assert not session.is_relative_to("/tmp/ray"), session
    assert not folder.exists(), f"{folder} left behind"
    assert (tmp_path / "logs" / "ray" / "local" / "raylet.out").exists(), sorted((tmp_path / "logs").rglob("*"))


def test_node_tasks_of_one_mpi_step_see_their_own_component():
    from hpcrl.raycluster.rendezvous import own_component, resolve, without_pmi

    env = {"SLURM_JOB_PARTITION": "cpu", "SLURM_JOB_PARTITION_HET_GROUP_0": "a100",
           "SLURM_JOB_PARTITION_HET_GROUP_1": "h100", "PMIX_RANK": "1", "PMI_FD": "5", "OMPI_MCA_x": "y",
           "SLURM_PMIXP_ABORT_AGENT_PORT": "1", "PATH": "/bin"}
    assert own_component(env, 1)["SLURM_JOB_PARTITION"] == "h100"
    assert own_component(env, 0)["SLURM_JOB_PARTITION"] == "a100"
    assert without_pmi(env) == {k: v for k, v in env.items() if k.startswith(("SLURM_JOB", "PATH"))}
    assert resolve("poll", "pmix") == ("poll", "bootstrap: poll")
    with pytest.raises(ValueError, match="bootstrap: 'sometimes' is not one of poll, mpi, auto"):
        resolve("sometimes", "pmix")


def test_the_barrier_reads_only_failures_written_whole(tmp_path):
    """A node that fails writes its reason under a dot name and renames it into place (the batch
    script's hpcrl_in, the node's atomic write): the barrier, polling every 10 ms, must not take a
    file still being written for a failure without a reason (seen once in CI: "a node failed (h100n1: )")."""
    from hpcrl.raycluster.session import _failures
    from hpcrl.run_dir import RunDir

    failed = RunDir(tmp_path).ray_failed
    failed.mkdir(parents=True)
    (failed / ".h100n1").write_text("")                       # tee has opened it, not yet written
    (failed / ".cpun1.tmp123").write_text("[hpcrl] half")      # atomic_write_text's temporary name
    assert _failures(tmp_path) is None
    (failed / ".h100n1").write_text("[hpcrl] node h100n1: the image /x (for ch-run) does not exist there\n")
    (failed / ".h100n1").rename(failed / "h100n1")
    assert _failures(tmp_path) == "h100n1: [hpcrl] node h100n1: the image /x (for ch-run) does not exist there\n"
