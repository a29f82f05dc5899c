"""CheckpointStore with real HDF5 files, a real tiny model and a real SIGKILL."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import ROOT, sh, wait_until

from hpcrl.checkpoint.format import read_role_file, rng_state, set_rng_state, write_role_file
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.controller import local_worker
from hpcrl.models import CharTokenizer
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.loop import prepare_inputs
from hpcrl.ppo.roles import ActorRollout
from hpcrl.ppo.tasks import copy_digits as copy_task

TOK = CharTokenizer(copy_task.ALPHABET)


def same(a, b):
    """Bitwise equality of nested states (tensors by bits and dtype)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An actor after one PPO update: parameters, AdamW moments, scheduler all non-trivial."""
    run = tmp_path_factory.mktemp("ckpt")
    cfg = TrainConfig(batch_size=16, mini_batch_size=16, micro_batch_size=8, ppo_epochs=1)
    model_dir, prompts = prepare_inputs(cfg, run)
    conf = cfg
    actor = local_worker(ActorRollout, str(model_dir), conf)
    batch = actor.generate_sequences(PromptDataset(prompts, TOK, 16, 1).next_batch())
    batch = batch.union(actor.compute_log_prob(batch))
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    actor.update_actor(batch)
    return run, model_dir, conf, actor, batch


def test_round_trip_of_every_state_kind_is_bitwise(trained, tmp_path):
    _, _, _, actor, _ = trained
    state = {"engine": actor.checkpoint_state(), "rng": rng_state(),
             "extra": {"bf16": torch.randn(5, 3).to(torch.bfloat16), "int": torch.arange(4, dtype=torch.int32),
                       "nested": (1, [2.5, "x", None], {"k": True}), 7: np.arange(3.0)}}
    info = write_role_file(tmp_path / "a.h5", state, {"step": 4, "role": "actor_rollout", "world_size": 1})
    back, attrs = read_role_file(tmp_path / "a.h5")
    assert same(back, state) and info["bytes"] == (tmp_path / "a.h5").stat().st_size
    assert attrs["step"] == 4 and attrs["format_version"] == 1 and attrs["role"] == "actor_rollout"
    assert back["engine"]["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0   # real Adam moments
    with h5py.File(tmp_path / "a.h5") as f:   # one dataset per tensor, named by its state path
        assert any(k.startswith("engine") for k in f) and "crc32" in f["extra/bf16"].attrs
    set_rng_state(state["rng"])
    first = torch.rand(3), np.random.rand(2)
    set_rng_state(back["rng"])
    again = torch.rand(3), np.random.rand(2)
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])


def test_a_loaded_worker_continues_exactly_like_the_original(trained, tmp_path):
    _, model_dir, conf, actor, batch = trained
    actor.save_checkpoint(str(tmp_path / "actor.h5"), step=1)
    fresh = local_worker(ActorRollout, str(model_dir), conf)
    assert not same(fresh.checkpoint_state()["model"], actor.checkpoint_state()["model"])
    fresh.load_checkpoint(str(tmp_path / "actor.h5"))
    assert same(fresh.checkpoint_state(), actor.checkpoint_state())
    actor.update_actor(batch), fresh.update_actor(batch)    # one more step on both: still bitwise equal
    assert same(fresh.checkpoint_state(), actor.checkpoint_state())


def commit(store, step, roles=("actor",), mb=1):
    files = {}
    for role in roles:
        path = store.role_path(step, role)
        info = write_role_file(path, {"w": torch.full((mb * 2**18,), float(step))}, {"step": step, "role": role})
        files[role] = {"path": str(path.relative_to(store.root)), **info}
    store.commit(step, files, {"step": step})
    return files


WRITER = """
import sys, torch
from hpcrl.checkpoint.format import write_role_file
from hpcrl.checkpoint.store import CheckpointStore
store = CheckpointStore(sys.argv[1])
state = {f"t{i}": torch.randn(2**20) for i in range(200)}     # 800 MB: seconds to write
write_role_file(store.role_path(2, "actor"), state, {"step": 2})
store.commit(2, {"actor": {"path": "step_00000002/actor.h5", "bytes": 0}}, {"step": 2})
"""


def test_a_writer_killed_mid_file_leaves_the_previous_step(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline:   # kill once the temporary file has some data in it
        tmps = list((tmp_path / "ckpt").glob("step_00000002/.actor.h5.tmp.*"))
        if tmps and tmps[0].stat().st_size > 50 * 2**20:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tmps, "the writer never started its file"
    assert store.committed_steps() == [1] and not store.role_path(2, "actor").exists()
    assert store.latest_good()[0] == 1 and (tmp_path / "ckpt" / "LATEST").read_text().strip() == "step_00000001"


def test_truncated_and_flipped_files_are_detected_and_skipped(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        commit(store, step)
    # flip one byte inside step 3's tensor data
    path3 = store.role_path(3, "actor")
    with h5py.File(path3) as f:
        offset = f["w"].id.get_offset()
    with open(path3, "r+b") as fh:
        fh.seek(offset + 1000)
        byte = fh.read(1)
        fh.seek(offset + 1000)
        fh.write(bytes([byte[0] ^ 0x10]))
    # truncate step 2's file
    path2 = store.role_path(2, "actor")
    os.truncate(path2, path2.stat().st_size // 2)
    assert any("checksum" in p for p in store.verify(3))
    assert any("bytes" in p for p in store.verify(2))
    with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
        assert store.latest_good()[0] == 1
    assert "step 3 is unusable" in caplog.text and "step 2 is unusable" in caplog.text
    out = subprocess.run([sys.executable, "-m", "hpcrl", "ckpt", "verify", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 1 and "step 1: ok" in out.stdout and "step 3: BAD" in out.stdout


def test_batches_generated_ahead_come_back_exactly_and_a_damaged_file_is_skipped(tmp_path, caplog):
    from hpcrl.controller.batch import Batch, object_array

    store = CheckpointStore(tmp_path)
    rows = object_array([{"ground_truth": "1", "tags": [1, 2]}, None, [3.5, float("nan")], "4"])
    ahead = [Batch({"responses": torch.randint(0, 9, (4, 3)), "logp": torch.randn(4, 3).to(torch.bfloat16)},
                   {"prompt": np.array(["1=", "22=", "3=", "4="], dtype=object), "group": np.arange(4),
                    "text": np.array(["a", "bb", "ccc", "é"]), "extra": rows},
                   {"step": s, "policy_version": s - 2, "temperature": np.float32(0.7), "kl": 1 / 3}) for s in (5, 6)]
    for step in (3, 4):
        files = commit(store, step)
        store.commit(step, files, {"step": step}, store.write_inflight(step, ahead))
    assert not list(tmp_path.glob("ckpt/*/*.pkl"))        # no pickle: nothing read back runs code
    back = store.read_inflight(store.manifest(4))
    assert [b.meta for b in back] == [b.meta for b in ahead]
    assert type(back[0].meta["temperature"]) is np.float32
    for got, want in zip(back, ahead):
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want.tensors)
        assert all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape for k in want.arrays)
        assert all(np.array_equal(got[k], want[k]) for k in ("prompt", "group", "text"))
        assert repr(list(got["extra"])) == repr(list(want["extra"]))      # nan, None, dicts, lists as they were
    with h5py.File(store.step_dir(4) / "inflight.h5") as f:
        offset = f["batches/1/tensors/responses"].id.get_offset()
    with open(store.step_dir(4) / "inflight.h5", "r+b") as fh:       # one flipped byte
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 1]))
    problems = store.verify(4)
    assert len(problems) == 1 and problems[0].startswith("in-flight batches: inflight.h5: ") and \
        "checksum" in problems[0], problems
    with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
        assert store.latest_good()[0] == 3
    assert store.write_inflight(5, []) is None and "inflight" not in json.loads(
        store.commit(5, commit(store, 5), {"step": 5}).read_text())


def test_retention_keeps_the_newest_the_multiples_and_frozen_files(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=3)
    frozen = commit(store, 1, roles=("ref",))["ref"]
    for step in range(2, 8):
        files = commit(store, step)
        files["ref"] = frozen      # the frozen role's one file, from step 1
        store.commit(step, files, {"step": step})
    assert store.committed_steps() == [3, 6, 7]
    assert store.role_path(1, "ref").exists() and not (store.step_dir(1) / "MANIFEST.json").exists()
    assert not store.step_dir(2).exists() and not store.verify(7)
    out = subprocess.run([sys.executable, "-m", "hpcrl", "ckpt", "ls", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "step_00000001/ref.h5" in out.stdout and json.loads(
        (store.step_dir(7) / "MANIFEST.json").read_text())["roles"]["ref"]["path"] == "step_00000001/ref.h5"


def test_background_save_writes_the_state_of_when_it_was_asked(trained, tmp_path):
    _, model_dir, conf, actor, batch = trained
    expected = {k: v.clone() for k, v in actor.checkpoint_state()["model"].items()}
    assert actor.save_checkpoint(str(tmp_path / "bg.h5"), step=5, background=True) == {"pending": True}
    actor.update_actor(batch)          # training goes on while the file is written
    info = actor.finish_checkpoint()
    state, _ = read_role_file(tmp_path / "bg.h5")
    assert info["bytes"] == (tmp_path / "bg.h5").stat().st_size
    assert same(state["role"]["model"], expected) and not same(state["role"]["model"], actor.checkpoint_state()["model"])


def test_a_two_rank_role_file_loads_into_one_rank(trained, tmp_path):
    """Data-parallel ranks hold the same parameters and optimizer state: rank 0 writes them with
    both ranks' RNG states, and a world of another size loads the file."""
    import ray

    from hpcrl.controller import ResourcePool, WorkerGroup
    from hpcrl.raycluster.session import start_local

    _, model_dir, conf, _, batch = trained
    start_local(["actor_rollout"], run_dir=tmp_path, num_cpus=2)
    try:
        wg = WorkerGroup(ResourcePool.for_role("actor_rollout", processes_per_node=2), ActorRollout,
                         (str(model_dir), conf))
        wg.update_actor(batch)                       # DDP over gloo: both ranks take the same step
        infos = wg.save_checkpoint(str(tmp_path / "two.h5"), 1)
        assert infos[0]["bytes"] > 0 and infos[1] is None
    finally:
        ray.shutdown()
    state, attrs = read_role_file(tmp_path / "two.h5")
    assert attrs["world_size"] == 2 and sorted(state["rng"]) == [0, 1]
    one = local_worker(ActorRollout, str(model_dir), conf)
    one.load_checkpoint(str(tmp_path / "two.h5"))
    assert same(one.checkpoint_state(), state["role"])
    assert one.checkpoint_state()["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0


MPIO_READER = """
import json, sys, zlib
import h5py, numpy as np
from mpi4py import MPI
comm, sums = MPI.COMM_WORLD, {}
with h5py.File(sys.argv[1], "r", driver="mpio", comm=comm) as f:
    f.visititems(lambda name, d: sums.__setitem__(name, zlib.crc32(np.ascontiguousarray(d[()]).tobytes()))
                 if isinstance(d, h5py.Dataset) and zlib.crc32(name.encode()) % comm.size == comm.rank else None)
every = comm.gather(sums)
if comm.rank == 0:
    print(json.dumps({k: v for part in every for k, v in part.items()}))
"""


def h5_contents(path):
    """Every dataset (bytes, dtype, shape, attributes) and the file's attributes, read by plain h5py."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, d: out.__setitem__(name, (d.dtype, d.shape, np.ascontiguousarray(d[()]).tobytes(),
                                                            dict(d.attrs))) if isinstance(d, h5py.Dataset) else None)
        return out, dict(f.attrs)


def test_a_parallel_write_whose_task_crashed_runs_once_more_from_the_same_shares(tmp_path, monkeypatch, capsys):
    """write_staged around a step whose task crashed (srun's error, as a segfaulting MPI task gives):
    the step runs again with the same command while rank 0's meta.json says the file is not in place
    yet, once; a second crash, or a crash after the file went into place, is the error."""
    from hpcrl.checkpoint import parallel as parallel_hdf5

    path = tmp_path / "ckpt" / "step_00000002" / "critic.h5"
    calls, outcomes = [], []

    def step(hosts, argv, timeout):
        calls.append(argv)
        outcome = outcomes.pop(0)
        if outcome == "in place":
            (parallel_hdf5.staging_dir(path) / "meta.json").unlink()
        if outcome != "ok":
            raise RuntimeError("MPI step failed (exit 143): srun ...\nsrun: error: n1: task 1: Segmentation fault")
        path.write_bytes(b"12345")
        return '{"datasets": 2, "seconds": 0.5}\n'

    monkeypatch.setattr(parallel_hdf5, "run_mpi_step", step)
    state = {"w": torch.zeros(10), "b": torch.ones(3)}
    try:
        for outcomes[:], raises, steps in ((["crash", "ok"], False, 2), (["crash", "crash", "ok"], True, 2),
                                           (["in place", "ok"], True, 1)):
            calls.clear()
            for rank in (0, 1):
                parallel_hdf5.stage(path, state, {"step": 2}, rank, 2)
            if raises:
                with pytest.raises(RuntimeError, match="task 1: Segmentation fault"):
                    parallel_hdf5.write_staged(path, ["n2", "n1"])
                assert not parallel_hdf5.staging_dir(path).exists()     # the shares are let go
            else:
                assert parallel_hdf5.write_staged(path, ["n2", "n1"])["bytes"] == 5
                assert "writing it again from the same staged shares" in capsys.readouterr().err
            assert len(calls) == steps and calls[0] == calls[-1]
    finally:
        shutil.rmtree(parallel_hdf5.staging_dir(path), ignore_errors=True)


@pytest.mark.slurm
def test_parallel_hdf5_file_equals_the_serial_one(slurm_cluster, trained, tmp_path):
    """Two ranks stage their rows, an MPI step of two tasks on two nodes writes one file through
    h5py's mpio driver; it holds what the serial writer writes, and the serial reader reads it back
    bitwise. The other way round: two MPI tasks read the serial file through mpio."""
    from hpcrl.checkpoint import parallel as parallel_hdf5

    _, _, _, actor, _ = trained
    state = {"role": actor.checkpoint_state(), "rng": {0: rng_state(), 1: rng_state()},
             "extra": {"bf16": torch.randn(7, 3).to(torch.bfloat16), "scalar": torch.tensor(2.5),
                       "empty": torch.zeros(0, 4), "one_row": torch.arange(5)[None]}}
    attrs = {"step": 3, "role": "actor_rollout", "world_size": 2}
    parallel, serial = tmp_path / "ckpt" / "step_00000003" / "actor_rollout.h5", tmp_path / "serial.h5"
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
{sys.executable} -c 'import json, sys; from hpcrl.checkpoint.parallel import write_staged
print(json.dumps(write_staged(sys.argv[1], ["cpun2", "cpun1"])))' {parallel}
srun --mpi=pmix --ntasks=2 --overlap {sys.executable} -c '{MPIO_READER}' {serial}
""")
    try:
        for rank in (0, 1):
            parallel_hdf5.stage(parallel, state, attrs, rank, 2)
        write_role_file(serial, state, attrs)
        sh("sbatch", "--wait", "-p", "cpu", "-N2", "-o", str(tmp_path / "out"), "-D", str(ROOT), str(script))
        assert not parallel_hdf5.staging_dir(parallel).exists()      # the tasks removed their shares
    finally:
        shutil.rmtree(parallel_hdf5.staging_dir(parallel), ignore_errors=True)   # shared memory, not tmp_path
    written, digests = [json.loads(line) for line in (tmp_path / "out").read_text().splitlines()[-2:]]
    assert written["writer"] == "parallel HDF5, 2 ranks" and written["bytes"] == parallel.stat().st_size

    (p_sets, p_attrs), (s_sets, s_attrs) = h5_contents(parallel), h5_contents(serial)
    assert p_sets.keys() == s_sets.keys() and len(p_sets) == written["datasets"] > 100
    differ = [k for k in s_sets if p_sets[k][:3] != s_sets[k][:3] or p_sets[k][3] != s_sets[k][3]]
    assert not differ, differ[:3]
    assert p_attrs == s_attrs and p_attrs["world_size"] == 2
    back, _ = read_role_file(parallel)                                 # checksums verified on the way
    assert same(back, state)
    assert digests == {k: zlib.crc32(v[2]) for k, v in s_sets.items()}



def live_members(pgid: int) -> list[str]:
    """The processes of group pgid that are not zombies (an orphan's zombie waits on a slow init here)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(stat.parent.name)
    return out


def test_a_step_past_its_bound_is_killed_with_its_whole_process_group(tmp_path):
    """A command that never ends (a shell and its background child) and a bound of 1 s: StepTimeout
    names the step and its bound, and no process of its group is left."""
    from hpcrl.slurm.mpi_step import StepTimeout, run_bounded

    assert run_bounded(["sh", "-c", "echo done"], dict(os.environ), "hpcrl-mpi-quick", 5) == "done\n"
    pid = tmp_path / "pid"
    with pytest.raises(StepTimeout) as e:
        run_bounded(["sh", "-c", f"echo $$ > {pid}; sleep 600 & sleep 600"], dict(os.environ), "hpcrl-mpi-never", 1)
    assert str(e.value).startswith("MPI step hpcrl-mpi-never (not in squeue: not started) ran past its bound of "
                                   "1 s: srun killed: sh -c"), e.value
    pgid = int(pid.read_text())               # the shell leads a group of its own (a session of its own)
    assert pgid != os.getpgrp()
    # SIGKILLed: a killed process closes its pipes (which ends the wait) a moment before it is a zombie
    wait_until(lambda: live_members(pgid) == [], 5, f"no live process of group {pgid}")


def test_a_parallel_write_past_its_bound_fails_naming_the_file_and_the_fix(tmp_path, monkeypatch):
    """write_staged around a step that timed out (the step itself: the tests around this one): its
    bound comes from the staged bytes (1000 float32 and 3×4 bf16: 4024 B, by hand), the half-written
    file and the shares are removed, and the error names the file, the step and the fix."""
    from hpcrl.checkpoint import parallel as parallel_hdf5
    from hpcrl.slurm.mpi_step import StepTimeout

    path = tmp_path / "ckpt" / "step_00000002" / "critic.h5"
    state = {"w": torch.zeros(1000), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    bounds = []

    def hangs(hosts, argv, timeout):
        bounds.append(timeout)
        parallel_hdf5.temporary_path(path).write_bytes(b"half")
        raise StepTimeout("MPI step 41.2 (hpcrl-mpi-x) ran past its bound")

    monkeypatch.setattr(parallel_hdf5, "run_mpi_step", hangs)
    try:
        for rank in (0, 1):
            parallel_hdf5.stage(path, state, {"step": 2}, rank, 2)
        assert parallel_hdf5.staged_bytes(parallel_hdf5.staging_dir(path)) == 4024
        with pytest.raises(RuntimeError) as e:
            parallel_hdf5.write_staged(path, ["n2", "n1"])
    finally:
        shutil.rmtree(parallel_hdf5.staging_dir(path), ignore_errors=True)
    assert bounds == [parallel_hdf5.STEP_START_S + 4024 / parallel_hdf5.SLOWEST_WRITE_BYTES_S]
    assert f"parallel HDF5 write of {path} (0 MB, 2 ranks on n2,n1) did not finish within its bound of 300 s" in str(e.value)
    assert "train.checkpoint.io: serial" in str(e.value) and "MPI step 41.2" in str(e.value)
    assert not parallel_hdf5.temporary_path(path).exists() and not path.exists()


@pytest.mark.slurm
def test_an_mpi_step_past_its_bound_is_cancelled_in_slurm(slurm_cluster, tmp_path):
    """A step of two tasks that never end, on two nodes, with a bound of 3 s: the error names its
    step id, the step is gone from squeue while the job still runs, and sacct says CANCELLED."""
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
{sys.executable} -c 'from hpcrl.slurm.mpi_step import run_mpi_step
run_mpi_step(["cpun2", "cpun1"], ["sleep", "600"], 3)'
echo steps left: $(squeue -h --steps -j $SLURM_JOB_ID -o %i)
""")
    sh("sbatch", "--wait", "-p", "cpu", "-N2", "-o", str(tmp_path / "out"), "-D", str(ROOT), str(script))
    out = (tmp_path / "out").read_text()
    assert "StepTimeout: MPI step " in out, out
    step = out.split("StepTimeout: MPI step ")[1].split()[0]
    assert f"ran past its bound of 3 s: cancelled (`scancel {step}`): srun" in out, out
    assert out.rstrip().endswith(f"steps left: {step.split('.')[0]}.batch"), out      # gone while the job runs
    wait_until(lambda: "CANCELLED" in sh("sacct", "-n", "-j", step, "-o", "State"), 30, f"sacct: {step} CANCELLED")


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec (it would be pytest's own peak)
PEAK_RSS = """
import sys
from hpcrl.cli import main
code = main(sys.argv[1:])
print("peak_kb", next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
sys.exit(code)
"""


def peak_rss_mb(*args) -> tuple[int, float, str]:
    """(exit code, the command's peak resident memory in MB, its output) of `hpcrl ARGS`."""
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, *args], capture_output=True, text=True, cwd=ROOT)
    peak = int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("peak_kb")))
    return out.returncode, peak / 1024, out.stdout


