"""The single-controller runtime on a real (local) Ray: real actor processes, real gloo groups,
real SIGKILLs."""
import io
import logging
import os
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import kill_dead, wait_until

from hpcrl.controller import (
    Dispatch,
    DispatchMode,
    ResourcePool,
    RoleRestartLimit,
    Worker,
    WorkerGroup,
    register,
    register_dispatch,
)
from hpcrl.controller.batch import Batch
from hpcrl.observe.overview import format_status

# Every other rank gets the batch, the rest nothing: a custom mode to show the hook works.
register_dispatch(DispatchMode("EVEN_RANKS", lambda n, a, k: [(a, k) if r % 2 == 0 else None for r in range(n)],
                               lambda results: sum(results)))


class Tripwire:
    """Records the pid of every process that unpickles it: the driver must never appear."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _tripped, (self.path,)


def _tripped(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return Tripwire(path)


class Toy(Worker):
    def __init__(self, offset=0, seed=0):
        self.offset, self.calls = offset, 0
        torch.manual_seed(seed + self.rank)
        self.layer = torch.nn.Linear(3, 2)
        print(f"built {self.role} at rank {self.rank}")

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self):
        return self.role, self.rank, self.world_size, os.getpid(), dist.get_world_size()

    @register(Dispatch.ONE_TO_ALL)
    def allreduce(self, v):
        t = torch.tensor([float(v * (self.rank + 1))])
        dist.all_reduce(t)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def die_beside_a_peer_error(self, marker: str):
        """First call: rank 1's process dies, and rank 0 fails as a collective's peer of a dead rank
        does, with an error of its own that reaches the driver before Ray has seen the death; after
        the rebuild, each returns its rank."""
        if not os.path.exists(f"{marker}.{self.rank}"):
            open(f"{marker}.{self.rank}", "w").close()
            if self.rank == 1:
                time.sleep(1.0)
                os._exit(1)
            raise RuntimeError("Read error: Connection reset by peer")
        return self.rank

    @register(Dispatch.ALL_TO_ALL)
    def echo(self, x):
        return self.rank, x

    @register(Dispatch.RANK_ZERO)
    def leader(self):
        return self.rank

    @register("EVEN_RANKS")
    def one(self):
        return 1

    @register(Dispatch.ONE_TO_ALL)
    def count(self):
        self.calls += 1
        return self.calls

    @register(Dispatch.DP_COMPUTE)
    def add(self, batch, k=1, sleep=0.0, tripwire=None):
        time.sleep(sleep)
        x = batch["x"] if "x" in batch else batch["y"]
        out = Batch({"y": x + k + self.offset}, {"rank": np.full(len(batch), self.rank)})
        if tripwire:
            out.meta["tripwire"] = Tripwire(tripwire)
        return out

    @register(Dispatch.DP_COMPUTE)
    def forward(self, batch):
        with torch.no_grad():
            return Batch({"out": self.layer(batch["f"])})


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray
    from ray import cloudpickle

    from hpcrl.raycluster.session import start_local

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable in the workers
    run = tmp_path_factory.mktemp("run")
    start_local(["a", "b", "c"], run_dir=run, num_cpus=6)
    yield run
    ray.shutdown()


def test_dispatch_modes(ray_local):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=3), Toy)
    try:
        who = a.whoami()
        assert [w[:3] for w in who] == [("a", r, 3) for r in range(3)] and all(w[4] == 3 for w in who)
        assert len({w[3] for w in who}) == 3   # three processes
        assert a.allreduce(2) == [12.0] * 3    # 2 * (1 + 2 + 3) through gloo
        assert a.echo(["x", "y", "z"]) == [(0, "x"), (1, "y"), (2, "z")]
        assert a.leader() == 0
        assert a.one() == 2                    # ranks 0 and 2 only
        with pytest.raises(TypeError, match="list of 3"):
            a.echo(["x"])
    finally:
        a.shutdown()


def test_dp_compute_keeps_order_for_any_batch_size(ray_local):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=3), Toy)
    try:
        for n in (1, 2, 4, 7, 10):
            out = a.add(Batch({"x": torch.arange(n)}), k=5)
            assert out["y"].tolist() == [i + 5 for i in range(n)]
            expected_rank = np.concatenate([np.full(len(c), r) for r, c in enumerate(np.array_split(np.arange(n), 3))])
            assert out["rank"].tolist() == expected_rank.tolist()
    finally:
        a.shutdown()


def test_future_goes_group_to_group_without_the_driver(ray_local, tmp_path):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=3), Toy)
    b = WorkerGroup(ResourcePool.for_role("b", processes_per_node=2), Toy, init_kwargs={"offset": 100})
    c = WorkerGroup(ResourcePool.for_role("c", processes_per_node=3), Toy, init_kwargs={"offset": 1000})
    wire = tmp_path / "unpickled_by"
    try:
        x = Batch({"x": torch.arange(7)})
        fut = a.add.future(x, tripwire=str(wire))
        assert b.add(fut)["y"].tolist() == [i + 1 + 1 + 100 for i in range(7)]      # 3 ranks -> 2: rechunked
        assert c.add(fut)["y"].tolist() == [i + 1 + 1 + 1000 for i in range(7)]     # 3 -> 3: rank to rank
        pids = {int(p) for p in wire.read_text().split()}
        assert os.getpid() not in pids and pids    # the Batch was unpickled, but never by the driver
        assert fut.result().meta["tripwire"]       # control: fetching it does trip the wire here
        assert os.getpid() in {int(p) for p in wire.read_text().split()}
    finally:
        for g in (a, b, c):
            g.shutdown()


def test_colocated_and_split_layouts_give_the_same_results(ray_local):
    feats = Batch({"f": torch.randn(5, 3, generator=torch.Generator().manual_seed(1))})
    split = {"a": WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Toy, init_kwargs={"seed": 7}),
             "b": WorkerGroup(ResourcePool.for_role("b", processes_per_node=2), Toy, init_kwargs={"seed": 8})}
    split_out = {r: wg.forward(feats)["out"] for r, wg in split.items()}
    split_pids = {r: wg.pids() for r, wg in split.items()}
    for wg in split.values():
        wg.shutdown()
    pool = ResourcePool.for_role("a", processes_per_node=2, max_colocate_count=2)
    fused = WorkerGroup.colocated(pool, {"a": (Toy, (), {"seed": 7}), "b": (Toy, (), {"seed": 8})})
    try:
        assert fused["a"].pids() == fused["b"].pids()            # one process per rank for both roles
        assert set(split_pids["a"]).isdisjoint(split_pids["b"])  # vs. a process per role and rank
        for r, wg in fused.items():
            assert torch.equal(wg.forward(feats)["out"], split_out[r])
        assert fused["a"].whoami()[1][:2] == ("a", 1) and fused["b"].whoami()[1][:2] == ("b", 1)
    finally:
        fused["a"].shutdown()
    with pytest.raises(ValueError, match="max_colocate_count=1"):
        WorkerGroup.colocated(ResourcePool.for_role("a"), {"a": (Toy, (), {}), "b": (Toy, (), {})})


def test_killed_rank_rebuilds_its_role_only_and_the_call_completes(ray_local, caplog):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Toy, log_dir=ray_local / "logs")
    b = WorkerGroup(ResourcePool.for_role("b", processes_per_node=2), Toy, log_dir=ray_local / "logs")
    try:
        a.count(), b.count()
        a_pids, b_pids = a.pids(), b.pids()
        x = Batch({"x": torch.arange(6)})
        fut = a.add.future(x, sleep=3.0)
        time.sleep(1.0)
        kill_dead(a_pids[1])
        with caplog.at_level(logging.WARNING, logger="hpcrl.controller"):
            out = fut.result()
        assert out["y"].tolist() == [i + 1 for i in range(6)]
        assert "role a: rank 1 died during add" in caplog.text
        new_a = a.pids()
        assert set(new_a).isdisjoint(a_pids) and b.pids() == b_pids
        assert a.count() == [1, 1] and b.count() == [2, 2]   # a restarted from init, b kept its state
        # per-role logs, dated, role and rank on every line, from both the old and the rebuilt process
        lines = (ray_local / "logs" / "a" / "rank1.log").read_text().splitlines()
        assert [line[24:] for line in lines].count("[a rank1] built a at rank 1") == 2
        assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[a rank1\] ", line) for line in lines)
    finally:
        a.shutdown()
        b.shutdown()


def test_restart_limit_stops_the_run_with_the_role_named(ray_local):
    a = WorkerGroup(ResourcePool.for_role("a"), Toy, restart_limit=1)
    try:
        kill_dead(a.pids()[0])
        assert a.count() == [1]      # first death: rebuilt
        kill_dead(a.pids()[0])
        with pytest.raises(RoleRestartLimit, match=r"role a: rank 0 died during count.*restart_limit=1"):
            a.count()
    finally:
        a.shutdown()


class Warmed(Toy):
    @classmethod
    def warm_up(cls):
        os.environ["WARMED_AT"] = str(time.time())     # the process's (a class sent by value has globals of its own)

    def __init__(self):
        super().__init__()
        self.built_at = time.time()

    @register(Dispatch.ONE_TO_ALL)
    def warmed_before_built(self):
        return float(os.environ.get("WARMED_AT", "inf")) < self.built_at


class Compiles(Warmed):
    """Calls the compiled decoder layers of a tiny Llama, as a training engine does (Dynamo with its
    eager backend: what is checked is Dynamo's cache of compiled code, which a rehearsal fills, not
    Inductor's kernels). Its layer class is importable, as a real role's is: a class sent by value
    gets new code objects with every copy, which Dynamo's cache would not recognise."""
    def __init__(self):
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        from hpcrl.controller.layer_rehearsal import compile_layers

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(LlamaConfig(
            hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
            vocab_size=50))
        compile_layers(list(self.model.model.layers), backend="eager")

    @register(Dispatch.ONE_TO_ALL)
    def new_graphs(self):
        """The graphs Dynamo made for training calls and inference calls, each at two lengths."""
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        for length in (5, 9):
            ids = torch.randint(0, 50, (2, length))
            self.model.train()
            self.model(input_ids=ids, use_cache=False).logits.sum().backward()
            self.model.eval()
            with torch.no_grad():
                self.model(input_ids=ids, use_cache=False)
        return counters["stats"]["unique_graphs"] - before


def test_standby_process_takes_over_a_dead_rank_with_its_imports_done_and_layers_compiled(ray_local):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Compiles, standby=True)
    try:
        assert a._hosts.standby == []                          # none while the run starts
        a.start_standby()
        standby_pids = [int(p) for p in __import__("ray").get([h.pid.remote() for h in a._hosts.standby])]
        assert a.warmed_before_built() == [False, False]      # the ranks' own processes did not wait for it
        assert min(a.new_graphs()) >= 2                         # a new process compiles its layers' calls
        ready = lambda: a.describe()["standby"]               # noqa: E731  (as status.json shows it)
        wait_until(lambda: ready() == {"processes": 2, "ready": 2}, 60, "both standby processes warm")
        a.start_standby()                                       # a step later: they rehearse their ranks' calls
        wait_until(lambda: ready() == {"processes": 2, "ready": 2}, 60, "both standby processes rehearsed")
        kill_dead(a.pids()[0])
        assert a.allreduce(1) == [3.0, 3.0]
        assert a.pids() == standby_pids
        assert a.warmed_before_built() == [True, True]        # a rebuild takes every rank's standby
        assert a.new_graphs() == [0, 0]                         # ... which had compiled the calls already
        wait_until(lambda: ready() == {"processes": 2, "ready": 2}, 60, "new standby processes")   # for the next
        run = {"state": "running", "step": 3, "total_steps": 9, "updated": time.time(), "roles": {"a": a.describe()}}
        assert "standby 2/2 warm" in format_status({"job": None, "ray": None, "run": run, "checkpoint": None})
    finally:
        a.shutdown()
    # auto: only where the processes hold GPUs (none here)
    b = WorkerGroup(ResourcePool.for_role("a", processes_per_node=1), Toy, standby="auto")
    try:
        b.start_standby()
        assert b._hosts.standby == []
    finally:
        b.shutdown()


