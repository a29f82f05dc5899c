"""`DeviceWeights`: a state dict passed between two processes on one GPU without leaving it.

When the rollout role runs on the GPU of the actor's rank 0 (its own process on the same node), the
weights need not travel as `Weights` do (to host memory, through Ray's object store and back to the
device: 2 s a step for 0.5B parameters on an H200). The actor packs them, in the rollout's sampling
dtype, into one flat buffer on its GPU and sends CUDA IPC handles of it (torch's `reduce_tensor`,
what torch.multiprocessing sends for a CUDA tensor: a few hundred bytes); each rollout rank maps the
same memory and its engine copies from there.

Lifetime: torch counts the readers of each handle it makes in shared memory. Once the producer
drops its buffer, the memory waits in torch's "limbo" until every reader has released its mapping,
and `torch.cuda.ipc_collect()` (at the producer's next export) frees it. A handle counts one
reader, so an export makes one handle per reading rank. Every export fills a fresh buffer: one a
reader still holds (an export k+1 before the load of k) stays allocated and is never written again.
"""
from __future__ import annotations

import math
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor


class Placement(NamedTuple):
    """Where a process runs, as far as CUDA IPC is concerned."""
    host: str
    pid: int
    gpu: str | None     # the GPU's UUID: the physical device, however CUDA_VISIBLE_DEVICES numbers it; None on CPU

    @classmethod
    def of(cls, device: torch.device | str) -> Placement:
        device = torch.device(device)
        gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
        return cls(socket.gethostname(), os.getpid(), gpu)


def shares_gpu(producer: Placement, readers: Sequence[Placement]) -> bool:
    """Whether every reader can map the producer's GPU memory: same host, same GPU, and another
    process (CUDA does not open an IPC handle in the process that made it)."""
    return producer.gpu is not None and len(readers) > 0 and all(
        (r.host, r.gpu) == (producer.host, producer.gpu) and r.pid != producer.pid for r in readers)


class Slot(NamedTuple):
    """One tensor's place in a flat buffer."""
    offset: int             # bytes from the buffer's start
    shape: tuple[int, ...]
    dtype: torch.dtype


ALIGN = 256     # bytes: every tensor starts as aligned as a tensor of its own allocation would (vectorised kernels)


def lay_out(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[dict[str, Slot], int]:
    """Where each tensor lies in a flat byte buffer, floating ones cast to `dtype` (when given; the
    cast of `Tensor.to`), and the buffer's size in bytes."""
    layout, end = {}, 0
    for name, t in tensors.items():
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        layout[name] = Slot(end, tuple(t.shape), kind)
        end += -(-t.numel() * kind.itemsize // ALIGN) * ALIGN
    return layout, end


def pack(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None,
         device: torch.device | str) -> tuple[torch.Tensor, dict[str, Slot]]:
    """The tensors copied into one new flat byte buffer on `device` as `lay_out` places them, and
    where each lies in it."""
    layout, end = lay_out(tensors, dtype)
    buffer = torch.empty(end, dtype=torch.uint8, device=device)
    for name, view in unpack(buffer, layout).items():
        view.copy_(tensors[name].detach())
    return buffer, layout


def unpack(buffer: torch.Tensor, layout: dict[str, Slot]) -> dict[str, torch.Tensor]:
    """Views of `buffer` by name, as `pack` laid them out (no copy)."""
    return {name: buffer[s.offset:s.offset + math.prod(s.shape) * s.dtype.itemsize].view(s.dtype).view(s.shape)
            for name, s in layout.items()}


@dataclass(frozen=True)
class DeviceWeights:
    """Named tensors in a flat buffer on the producer's GPU: its CUDA IPC handles, one per reader
    rank (torch's rebuild function and its arguments), and the layout. Plain data: it pickles as is."""
    handles: tuple
    layout: dict[str, Slot]
    producer: Placement

    @classmethod
    def export(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device | str,
               readers: int) -> DeviceWeights:
        """The tensors (floating ones in `dtype`) for `readers` ranks on this GPU."""
        torch.cuda.ipc_collect()    # the buffers of earlier exports that every reader has let go of
        with _ipc_shareable_allocations():
            buffer, layout = pack(tensors, dtype, device)
        # each handle records an event after the copies, which its reader waits for
        return cls(tuple(reduce_tensor(buffer) for _ in range(readers)), layout, Placement.of(device))

    def load(self, into: Callable[[dict[str, torch.Tensor]], None], rank: int, device: torch.device | str) -> None:
        """Call `into` with views of the producer's buffer by name, as reader `rank` on `device`;
        returns once the device has finished with them and they are let go (the producer can free
        the buffer), so `into` must copy what it keeps."""
        device = torch.device(device)
        here = Placement.of(device)
        if rank >= len(self.handles) or not shares_gpu(self.producer, [here]):
            raise RuntimeError(f"weights exported on {self.producer} for {len(self.handles)} readers cannot be "
                               f"read by rank {rank} on {here}: the exporter was told another placement")
        rebuild, args = self.handles[rank]
        # the producer's device index is its numbering of the GPU; this process may number it differently
        buffer = rebuild(*args[:6], device.index, *args[7:])
        into(unpack(buffer, self.layout))
        torch.cuda.synchronize(device)


@contextmanager
def _ipc_shareable_allocations():
    """Allocations inside come from plain cudaMalloc segments, which CUDA IPC shares. The workers'
    allocator maps expandable segments (hpcrl/controller/worker.py), whose memory torch either
    refuses to share or shares with pidfd_getfd, which needs ptrace rights between the processes
    that containers often withhold; torch's allocator lets them be switched off for this."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        yield
        return
    # newer torch deprecates torch.cuda.memory's setter for the accelerator API's
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setting("expandable_segments:False")
    try:
        yield
    finally:
        setting("expandable_segments:True")
