"""Parallel HDF5 role files: the ranks of a data-parallel role write one file together through
h5py's "mpio" driver, each rank its own rows of every tensor.

Ray actors hold no MPI communicator to give h5py (OpenMPI 4.1 singletons cannot connect to each
other: MPI_Comm_connect/accept fail with MPI_ERR_INTERN here), so a save has two halves:

  stage            in every rank's actor: its rows of every tensor, and the checksums of its share
                   of the datasets, into node-local shared memory. This copy is the snapshot:
                   training may go on once every rank has staged.
  write_staged     rank 0's actor runs `python -m hpcrl.checkpoint.parallel` as an MPI step, one task
                   per rank on that rank's node (`hpcrl.slurm.mpi_step`). The tasks create the file
                   and its datasets collectively, each writes its rows (independent I/O), all sync,
                   and rank 0 renames the file into place.

The file is the serial format, dataset for dataset and attribute for attribute: `read_role_file`
reads it, and a role that writes in parallel resumes from a file written serially.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from hashlib import sha1
from pathlib import Path

import numpy as np

from hpcrl.files import private_dir, replace_durably, writing
from hpcrl.probe import interpreter_problem
from hpcrl.slurm.mpi_step import StepTimeout, inside_job, run_mpi_step

ALIGN = 64     # each staged part starts on a cache line
# The MPI step's bound: its start (srun, each task's imports) and the write at a rate far under any
# shared file system's, so that only a hung rank meets it (a 14 GB role: 17 minutes).
STEP_START_S = 300.0
SLOWEST_WRITE_BYTES_S = 20e6
WRITE_TRIES = 2


def unavailable() -> str | None:
    """Why this process's role cannot write parallel HDF5 (None: it can)."""
    try:
        import h5py
    except ImportError as e:
        return f"h5py does not import: {e}"
    if not h5py.get_config().mpi:
        return (f"h5py {h5py.__version__} is built without MPI (build it against libhdf5-openmpi-dev, as "
                ".ci/install-mpi does)")
    if not inside_job():
        return "not inside a Slurm job (the writers run as a step of it)"
    if shutil.which("srun") is None:
        return "srun is not on PATH"
    return None


def h5py_problem(python: str) -> str | None:
    """Why `python` (the job's interpreter) has no h5py with MPI (None: it has)."""
    why = interpreter_problem(python, "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 'no MPI')")
    if why == "no MPI":
        return f"h5py in {python} is built without MPI"
    return why and f"h5py does not import in {python}: {why}"


def rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [lo, hi) of a tensor's first dimension that rank writes."""
    return n * rank // world, n * (rank + 1) // world


def staging_dir(path: Path) -> Path:
    """Node-local and the same on every rank: one per run and role, reused by each save."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    key = sha1(str(Path(path).resolve().parent.parent / Path(path).name).encode()).hexdigest()[:16]
    return base / f"hpcrl-{os.getuid()}-{key}"


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.mpio")


def stage(path: Path, state: dict, attrs: dict, rank: int, world: int) -> None:
    """This rank's share of path: its rows of every tensor, and the checksums of datasets
    i ≡ rank (mod world) over their whole arrays (each rank holds the whole state)."""
    with writing(path):
        _stage(path, state, attrs, rank, world)


def _stage(path: Path, state: dict, attrs: dict, rank: int, world: int) -> None:
    from hpcrl.checkpoint.format import crc32, dataset_name, file_attrs, tensor_arrays  # torch: not in the MPI tasks

    skeleton, arrays = tensor_arrays(state)
    d = staging_dir(path)
    private_dir(d)       # a predictable name in a shared /dev/shm: refused unless ours alone
    placed, parts, offset = {}, [], 0
    for name, (arr, _) in arrays.items():
        if arr.ndim == 0:
            lo = hi = None
            part = arr.reshape(1)[:1 if rank == 0 else 0]
        else:
            lo, hi = rows(arr.shape[0], rank, world)
            part = arr[lo:hi]
        if part.size:
            placed[dataset_name(name)] = [offset, lo, hi]
            parts.append((offset, np.ascontiguousarray(part)))
            offset += -(-part.nbytes // ALIGN) * ALIGN
    with open(d / f"share.{rank}.bin", "wb") as f:
        for at, part in parts:
            f.seek(at)
            f.write(memoryview(part.reshape(-1).view(np.uint8)))
    crcs = {dataset_name(name): crc32(arr) for i, (name, (arr, _)) in enumerate(arrays.items()) if i % world == rank}
    (d / f"share.{rank}.json").write_text(json.dumps({"rows": placed, "crcs": crcs}))
    if rank == 0:
        meta = {"datasets": {dataset_name(name): [list(arr.shape), arr.dtype.str, dtype] for name, (arr, dtype) in arrays.items()},
                "attrs": file_attrs(skeleton, attrs)}
        (d / "meta.json").write_text(json.dumps(meta))


def write_staged(path: Path, hosts: list[str]) -> dict:
    """Rank 0's half: the MPI step that writes path from what every rank staged (rank i on
    hosts[i]). Returns the manifest's file info."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        staged = staged_bytes(staging_dir(path))
        bound = STEP_START_S + staged / SLOWEST_WRITE_BYTES_S
        argv = [sys.executable, "-m", "hpcrl.checkpoint.parallel", str(staging_dir(path)), str(path)]
        out = _write_step(path, hosts, argv, bound)
    except BaseException as e:
        temporary_path(path).unlink(missing_ok=True)
        shutil.rmtree(staging_dir(path), ignore_errors=True)
        if isinstance(e, StepTimeout):
            raise RuntimeError(f"parallel HDF5 write of {path} ({staged / 1e6:.0f} MB, {len(hosts)} ranks on "
                               f"{','.join(hosts)}) did not finish within its bound of {bound:.0f} s: a rank hangs. "
                               f"This step is not committed; the last committed one stands. If ranks hang in MPI-IO "
                               f"on the file system of {path.parent.parent} (NFS without fcntl locks, for one), "
                               f"set train.checkpoint.io: serial. {e}") from None
        raise
    done = json.loads(out.strip().splitlines()[-1])
    return {"bytes": path.stat().st_size, "datasets": done["datasets"], "writer": f"parallel HDF5, {len(hosts)} ranks",
            "write_seconds": done["seconds"]}


