"""One role's checkpoint file (HDF5), and the RNG state every rank records in it.

A role file holds one dataset per tensor (named by its path in the state, dtype kept; bfloat16 as
its 16 bits), the structure around the tensors as JSON, and a CRC32 per dataset, so a flipped byte
is found when the file is read. It is written under a temporary name, flushed, fsynced and renamed,
so a crash at any moment leaves the file that was there before. That is where the atomicity comes
from, not from HDF5's file locks: files are opened with locking off, so that checkpoints work on
filesystems where flock/fcntl locks fail (Lustre, GPFS, NFS and Cray DVS mounts often do).
"""
from __future__ import annotations

import errno
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcrl._version import __version__
from hpcrl.files import free_bytes, replace_durably, writing

FORMAT_VERSION = 1


# ---------------------------------------------------------------- one role's file
def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]):
    """The JSON skeleton of obj, each tensor replaced by {"__t__": its dataset name}."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {"__t__": path}
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "O":       # per-sample values of a Batch (texts, lists, dicts): each kept as itself
            return {"__obj__": [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj.reshape(-1))],
                    "shape": list(obj.shape)}
        if obj.dtype.kind == "U":
            return {"__str__": obj.tolist(), "dtype": obj.dtype.str}
        tensors[path] = torch.from_numpy(obj)
        return {"__np__": path}
    if isinstance(obj, dict):
        return {"__d__": [[_flatten(k, f"{path}/k{i}", tensors), _flatten(v, f"{path}/{_key(k, i)}", tensors)]
                          for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic) and obj.dtype.kind in "biufU":     # its dtype kept: np.float32 stays one
        return {"__npg__": obj.dtype.str, "v": obj.item()}
    if isinstance(obj, torch.dtype):      # megatron's optimizer state is keyed by dtype
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(f"checkpoint: cannot store {type(obj).__name__} at {path}")


def _key(k, i: int) -> str:
    return str(k).replace("/", "|") if isinstance(k, (str, int)) else f"item{i}"


def _unflatten(node: Any, read):
    if isinstance(node, dict):
        if "__t__" in node:
            return read(node["__t__"])
        if "__np__" in node:
            return read(node["__np__"]).numpy()
        if "__dtype__" in node:
            return getattr(torch, node["__dtype__"])
        if "__obj__" in node:
            out = np.empty(len(node["__obj__"]), dtype=object)
            for i, v in enumerate(node["__obj__"]):     # one at a time: np.array would make lists a dimension
                out[i] = _unflatten(v, read)
            return out.reshape(node["shape"])
        if "__str__" in node:
            return np.array(node["__str__"], dtype=node["dtype"])
        if "__npg__" in node:
            return np.dtype(node["__npg__"]).type(node["v"])
        if "__tuple__" in node:
            return tuple(_unflatten(v, read) for v in node["__tuple__"])
        return {_unflatten(k, read): _unflatten(v, read) for k, v in node["__d__"]}
    if isinstance(node, list):
        return [_unflatten(v, read) for v in node]
    return node


def _as_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).removeprefix("torch.")


def crc32(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)


def snapshot(state: dict) -> dict:
    """A CPU copy of every tensor in state, so training may go on while it is written."""
    return _unflatten(_flatten(state, "", tensors := {}), lambda p: tensors[p].detach().to("cpu", copy=True))


def tensor_arrays(state: dict) -> tuple[Any, dict[str, tuple[np.ndarray, str]]]:
    """(the JSON skeleton, {dataset name: (array, hpcrl dtype)}) of a state: what a role file holds.
    The arrays of CPU tensors are views of them, not copies."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "", tensors)
    return skeleton, {name: _as_array(t) for name, t in tensors.items()}


def from_arrays(skeleton, arrays: dict[str, tuple[np.ndarray, str]]) -> dict:
    """The state tensor_arrays took apart, each array copied (those of a snapshot are read-only views
    of Ray's object store)."""
    def read(name: str) -> torch.Tensor:
        arr, dtype = arrays[name]
        t = torch.from_numpy(np.array(arr))
        return t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return _unflatten(skeleton, read)


def file_attrs(skeleton, attrs: dict) -> dict:
    """The attributes of a role file, the same whichever path writes it; the skeleton (the state's
    structure and every value that is not a tensor) has a checksum of its own, as each dataset has."""
    text = json.dumps(skeleton)
    return {"skeleton": text, "skeleton_crc32": zlib.crc32(text.encode()), "format_version": FORMAT_VERSION,
            "hpcrl_version": __version__, **attrs}


def skeleton_problem(attrs) -> str | None:
    """Why a file's skeleton cannot be trusted (its checksum fails), or None (files before the
    checksum have none to check)."""
    if "skeleton_crc32" in attrs and zlib.crc32(str(attrs["skeleton"]).encode()) != int(attrs["skeleton_crc32"]):
        return "its skeleton (the state's structure and values) fails its checksum"
    return None