def test_ls_and_verify_of_a_gigabyte_step_stay_in_little_memory(tmp_path):
    """`ckpt ls` reads no role file; `ckpt verify` reads each a block at a time: against the same
    commands on a 4 MB step, a 1 GB step costs them no more than a block or two."""
    sizes = {}
    for name, floats in (("small", 2**20), ("big", 2**28)):
        store = CheckpointStore(tmp_path / name)
        files = {"actor": {"path": "step_00000001/actor.h5",
                           **write_role_file(store.role_path(1, "actor"), {"w": torch.randn(floats // 2**16, 2**16)},
                                             {"step": 1})}}
        store.commit(1, files, {"step": 1})
        for action in ("ls", "verify"):
            code, peak, out = peak_rss_mb("ckpt", action, str(tmp_path / name))
            assert code == 0 and ("step 1: ok" in out if action == "verify" else "ok" in out), out
            sizes[name, action] = peak
    for action in ("ls", "verify"):
        assert sizes["big", action] - sizes["small", action] < 200, sizes     # the file is 1024 MB


def test_a_resuming_run_skips_a_step_a_role_finds_damaged(tmp_path, caplog):
    """The driver reads manifests only; the critic, loading its file of the newest step, finds a
    flipped byte, and every role resumes from the step before."""
    import ray

    from hpcrl.ppo.loop import train
    from hpcrl.raycluster.session import start_local

    cfg = TrainConfig(total_steps=4, save_every=2, keep_last=2, progress=False)
    roles = ["actor_rollout", "critic", "ref", "reward"]
    start_local(roles, run_dir=tmp_path, num_cpus=2)
    try:
        train(cfg, tmp_path)
    finally:
        ray.shutdown()
    start_local(roles, run_dir=tmp_path, num_cpus=2)      # a new start of the run, with new processes
    try:
        store = CheckpointStore(tmp_path)
        path = store.role_path(4, "critic")
        with h5py.File(path) as f:
            datasets = []
            f.visititems(lambda name, obj: datasets.append(obj) if isinstance(obj, h5py.Dataset) else None)
            offset = max(datasets, key=lambda d: d.size).id.get_offset()
        with open(path, "r+b") as fh:
            fh.seek(offset + 8)
            byte = fh.read(1)
            fh.seek(offset + 8)
            fh.write(bytes([byte[0] ^ 0x40]))
        assert not store.check(4) and store.verify(4), "the flip is inside the data, not the size"
        with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
            train(cfg.updated(total_steps=6), tmp_path)
    finally:
        ray.shutdown()
    starts = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "start"]
    assert starts[-1]["resumed"] and starts[-1]["step"] == 2, starts
    assert "checkpoint step 4 is unusable (critic: " in caplog.text and "fails its checksum" in caplog.text
