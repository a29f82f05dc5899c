"""Fixtures on the real local Slurm cluster (slurm/cluster)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Two tests at a time on 2 cores, each starting processes whose torch runs 2 or more threads: OpenMP's
# waiting threads spin by default, and oversubscribed they take the cores from the threads with work
# (two SmolLM2 tests side by side: 50 s spinning, 18 s sleeping). Here, before any test process loads
# torch, so that it and every process it starts (Ray's, the Slurm jobs') wait asleep; the arithmetic is
# the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from hpcrl.observe.metrics import read_metrics
from hpcrl.ppo.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "slurm" / "cluster"


@pytest.fixture(autouse=True)
def _process_environment_restored():
    """Each test gets the environment the session had: an in-process engine (vLLM sets TMPDIR and
    its cache root for its own process) must not leak into the sbatch, Ray and chromium of later tests."""
    env, tmp = dict(os.environ), tempfile.tempdir
    yield
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = tmp


def _cluster(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True)


def _lock_file(what: str):
    """A lock file of this checkout's cluster, outside its state directory (which `up` makes)."""
    state = os.environ.get("HPCRL_SLURM_STATE", str(ROOT / ".slurm-state"))
    return open(Path(tempfile.gettempdir()) / f"hpcrl-cluster-{what}-{hashlib.sha1(state.encode()).hexdigest()[:12]}.lock", "a")


@pytest.fixture(scope="session")
def slurm_cluster():
    """Brings the cluster up once per session, one session at a time (xdist's workers are sessions);
    takes it down only if this session started it, once no other session uses it."""
    with _lock_file("up") as starting, _lock_file("users") as users:
        fcntl.flock(starting, fcntl.LOCK_EX)
        was_up = _cluster("status").returncode == 0
        up = _cluster("up", "--timeout", "120")
        fcntl.flock(users, fcntl.LOCK_SH)
        fcntl.flock(starting, fcntl.LOCK_UN)
        if up.returncode != 0:
            pytest.fail(f"slurm/cluster up failed:\n{up.stdout}\n{up.stderr}")
        conf = _cluster("env").stdout.strip().split("=", 1)[1]
        os.environ["SLURM_CONF"] = conf
        yield conf
        if not was_up:
            # the last test's turn is still held while session fixtures end: let it go, or a session
            # sharing the cluster, waiting for a turn while it holds `users`, would wait for this one for good
            CLUSTER_TURNS.release_all()
            fcntl.flock(users, fcntl.LOCK_EX)     # the other sessions are done with it
            _cluster("down")


EXCLUSIVE = "cluster_exclusive"
"""The marker of a test that disturbs the whole cluster (takes a node DOWN, preempts a node with an
urgent job, counts the queue): it runs while no other test of the cluster does."""


def pytest_configure(config):
    """Under `--dist loadgroup`, xdist hands out the work in the order pytest_collection_modifyitems
    gives it: by default it sorts the groups largest first, so the modules sharing a run of the cluster
    went out at once and a worker waited for the exclusive tests' turn (372 s in one run) while tests
    without the cluster were left to do."""
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)     # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Run side by side by pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run): the exclusive tests go to
    one worker, first, one after another, while the other workers start on the tests that need no
    cluster (a test of the cluster waits for its turn, _cluster_turn); the tests of a module whose
    own module- or session-scoped fixture makes a run go to one worker, so that it runs once. The
    order is the same in every worker, as xdist requires. Without xdist the order is the files'."""
    def shares_a_run(item) -> bool:
        return any(d.scope != "function" and d.func.__module__ == item.module.__name__
                   for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)

    def group(item, name: str) -> None:
        """xdist's loadgroup scope: `@name` at the end of the node id, which xdist's own xdist_group
        marker no longer sets under pytest 9.2 (the id is a NodeId now, xdist 3.8 sets the old _nodeid)."""
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{name}")

    # a module's XDIST_GROUP: modules whose tests must not run beside each other's (a count of host processes)
    scope = {i.nodeid: EXCLUSIVE if i.get_closest_marker(EXCLUSIVE) else getattr(i.module, "XDIST_GROUP", None)
             or (i.module.__name__ if shares_a_run(i) else None) for i in items}
    # exclusive first (those sharing pipelined_once at the head: it is made while others may still run),
    # then the tests without the cluster, then the cluster's (a group with a test of the cluster among
    # them); in each, the groups first; stable otherwise
    of_cluster = {scope[i.nodeid] or i.nodeid for i in items if "slurm_cluster" in i.fixturenames}
    rank = lambda i: (0 if scope[i.nodeid] == EXCLUSIVE and "pipelined_once" in i.fixturenames else   # noqa: E731
                      1 if scope[i.nodeid] == EXCLUSIVE else 3 if (scope[i.nodeid] or i.nodeid) in of_cluster else 2,
                      scope[i.nodeid] is None)     # a module's shared run (the longest units) before single tests
    if getattr(config.option, "loadgroup", False):      # an xdist worker under --dist loadgroup
        items.sort(key=rank)
        for item in items:
            if scope[item.nodeid]:
                group(item, scope[item.nodeid])


