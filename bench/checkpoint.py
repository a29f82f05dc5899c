"""Checkpoint costs, in one run on the disk that holds --dir:

  write     a 500 MB role state (float32 and bfloat16 tensors): hpcrl's HDF5 file (tmp, fsync,
            rename) vs `dd conv=fdatasync` of the same byte count vs `torch.save` + fsync
  read      the same file back (warm page cache) through read_role_file (checksums verified) vs torch.load
  stall     how long the caller waits: a synchronous save vs an async one (CPU snapshot only)
  parallel  the same role as 2 data-parallel ranks writing one file with parallel HDF5: each rank
            stages its rows (in a role they stage at once; the slower of the two counts), then one
            MPI step of 2 tasks writes the file (step start + collective write + sync + rename);
            "mpio_inner" is the write alone, inside the step. Needs h5py with MPI and a Slurm job
  memory    peak resident memory of a process that looks at a committed step of that state: reading
            its file whole (what a resuming driver did), `CheckpointStore.verify` (every checksum, a
            block at a time: `hpcrl ckpt verify`) and `check` (manifest and sizes: what a resuming
            driver does now, its roles reading their own files):

    python bench/checkpoint.py [--mb 500] [--repeat 3] [--dir /tmp] [--json bench/checkpoint.json]
    sbatch -p cpu -N2 --wait --wrap "python bench/checkpoint.py --dir $PWD/runs"   # with the parallel rows
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.checkpoint import parallel as parallel_hdf5  # noqa: E402
from hpcrl.checkpoint.format import read_role_file, snapshot, write_role_file  # noqa: E402
from hpcrl.checkpoint.role import AsyncWriter  # noqa: E402


def make_state(mb: int) -> dict:
    n = mb * 2**20 // 4 // 100   # 100 tensors
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(80)}
    model.update({f"layer{i}.bf16": torch.randn(2 * n, generator=g).to(torch.bfloat16) for i in range(80, 100)})
    return {"model": model, "step": 7}


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def mpi_hosts() -> list[str] | None:
    """The two ranks' nodes (this job's nodes, round robin), or None where parallel HDF5 cannot run."""
    if parallel_hdf5.unavailable():
        return None
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    return [nodes[r % len(nodes)] for r in range(2)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_save(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


PEAK = """
import sys
from pathlib import Path
from hpcrl.checkpoint.format import read_role_file
from hpcrl.checkpoint.store import CheckpointStore
store = CheckpointStore(Path(sys.argv[1]))
{"whole": lambda: read_role_file(store.role_path(1, "actor")), "verify": lambda: store.verify(1),
 "check": lambda: store.check(1)}[sys.argv[2]]()
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""


def peak_memory(state: dict, work: Path) -> dict[str, float]:
    """MB of peak resident memory of a fresh process doing each look at one committed step."""
    from hpcrl.checkpoint.store import CheckpointStore

    store = CheckpointStore(work / "run")
    store.commit(1, {"actor": {"path": "step_00000001/actor.h5",
                               **write_role_file(store.role_path(1, "actor"), state, {"step": 1})}}, {"step": 1})
    out = {how: int(subprocess.run([sys.executable, "-c", PEAK, str(work / "run"), how], check=True,
                                   capture_output=True, text=True).stdout.split()[-1]) / 1024
           for how in ("whole", "verify", "check")}
    shutil.rmtree(work / "run")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "checkpoint.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-ckpt-", dir=args.dir))
    state = make_state(args.mb)
    size = nbytes(state)
    parallel = mpi_hosts()
    runs = {k: [] for k in ("dd_write", "hdf5_write", "torch_write", "hdf5_read", "torch_read", "sync_stall", "async_stall",
                            *(("mpio_stage", "mpio_step", "mpio_inner", "mpio_write") if parallel else ()))}
    for _ in range(args.repeat):
        runs["dd_write"].append(timed(lambda: subprocess.run(
            ["dd", "if=/dev/zero", f"of={work / 'dd.bin'}", "bs=1M", f"count={size // 2**20}", "conv=fdatasync"],
            check=True, capture_output=True)))
        runs["hdf5_write"].append(timed(lambda: write_role_file(work / "role.h5", state, {"step": 7})))
        runs["torch_write"].append(timed(lambda: torch_save(state, work / "role.pt")))
        runs["hdf5_read"].append(timed(lambda: read_role_file(work / "role.h5")))
        runs["torch_read"].append(timed(lambda: torch.load(work / "role.pt")))
        runs["sync_stall"].append(runs["hdf5_write"][-1])
        writer = AsyncWriter()
        runs["async_stall"].append(timed(lambda: writer.submit(partial(write_role_file, work / "async.h5", snapshot(state),
                                                                        {"step": 7}))))
        writer.wait()
        if parallel:
            target = work / "ckpt" / "step_00000007" / "role.h5"
            runs["mpio_stage"].append(max(timed(lambda r=r: parallel_hdf5.stage(target, state, {"step": 7}, r, 2))
                                          for r in (0, 1)))
            t0 = time.perf_counter()
            info = parallel_hdf5.write_staged(target, parallel)
            runs["mpio_step"].append(time.perf_counter() - t0)
            runs["mpio_inner"].append(info["write_seconds"])
            runs["mpio_write"].append(runs["mpio_stage"][-1] + runs["mpio_step"][-1])
            shutil.rmtree(work / "ckpt")
        for f in work.iterdir():
            f.unlink()
    memory = peak_memory(state, work)
    med = {k: statistics.median(v) for k, v in runs.items()}
    gbs = {k: size / med[k] / 1e9 for k in med}
    print(f"\n{size / 2**20:.0f} MiB role state in {work}, median of {args.repeat}")
    print(f"{'what':<14}{'seconds':>10}{'GB/s':>8}{'vs dd':>8}")
    for k in med:
        print(f"{k:<14}{med[k]:>10.3f}{gbs[k]:>8.2f}{med['dd_write'] / med[k] if k.endswith('write') else float('nan'):>8.2f}")
    print("peak memory (MB) of a look at a committed step of it: " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items()))
    work.rmdir()
    result = {"bytes": size, "median_s": med, "gb_per_s": gbs, "hdf5_write_vs_dd": med["dd_write"] / med["hdf5_write"],
              "async_stall_vs_sync": med["async_stall"] / med["sync_stall"], "peak_memory_mb": memory}
    if parallel:
        result.update(mpio_hosts=parallel, mpio_write_vs_serial=med["hdf5_write"] / med["mpio_write"],
                      mpio_inner_vs_serial=med["hdf5_write"] / med["mpio_inner"])
        print(f"parallel HDF5, 2 ranks on {', '.join(parallel)}: a save is {result['mpio_write_vs_serial']:.2f}x as fast "
              f"as rank 0 writing alone; the collective write itself {result['mpio_inner_vs_serial']:.2f}x")
    else:
        print(f"parallel HDF5 not measured: {parallel_hdf5.unavailable()}")
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nhdf5 write = {result['hdf5_write_vs_dd']:.2f}x dd; async save stalls the caller "
          f"{result['async_stall_vs_sync']:.2f}x as long as a synchronous one\nwritten {args.json}")


if __name__ == "__main__":
    main()
