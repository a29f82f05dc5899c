"""`WeightGroup`: named tensors from one process to several others by a torch.distributed group of
their own, across nodes and hetjob components (the actor's weights to the rollout's ranks).

A group of its own, not the default one: each role's processes already form their default group
(their DDP or FSDP group), which the other role's ranks are no part of. It is a ProcessGroupGloo
(host buffers) or ProcessGroupNCCL (device buffers, every member on a GPU of its own) built on a
TCPStore. The driver hosts the store (`Rendezvous`): it outlives the members, whose rebuilds
re-form the group, and it hands every member a `Ticket` for each formation: the store's address,
the formation's number (its prefix in the store: each formation is a new group), who takes part
(rank 0 the sender) and the timeout. Each member says in the store that it joined and waits, at
most the timeout, for the others; the error names those that did not come (role, rank, node), so a
lost rank fails the sync instead of hanging it. A member still waiting when a newer formation is
announced gives up quietly: a rebuild has replaced the group it waits for.

A send is a header (the layout of the buckets) and then the buckets, each one flat buffer of at
most `bucket_bytes` packed as device_weights packs, the tensors in the sender's order. The receiver
takes every bucket into one buffer and hands the whole back: engines fuse tensors as they load
them (q, k, v), and a transfer that breaks halfway must leave the engine with its old weights.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from hpcrl.controller.device_weights import Placement, Slot, lay_out, pack, unpack

BUCKET_BYTES = 256 << 20
"""the largest buffer a send packs at once: the sender never holds a second full copy of the weights"""


class WeightGroupError(RuntimeError):
    """The group could not be formed, or a transfer over it broke."""


@dataclass(frozen=True)
class Ticket:
    """What every member of one formation of the group is handed by the driver."""
    address: tuple[str, int]     # the driver's store
    formation: int               # which formation: a call holding an older ticket is stale
    members: tuple[str, ...]     # by group rank (0: the sender), as errors name them: "rollout rank 1 (node-3)"
    backend: str                 # "gloo" or "nccl"
    timeout_s: float


class Rendezvous:
    """The store where every formation meets, on a free port of the driver's node (`host`)."""

    def __init__(self, host: str):
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.address, self.formed = (host, self.store.port), 0

    def ticket(self, members: Sequence[str], backend: str, timeout_s: float) -> Ticket:
        """The next formation's ticket; members waiting to join an older one give up."""
        self.formed += 1
        self.store.set("latest", str(self.formed))
        return Ticket(self.address, self.formed, tuple(members), backend, timeout_s)


def backend_for(members: Sequence[Placement]) -> str:
    """NCCL when every member has a GPU of its own (NCCL takes one rank per GPU), else gloo."""
    gpus = [(m.host, m.gpu) for m in members]
    return "nccl" if all(m.gpu for m in members) and len(set(gpus)) == len(gpus) else "gloo"


def node_address() -> str:
    """This node's address as the other nodes of the Ray cluster reach it."""
    import ray

    return ray.util.get_node_ip_address()


class WeightGroup:
    """This process's place (`rank`) in one formation of the group; `device`: where NCCL's buffers live."""

    def __init__(self, ticket: Ticket, rank: int, group: dist.ProcessGroup, device: torch.device):
        self.ticket, self.rank, self.group, self.device = ticket, rank, group, device

    @classmethod
    def join(cls, ticket: Ticket, rank: int, device: torch.device | str = "cpu") -> WeightGroup | None:
        """Join as `rank` once every member has come; None when a newer formation was announced
        meanwhile (this one will never be complete). WeightGroupError, naming the members that did
        not come, after the ticket's timeout."""
        timeout = timedelta(seconds=ticket.timeout_s)
        host, port = ticket.address
        try:
            root = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        except RuntimeError as e:
            raise WeightGroupError(f"weight group {ticket.formation}: {ticket.members[rank]} cannot reach the "
                                   f"driver's store at {host}:{port}: {e}") from None
        store = dist.PrefixStore(f"weights/{ticket.formation}/", root)
        store.set(f"joined/{rank}", ticket.members[rank])
        keys = [f"joined/{r}" for r in range(len(ticket.members))]
        deadline = time.monotonic() + ticket.timeout_s
        while not store.check(keys):
            if int(root.get("latest")) > ticket.formation:
                return None
            if time.monotonic() > deadline:
                missing = [m for m, k in zip(ticket.members, keys) if not store.check([k])]
                raise WeightGroupError(f"weight group {ticket.formation}: {', '.join(missing)} did not join within "
                                       f"{ticket.timeout_s:g} s (train.rollout.weight_sync_timeout)")
            time.sleep(0.02)
        device = torch.device(device) if ticket.backend == "nccl" else torch.device("cpu")
        if ticket.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, len(ticket.members), options)
        else:
            group = dist.ProcessGroupGloo(store, rank, len(ticket.members), timeout)
        return cls(ticket, rank, group, device)

    def send(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
             bucket_bytes: int = BUCKET_BYTES) -> None:
        """The tensors (floating ones in `dtype`, when given) to every other member, as rank 0."""
        buckets: list[dict[str, torch.Tensor]] = [{}]
        filled = 0
        for name, t in tensors.items():
            size = lay_out({name: t}, dtype)[1]
            if buckets[-1] and filled + size > bucket_bytes:
                buckets.append({})
                filled = 0
            buckets[-1][name] = t
            filled += size
        header = pickle.dumps([lay_out(b, dtype) for b in buckets])
        self._broadcast(torch.tensor([len(header)], dtype=torch.int64, device=self.device))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
        for bucket in buckets:
            self._broadcast(pack(bucket, dtype, self.device)[0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)     # the buffers are NCCL's until its stream is done

    def receive(self) -> dict[str, torch.Tensor]:
        """What rank 0 sends, by name: views of one buffer on this group's device (copy what you keep)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        header = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(header)
        layouts: list[tuple[dict[str, Slot], int]] = pickle.loads(header.cpu().numpy().tobytes())
        buffer = torch.empty(sum(end for _, end in layouts), dtype=torch.uint8, device=self.device)
        tensors, offset = {}, 0
        for layout, end in layouts:
            part = buffer[offset:offset + end]
            self._broadcast(part)
            tensors.update(unpack(part, layout))
            offset += end
        return tensors

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            self.group.broadcast(tensor, 0).wait()
        except RuntimeError as e:
            raise WeightGroupError(f"weight group {self.ticket.formation}: the transfer broke at "
                                   f"{self.ticket.members[self.rank]}: {str(e).strip().splitlines()[0]}") from None