class ClusterTurns:
    """A readers-writer lock on the cluster, between the processes of this checkout's test runs (xdist's
    workers, or two runs at once): a test of the cluster shares it, an exclusive test holds it alone.
    flock(2) on two files in the cluster's state directory: `gate`, held by a waiting or running
    exclusive test, keeps new sharers out, so that a stream of shared tests cannot starve it; `turn`,
    shared or exclusive. A killed process lets go of both. Reentrant within a process (counted)."""

    def __init__(self):
        self.mode, self.count, self.files = None, 0, None
        self.test_holds = False     # the running test's own hold (a fixture's hold is counted, not flagged)

    def _open(self):
        if self.files is None:
            state = Path(os.environ["SLURM_CONF"]).parent
            self.files = {n: open(state / f"tests-{n}.lock", "a+") for n in ("gate", "turn")}
        return self.files

    def acquire(self, exclusive: bool) -> None:
        if self.count:
            if exclusive and self.mode != "exclusive":
                raise RuntimeError("an exclusive test began while this process shares the cluster: a module- "
                                   "or session-scoped fixture holds a run; order the exclusive tests first")
            self.count += 1
            return
        f = self._open()
        fcntl.flock(f["gate"], fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(f["turn"], fcntl.LOCK_EX)       # the gate stays held: sharers wait behind it
        else:
            fcntl.flock(f["turn"], fcntl.LOCK_SH)
            fcntl.flock(f["gate"], fcntl.LOCK_UN)
        self.mode, self.count = ("exclusive" if exclusive else "shared"), 1

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            for f in self.files.values():
                fcntl.flock(f, fcntl.LOCK_UN)
            self.mode = None

    def release_all(self) -> None:
        if self.count:
            self.count = 1
            self.release()
        self.test_holds = False

    @contextlib.contextmanager
    def shared(self):
        """The cluster shared while a fixture's own jobs run (a reference run, jobs that outlive setup)."""
        self.acquire(exclusive=False)
        try:
            yield
        finally:
            self.release()


CLUSTER_TURNS = ClusterTurns()


def _exclusive_on_cluster(item) -> bool:
    return item is not None and bool(item.get_closest_marker(EXCLUSIVE)) and "slurm_cluster" in item.fixturenames


@pytest.fixture(autouse=True)
def _cluster_turn(request):
    """A test of the cluster waits for its turn (ClusterTurns), from before its function-scoped
    fixtures to after them (pytest_runtest_teardown lets go); an exclusive test keeps the cluster
    for the exclusive test after it."""
    if "slurm_cluster" in request.fixturenames:
        exclusive = _exclusive_on_cluster(request.node)
        if CLUSTER_TURNS.test_holds and not (exclusive and CLUSTER_TURNS.mode == "exclusive"):
            CLUSTER_TURNS.test_holds = False
            CLUSTER_TURNS.release()
        if not CLUSTER_TURNS.test_holds:
            CLUSTER_TURNS.acquire(exclusive)
            CLUSTER_TURNS.test_holds = True
    yield


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        keep = CLUSTER_TURNS.mode == "exclusive" and CLUSTER_TURNS.count == 1 and _exclusive_on_cluster(nextitem)
        if CLUSTER_TURNS.test_holds and not keep:
            CLUSTER_TURNS.test_holds = False
            CLUSTER_TURNS.release()


LEARNING_STEPS = 160
"""Steps of the tests that train the tiny task with the torch engine to the bar (the last 10 steps'
mean reward ≥ 0.9): the shipped specs run 300; on seed 1 the last-10 mean at step 160 was 0.98 for
PPO as a hetjob, 0.96 for GRPO (0.98 at 200), 0.985 for RLOO with dynamic sampling, and pipelined
PPO had 0.965 by step 120; they plateau there. The vLLM rollout learns later (tests/test_vllm.py)."""


def with_train(spec: dict, **changes) -> dict:
    """The spec's data with training settings changed, as TrainConfig.updated takes them (a section's
    fields, settings by themselves, or flat keys), written back in sections."""
    spec["train"] = TrainConfig.model_validate(spec.get("train") or {}).updated(**changes).model_dump(
        mode="json", exclude_unset=True)
    return spec


def short_spec(tmp_path, name, job="tiny-cpu.yaml", steps=40, **overrides):
    """A job of jobs/ for `steps` steps, its critic data-parallel on both h100 nodes, writing its
    checkpoints with parallel HDF5 (the pipelined job's actor moves to a100 to make room)."""
    import yaml

    spec = yaml.safe_load((ROOT / "jobs" / job).read_text())
    with_train(spec, total_steps=steps, progress=False, checkpoint_io="parallel")
    spec["roles"]["critic"]["nodes"] = 2
    if spec["roles"]["actor_rollout"]["partition"] == "h100":
        spec["roles"]["actor_rollout"].update(partition="a100", gpu_type="a100")
    spec.update(overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


PIPELINED_STEPS = 80
"""Steps of the pipelined job that a preempted run (test_requeue.py) and a run that loses a node
(test_node_loss.py) are compared with, bitwise."""


@pytest.fixture(scope="session")
def pipelined_once(slurm_cluster, tmp_path_factory) -> Path:
    """The run directory of jobs/tiny-cpu-pipelined.yaml as short_spec makes it (PIPELINED_STEPS),
    trained on the cluster without interruption: the reference of the interrupted runs."""
    tmp = tmp_path_factory.mktemp("pipelined")
    once = tmp / "once"
    with CLUSTER_TURNS.shared():
        job = submit(short_spec(tmp, "tiny", job="tiny-cpu-pipelined.yaml", steps=PIPELINED_STEPS), once)
        wait_until(lambda: job_finished(job), 600, "uninterrupted run")
    assert len(read_metrics(once / "metrics.jsonl")) == PIPELINED_STEPS, slurm_log(once)
    return once


def saved_model(path: Path, config, tokenizer) -> Path:
    """A model transformers builds from `config` (seeded 0), saved in `path` with `tokenizer` (one
    hpcrl reads): a tiny model of a shape or kind create_model_dir does not build."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save(path)
    return path


def sh(*args: str, check: bool = True) -> str:
    out = subprocess.run(args, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout


def wait_until(cond, timeout: float, what: str, poll: float = 0.2, story=None):
    """`story`, where given, is called on a timeout and its text joins the failure (what the job did)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{story()}" if story else ""))


def kill_dead(pid: int) -> None:
    """SIGKILL, and back once the process is gone: a process the kernel has not yet stopped (busy
    in the kernel on a loaded machine) could otherwise still answer the next call."""
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True
    wait_until(gone, 30, f"process {pid} to die")


def job_records(job_id: str) -> list[dict]:
    from hpcrl.slurm.cluster_info import parse_records

    return parse_records(sh("scontrol", "show", "job", "-o", job_id))


def job_finished(job_id: str) -> bool:
    return all(r["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") for r in job_records(job_id))


def queue_ids() -> set[str]:
    return set(sh("squeue", "-h", "-o", "%i").split())


def submit(spec: Path, run: Path) -> str:
    """`hpcrl submit SPEC --run-dir RUN`, as a user types it; the job id."""
    subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(spec), "--run-dir", str(run)],
                   capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads((run / "job.json").read_text())["job_id"]


def slurm_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("slurm-*.out")))