def test_a_peers_error_after_a_rank_died_rebuilds_the_dead_rank(ray_local, tmp_path):
    """Whichever error Ray hands over first, the death is what is recovered from, not the peer's error."""
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Toy)
    try:
        assert a.die_beside_a_peer_error(str(tmp_path / "died")) == [0, 1]
        assert a.describe()["restarts"] == 1
    finally:
        a.shutdown()


def test_pool_for_a_role_no_node_carries(ray_local):
    from hpcrl.controller import ResourcePoolError

    with pytest.raises(ResourcePoolError, match=r"no alive Ray node carries role 'critic' \(roles present: \['a', 'b', 'c'\]\)"):
        ResourcePool.for_role("critic")


GPU_NODE = """
import ray
from hpcrl.controller import ResourcePool, ResourcePoolError, Worker, WorkerGroup
from hpcrl.raycluster.session import start_local

class Idle(Worker):
    pass

start_local(["a", "b", "c"], num_cpus=4, num_gpus=2)     # one node with two (Ray-counted) GPUs
pool = ResourcePool.for_role("a", max_colocate_count=2)
fused = WorkerGroup.colocated(pool, {"a": (Idle, (), {}), "b": (Idle, (), {})})
print("gpus of the colocated ranks:", sorted(map(tuple, fused["a"]._hosts.gpu_ids)))
try:
    pool = ResourcePool.for_role("c")
    pool.placement_groups(pool.nodes, timeout_s=5)
    print("a GPU process of role c was placed")
except ResourcePoolError as e:
    print("refused:", e)

class Cpu(Worker):
    uses_gpus = False

cpu = WorkerGroup(ResourcePool.for_role("c", uses_gpus=False), Cpu)
print("a CPU-only role's ranks beside them, gpus:", [list(g) for g in cpu._hosts.gpu_ids])
ray.shutdown()
"""