def _write_step(path: Path, hosts: list[str], argv: list[str], bound: float) -> str:
    """The MPI step's output. A step whose task failed (an MPI task crashed: a segfault in MPI under load
    was seen) runs once more, from the same staged shares, which the tasks keep until the file is in
    place; a step that ran past its bound does not (its ranks hang)."""
    tries = 1
    while True:
        try:
            return run_mpi_step(hosts, argv, bound)
        except StepTimeout:
            raise
        except RuntimeError as e:
            if tries == WRITE_TRIES or not (staging_dir(path) / "meta.json").exists():    # gone: in place
                raise
            tries += 1
            print(f"parallel HDF5 write of {path}: {e}\nwriting it again from the same staged shares",
                  file=sys.stderr, flush=True)


def staged_bytes(stage_dir: Path) -> int:
    """The bytes of every tensor the staged shares hold together (rank 0's meta.json lists them)."""
    meta = json.loads((stage_dir / "meta.json").read_text())
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype, _ in meta["datasets"].values())


def main(argv: list[str]) -> None:
    """One MPI task per rank: write the staged shares into one file, collectively."""
    import h5py
    from mpi4py import MPI

    stage_dir, path = Path(argv[0]), Path(argv[1])
    comm, tmp = MPI.COMM_WORLD, temporary_path(path)
    rank = comm.rank
    share_bin, share_json = stage_dir / f"share.{rank}.bin", stage_dir / f"share.{rank}.json"
    try:
        meta = comm.bcast(json.loads((stage_dir / "meta.json").read_text()) if rank == 0 else None)
        share = json.loads(share_json.read_text())
        crcs = {}
        for part in comm.allgather(share["crcs"]):
            crcs.update(part)
        data = np.memmap(share_bin, np.uint8, "r") if share_bin.stat().st_size else np.zeros(0, np.uint8)
        t0 = time.perf_counter()
        with h5py.File(tmp, "w", driver="mpio", comm=comm, locking=False) as f:
            datasets = {}
            for name, (shape, np_dtype, dtype) in meta["datasets"].items():   # metadata: collective
                ds = datasets[name] = f.create_dataset(name, shape=tuple(shape), dtype=np.dtype(np_dtype),
                                                       fill_time="never")
                ds.attrs["dtype"] = dtype
                ds.attrs["crc32"] = crcs[name]
            f.attrs.update(meta["attrs"])
            for name, (at, lo, hi) in share["rows"].items():                  # data: each rank its rows
                ds = datasets[name]
                count = int(np.prod(ds.shape[1:], dtype=np.int64)) * (1 if lo is None else hi - lo)
                part = data[at:at + count * ds.dtype.itemsize].view(ds.dtype)
                if lo is None:
                    ds[()] = part[0]
                else:
                    ds[lo:hi] = part.reshape((hi - lo, *ds.shape[1:]))
            f.flush()                                                          # MPI_File_sync on every rank
        seconds = time.perf_counter() - t0
        del data
        comm.Barrier()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)      # the others may wait in a collective: end the step (the caller cleans up)
    if rank == 0:
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        replace_durably(tmp, path)
        (stage_dir / "meta.json").unlink()
        print(json.dumps({"datasets": len(meta["datasets"]), "seconds": round(seconds, 4)}), flush=True)
    comm.Barrier()
    share_bin.unlink()         # kept until the file is in place: a failed step is run again from them
    share_json.unlink()
    try:
        stage_dir.rmdir()      # each node's own; another rank of the node may have removed it already
    except OSError:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