@pytest.fixture(scope="session")
def image():
    """slurm/image's Charliecloud image (Debian, /opt/venv with this venv's packages and hpcrl),
    built once, cached between runs (.images/hpcrl)."""
    (ROOT / ".images").mkdir(exist_ok=True)
    with open(ROOT / ".images" / "build.lock", "a") as lock:    # one build at a time (xdist's workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = subprocess.run([str(ROOT / "slurm" / "image"), "build", "--venv", sys.prefix], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"slurm/image build failed:\n{out.stdout}\n{out.stderr}")
    return Path(out.stdout.strip().splitlines()[-1])


def in_image(spec: Path, image: Path, roles: list[str]) -> Path:
    """A copy of spec whose components headed by `roles` run in `image` (Charliecloud), its
    checkpoints written serially (parallel HDF5's writers are a Slurm step: refused in containers)."""
    import yaml

    data = with_train(yaml.safe_load(spec.read_text()), checkpoint={"io": "auto"})
    for role in roles:
        data["roles"][role]["container"] = {"runtime": "charliecloud", "image": str(image), "python": "/opt/venv/bin/python"}
    path = spec.with_name(f"{spec.stem}-in-image.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def in_container(pid: int) -> bool:
    """Whether a process runs under ch-run (it sets CH_RUNNING in what it runs)."""
    return b"CH_RUNNING=" in Path(f"/proc/{pid}/environ").read_bytes()


def keeping_off(spec: Path, victim: Path) -> Path:
    """A copy of spec whose every component keeps off the node of `victim`'s component 0, once that
    run has its nodes: an uninterrupted run beside the run that preempt_and_finish will preempt
    there (a job preempted on a node takes its whole hetjob with it)."""
    import yaml

    wait_until(lambda: (victim / "allocation.json").exists(), 300, f"{victim.name}'s nodes")
    node = json.loads((victim / "allocation.json").read_text())["components"][0]["nodes"][0]["name"]
    data = yaml.safe_load(spec.read_text())
    for role in data["roles"].values():
        if "same_nodes_as" not in role:
            role["sbatch_extra"] = [*role.get("sbatch_extra", []), f"--exclude={node}"]
    path = spec.with_name(f"{spec.stem}-off-{node}.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def preempt_and_finish(run: Path, job: str, timeout: float = 600) -> int:
    """An urgent job on the node of the run's component 0 preempts it (its signal, a checkpoint,
    a requeue); waits until the run has come back and finished. The step it stopped after, which
    the requeued job must have resumed from."""
    node = json.loads((run / "allocation.json").read_text())["components"][0]["nodes"][0]["name"]
    urgent = sh("sbatch", "--parsable", "-p", "urgent", "-w", node, "--exclusive", "-o", "/dev/null",
                "--wrap", "sleep 1").strip()
    wait_until(lambda: job_finished(urgent), 300, "urgent job")
    wait_until(lambda: job_finished(job), timeout, "the preempted run to requeue and finish")
    log = slurm_log(run)
    stopped = re.search(r"stopped after step (\d+)", log)
    assert stopped and f"resumed from checkpoint step {stopped.group(1)} " in log, log
    return int(stopped.group(1))


def start_local_training(run: Path, cfg: TrainConfig) -> subprocess.Popen:
    """The driver started the one way (`python -m hpcrl.launch RUN_DIR --local`) on a fresh local
    Ray in its own process (each run starts from a clean Ray). SIGUSR1 stops it at a committed
    checkpoint with exit code 3, as in a job."""
    from hpcrl.launch.entrypoint import write_local_spec

    write_local_spec(run, cfg)
    return subprocess.Popen([sys.executable, "-m", "hpcrl.launch", str(run), "--local", "--num-cpus", "2"], cwd=ROOT)


def run_local(run: Path, cfg: TrainConfig) -> list[dict]:
    """Train to the end locally; the metrics records."""
    proc = start_local_training(run, cfg)
    assert proc.wait(timeout=900) == 0
    return read_metrics(run / "metrics.jsonl")


UNINTERRUPTED = TrainConfig(total_steps=16, save_every=0, restart_limit=50, progress=False)
"""The training that stopped, killed and hung runs must end bitwise as: checkpoints only at a stop and at
the end, rebuilt roles allowed often."""


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The run directory and metrics of one uninterrupted local run of UNINTERRUPTED: the reference
    that tests/test_requeue.py and tests/test_restart.py compare against (one run, not one each)."""
    run = tmp_path_factory.mktemp("uninterrupted")
    return run, run_local(run, UNINTERRUPTED)


NOISE = {"rollout/log_prob_diff"}
"""Metrics that measure float noise (the sampler's log-probs against the trainer's recomputed ones,
~1e-7 on CPU): its size depends on how the CPU split the decoder's small matmuls among threads, which
a loaded machine can change between two runs whose training is bitwise the same (seen once in CI)."""


def comparable(records):
    """Metrics records without what depends on the clock (when, how long, how fast, how far an
    asynchronous rollout had got: buffer/); the NOISE metrics to 5 decimals."""
    return [{k: (round(v, 5) if k in NOISE and v is not None else v) for k, v in r.items()
             if k != "time" and not k.startswith(("timing/", "throughput/", "buffer/"))} for r in records]


def plot_pixels_seen_by_chromium(html: Path, shot: Path) -> int:
    """Open html in headless Chromium, as a user's browser would, and count the screenshot's pixels
    in matplotlib's first line colour (#1f77b4): only the report's images contain it."""
    import numpy as np
    from matplotlib import image

    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1400,6000", html.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    rgb = image.imread(shot)[..., :3] * 255
    return int((np.abs(rgb - np.array([31, 119, 180])).max(axis=-1) < 12).sum())