def test_colocated_processes_hold_whole_gpus():
    """Two roles colocated on a node of two GPUs: one process per GPU, each holding all of its GPU,
    so another role's GPU process finds no room on that node (a half-GPU reservation would leave
    it room on "the rest" of both GPUs), while a CPU-only role's process does."""
    out = subprocess.run([sys.executable, "-c", GPU_NODE], capture_output=True, text=True, timeout=300)
    assert "gpus of the colocated ranks: [('0',), ('1',)]" in out.stdout, out.stdout + out.stderr
    assert "refused: role 'c': 2 processes of {'CPU': " in out.stdout and "'GPU': 1} per node" in out.stdout, out.stdout
    # a role whose processes use no GPU (the environments) still fits, one process holding no GPU
    assert "a CPU-only role's ranks beside them, gpus: [[]]" in out.stdout, out.stdout + out.stderr


def test_role_log_keeps_the_process_stream_descriptor(tmp_path):
    """Code below Python (C libraries; vLLM silences them by redirecting sys.stdout's descriptor)
    needs a descriptor: a worker's RoleLog gives the original stream's."""
    from hpcrl.controller.worker import RoleLog

    class Host:
        lines = []

        def log_line(self, line, echo):
            self.lines.append(line)

    with open(tmp_path / "out", "w") as echo:
        log = RoleLog(Host(), echo)
        print("through python", file=log)
        os.write(log.fileno(), b"below python\n")
    assert Host.lines == ["through python"]
    assert (tmp_path / "out").read_text() == "below python\n"