def refuse_if_it_cannot_fit(path: Path, size: int) -> None:
    """ENOSPC before HDF5 sees the file: HDF5 1.10 can crash the process (SIGSEGV in H5D_close) when it
    closes a file whose writes failed for want of space. statvfs does not see quotas; those still reach HDF5."""
    free = free_bytes(path.parent)
    if free is not None and free < size + 2**20:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {path.name} needs {size / 1e6:.1f} MB, "
                      f"{free / 1e6:.1f} MB are free", str(path.parent))


def write_role_file(path: Path, state: dict, attrs: dict) -> dict:
    """Atomically write one role's state; returns {"bytes", "datasets"} for the manifest.

    Checksums run on a second thread while h5py writes (zlib releases the GIL, h5py does not),
    so they cost no wall time on a host with a spare core. A write the storage refuses raises
    StorageError."""
    path = Path(path)
    with writing(path):
        return _write_role_file(path, state, attrs)


def _write_role_file(path: Path, state: dict, attrs: dict) -> dict:
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    skeleton, arrays = tensor_arrays(state)
    refuse_if_it_cannot_fit(path, sum(arr.nbytes for arr, _ in arrays.values()) + 4096 * len(arrays))
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="hpcrl-crc") as pool:
            crcs = {name: pool.submit(crc32, arr) for name, (arr, _) in arrays.items()}
            with h5py.File(tmp, "w", locking=False) as f:
                for name, (arr, dtype) in arrays.items():
                    f.create_dataset(dataset_name(name), data=arr).attrs["dtype"] = dtype
                for name, crc in crcs.items():
                    f[dataset_name(name)].attrs["crc32"] = crc.result()
                f.attrs.update(file_attrs(skeleton, attrs))
                f.flush()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)      # a full disk keeps no half file; the committed steps are untouched
        raise
    return {"bytes": path.stat().st_size, "datasets": len(arrays)}


def dataset_name(name: str) -> str:
    return name.lstrip("/") or "root"


class DamagedFile(ValueError):
    """A role file whose data no longer matches its checksums."""


def read_role_file(path: Path) -> tuple[dict, dict]:
    """(state, attrs); raises DamagedFile when a dataset's checksum does not match.

    Each dataset's checksum runs on a second thread while the next one is read."""
    import h5py

    with h5py.File(path, "r", locking=False) as f, ThreadPoolExecutor(1, thread_name_prefix="hpcrl-crc") as pool:
        if problem := skeleton_problem(f.attrs):
            raise DamagedFile(f"{path}: {problem}")
        checks = []

        def read(name: str) -> torch.Tensor:
            ds = f[dataset_name(name)]
            arr = np.asarray(ds[()])  # a 0-d dataset reads as a numpy scalar
            checks.append((name, int(ds.attrs["crc32"]), pool.submit(crc32, arr)))
            t = torch.from_numpy(arr)
            return t.view(torch.bfloat16) if ds.attrs["dtype"] == "bfloat16" else t
        state = _unflatten(json.loads(f.attrs["skeleton"]), read)
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items() if k != "skeleton"}
        for name, expected, crc in checks:
            if crc.result() != expected:
                raise DamagedFile(f"{path}: dataset {name} fails its checksum")
    return state, attrs


VERIFY_BLOCK = 64 * 2**20     # bytes read at a time: verifying holds this much, whatever the file's size


def verify_role_file(path: Path) -> str | None:
    """None if every dataset reads back with its checksum; else what is wrong. A block of rows at a
    time: a file of any size is checked in VERIFY_BLOCK of memory."""
    import h5py

    def datasets(f) -> list:
        found = []
        f.visititems(lambda name, obj: found.append((name, obj)) if isinstance(obj, h5py.Dataset) else None)
        return found
    try:
        with h5py.File(path, "r", locking=False) as f:
            if problem := skeleton_problem(f.attrs):
                return f"{path.name}: {problem}"
            json.loads(f.attrs["skeleton"])
            for name, ds in datasets(f):
                if ds.ndim == 0:
                    crc = crc32(np.asarray(ds[()]))
                else:
                    rows = max(1, VERIFY_BLOCK // max(1, ds.dtype.itemsize * (ds.size // max(1, ds.shape[0]))))
                    crc = 0
                    for start in range(0, ds.shape[0], rows):
                        crc = zlib.crc32(np.ascontiguousarray(ds[start:start + rows]).view(np.uint8).reshape(-1).data, crc)
                if crc != int(ds.attrs["crc32"]):
                    return f"{path.name}: dataset {name} fails its checksum"
    except FileNotFoundError:
        return f"{path.name} missing"
    except Exception as e:  # noqa: BLE001 - h5py raises many kinds for a damaged file
        return f"{path.name}: {e}"
    return None


def rng_state() -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
