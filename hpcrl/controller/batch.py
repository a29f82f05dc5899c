"""`Batch`: what the roles pass to each other.

Named tensors sharing a first (batch) dimension, per-sample non-tensor arrays (numpy, object
dtype allowed: prompts as text, ids), and a `meta` dict for batch-wide values (temperature,
step, metrics). Every operation returns a new Batch that shares tensor storage where it can.

Through Ray, a Batch pickles its tensors as numpy buffers, which Ray moves out of band (no
pickle copy); the receiver makes one private copy so that no role can write into the object
store's shared memory. A small class rather than tensordict: tensordict pulls its own pinned
torch range, and we need only these few operations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch


def object_array(values: list) -> np.ndarray:
    """A 1-d object array of per-sample values, even when every value is a list (np.array would make it 2-d)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


@dataclass(frozen=True)
class Padding:
    """What `pad_to_multiple` added: the padded rows are [size, size + pad)."""
    size: int   # the real number of samples
    pad: int    # samples appended (copies of the first sample)


class Batch:
    def __init__(self, tensors: dict[str, torch.Tensor] | None = None,
                 arrays: dict[str, Any] | None = None, meta: dict | None = None):
        self.tensors = dict(tensors or {})
        self.arrays = {k: np.asarray(v) if not isinstance(v, np.ndarray) else v for k, v in (arrays or {}).items()}
        self.meta = dict(meta or {})
        sizes = {k: int(v.shape[0]) for k, v in {**self.tensors, **self.arrays}.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields differ in their first dimension: {sizes}")
        overlap = self.tensors.keys() & self.arrays.keys()
        if overlap:
            raise ValueError(f"Batch keys both tensor and array: {sorted(overlap)}")

    # --- shape and access -------------------------------------------------------------------
    def __len__(self) -> int:
        for v in (*self.tensors.values(), *self.arrays.values()):
            return int(v.shape[0])
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.arrays]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.arrays

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.arrays:
            return self.arrays[key]
        raise KeyError(f"{key!r} not in Batch (has {self.keys()})")

    def __setitem__(self, key: str, value) -> None:
        """Add or replace one field; its first dimension must match."""
        others = [k for k in self.keys() if k != key]
        if others and int(value.shape[0]) != int(self[others[0]].shape[0]):
            raise ValueError(f"field {key!r} has {value.shape[0]} samples, the Batch has {len(self)}")
        self.tensors.pop(key, None)
        self.arrays.pop(key, None)
        (self.tensors if isinstance(value, torch.Tensor) else self.arrays)[key] = (
            value if isinstance(value, (torch.Tensor, np.ndarray)) else np.asarray(value))

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in self.tensors.items()]
        fields += [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.arrays.items()]
        return f"Batch(len={len(self)}, {', '.join(fields)}, meta={sorted(self.meta)})"

    def index(self, idx) -> Batch:
        """Samples by slice, integer list/array or boolean mask (same meaning as torch indexing)."""
        np_idx = idx.numpy() if isinstance(idx, torch.Tensor) else idx
        t_idx = idx if isinstance(idx, slice) else torch.as_tensor(np.asarray(np_idx))
        return Batch({k: v[t_idx] for k, v in self.tensors.items()},
                     {k: v[np_idx] for k, v in self.arrays.items()}, self.meta)

    # --- combining --------------------------------------------------------------------------
    def union(self, other: Batch) -> Batch:
        """All fields of both. A key present in both must hold equal values (else ValueError)."""
        if len(self.keys()) and len(other.keys()) and len(self) != len(other):
            raise ValueError(f"union of Batches of {len(self)} and {len(other)} samples")
        for k in self.tensors.keys() & other.tensors.keys():
            if not torch.equal(self.tensors[k], other.tensors[k]):
                raise ValueError(f"union: tensor {k!r} differs between the two Batches")
        for k in self.arrays.keys() & other.arrays.keys():
            if not np.array_equal(self.arrays[k], other.arrays[k]):
                raise ValueError(f"union: array {k!r} differs between the two Batches")
        for k in self.meta.keys() & other.meta.keys():
            if not _same(self.meta[k], other.meta[k]):
                raise ValueError(f"union: meta {k!r} differs ({self.meta[k]!r} vs {other.meta[k]!r})")
        return Batch({**self.tensors, **other.tensors}, {**self.arrays, **other.arrays}, {**self.meta, **other.meta})

    def select(self, *keys: str, meta: bool = True) -> Batch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: {missing} not in Batch (has {self.keys()})")
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors},
                     {k: self.arrays[k] for k in keys if k in self.arrays}, self.meta if meta else None)

    def pop(self, *keys: str) -> Batch:
        """Remove these fields from this Batch and return them as a new one (meta is shared)."""
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.arrays.pop(k, None)
        return out

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of `size` samples (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """Exactly n consecutive pieces whose sizes differ by at most one, larger ones first
        (numpy.array_split's rule), so concat(chunk(n)) is the Batch again for any length."""
        if n <= 0:
            raise ValueError(f"chunk count must be positive, got {n}")
        bounds = np.cumsum([0] + [len(self) // n + (1 if i < len(self) % n else 0) for i in range(n)])
        return [self.index(slice(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Samples of all, in order. Fields must match; meta is the first Batch's."""
        if not batches:
            raise ValueError("concat of no Batches")
        first = batches[0]
        for b in batches[1:]:
            if set(b.keys()) != set(first.keys()):
                raise ValueError(f"concat: fields differ: {sorted(first.keys())} vs {sorted(b.keys())}")
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
                     {k: np.concatenate([b.arrays[k] for b in batches]) for k in first.arrays}, first.meta)

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each sample `times` times: a a b b (interleave) or a b a b."""
        idx = np.arange(len(self))
        idx = np.repeat(idx, times) if interleave else np.tile(idx, times)
        return self.index(idx)

    def reorder(self, indices) -> Batch:
        """Samples in the order given (a permutation, e.g. to balance sequence lengths across ranks)."""
        indices = np.asarray(indices)
        if sorted(indices.tolist()) != list(range(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)})")
        return self.index(indices)

    def pad_to_multiple(self, n: int) -> tuple[Batch, Padding]:
        """Append copies of the first sample until len is a multiple of n (for even DP shards)."""
        pad = (-len(self)) % n
        if pad == 0:
            return self, Padding(len(self), 0)
        return Batch.concat([self, self.index(np.zeros(pad, dtype=np.int64))]), Padding(len(self), pad)

    # --- transport --------------------------------------------------------------------------
    def to(self, device) -> Batch:
        """The tensors on `device` (arrays and meta stay as they are)."""
        return Batch({k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}, self.arrays, self.meta)

    def __reduce__(self):
        return _rebuild, ({k: _to_numpy(v) for k, v in self.tensors.items()}, self.arrays, self.meta)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return a == b


# numpy has no bfloat16: such tensors travel as int16 bits and are viewed back.
_BITS = {torch.bfloat16: torch.int16}


def _to_numpy(t: torch.Tensor):
    t = t.detach().cpu().contiguous()
    if t.dtype in _BITS:
        return (str(t.dtype), t.view(_BITS[t.dtype]).numpy())
    return t.numpy()


def _from_numpy(v) -> torch.Tensor:
    if isinstance(v, tuple):
        dtype, bits = v
        return torch.from_numpy(np.array(bits)).view(getattr(torch, dtype.removeprefix("torch.")))
    # A private copy: arrays out of Ray's object store are views of shared, read-only memory.
    return torch.from_numpy(v if v.flags.writeable else np.array(v))


def _rebuild(tensors: dict, arrays: dict, meta: dict) -> Batch:
    return Batch({k: _from_numpy(v) for k, v in tensors.items()}, arrays, meta)


class Weights(dict):
    """Named tensors (a module's state dict) that travel through Ray as a Batch's tensors do: numpy
    buffers out of band, where torch tensors would be pickled (10x slower on one node, see the
    notes on Ray)."""

    def __reduce__(self):
        return _rebuild_weights, ({k: _to_numpy(v) for k, v in self.items()},)


def _rebuild_weights(arrays: dict) -> Weights:
    return Weights({k: _from_numpy(v) for k, v in arrays.items()})


def concat_results(results: Iterable):
    """Batches are concatenated; anything else is returned as the list it is."""
    results = list(results)
    if results and all(isinstance(r, Batch) for r in results):
        return Batch.concat(results)
    return results