def test_role_log_cuts_output_without_a_newline_at_its_line_limit():
    """Output that never ends its line (a progress bar redrawn in place, a dump on one line) waits in
    memory up to LINE_LIMIT characters, then goes out as a line of its own marked as cut; ordinary
    lines pass as they are, nothing is lost or reordered, and how the text was split into writes
    changes nothing."""
    from hpcrl.controller.worker import RoleLog

    class Host:
        def __init__(self):
            self.lines = []

        def log_line(self, line, echo):
            self.lines.append(line)
    limit, seed = RoleLog.LINE_LIMIT, random.randrange(2**32)
    rng = random.Random(seed)
    text = "".join(["step 1\nstep 2\n", "".join(rng.choice("=>\r ") for _ in range(5 * limit + 123)), "\ndone\n",
                    "x" * limit, "\n", "z" * (2 * limit + 5), "\n", "y" * (limit + 1)])
    whole, chunked, held, at = RoleLog(Host(), io.StringIO()), RoleLog(Host(), io.StringIO()), 0, 0
    whole.write(text)
    while at < len(text):
        size = rng.randint(1, 20_000)
        chunked.write(text[at:at + size])
        at, held = at + size, max(held, len(chunked.pending))
    cut = RoleLog.CUT.format(limit)
    lines = chunked.host.lines
    assert held <= limit, f"seed {seed}: {held} characters held"
    assert (lines, chunked.pending) == (whole.host.lines, whole.pending), f"seed {seed}"
    marked = [line for line in lines if line.endswith(cut)]
    assert len(marked) == 5 + 2 + 1 and {len(line) for line in marked} == {limit + len(cut)}, f"seed {seed}"
    assert lines[:2] == ["step 1", "step 2"] and "x" * limit in lines and "z" * 5 in lines, f"seed {seed}"
    rebuilt = "".join(line.removesuffix(cut) if line.endswith(cut) else line + "\n" for line in lines)
    assert rebuilt + chunked.pending == text and chunked.pending == "y", f"seed {seed}"
