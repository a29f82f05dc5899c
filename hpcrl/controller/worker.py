"""The code that runs inside one Ray actor process.

`Worker` is the base of every role's worker class: it knows its role, rank and world size,
and its torch.distributed group is ready before its `__init__` runs. `WorkerHost` is the actor:
it starts the process group (gloo on CPU, nccl on GPU), builds one Worker per role it hosts
(several when roles are colocated), and runs the methods the driver dispatches to it.
"""
from __future__ import annotations

import faulthandler
import functools
import io
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcrl.controller import layer_rehearsal, startup
from hpcrl.run_dir import log_stamp, rank_calls, rank_log

STACKS_SIGNAL = signal.SIGRTMIN + 5
"""Asks a worker process for its Python threads' stacks (faulthandler writes them, even while the
process is stuck in C with the GIL held). hpcrl's own: USR1 and USR2 are the job's checkpoint signals."""


def stacks_path(log_dir: str | None, role: str, rank: int, pid: int) -> Path:
    """Where the process `pid` at `rank` (hosting `role` first) writes its stacks when asked."""
    if log_dir:
        return rank_log(log_dir, role, rank).with_suffix(".stacks")
    return Path(tempfile.gettempdir()) / f"hpcrl-stacks-{pid}"


@dataclass(frozen=True)
class WorkerContext:
    role: str
    rank: int
    world_size: int
    device: str        # "cuda:<local index>" or "cpu"


class Worker:
    """Subclass it, decorate methods with `@register(dispatch=...)`, hand the class to a WorkerGroup."""
    _ctx: WorkerContext
    elastic = False
    """True: ranks may be added and removed while the run goes on (`hpcrl scale`), because a new rank
    built from the class's __init__ (and the group's restore hooks) is as good as any other: no
    trained state of its own. Such a worker reads self.rank and self.world_size when it needs them,
    never keeps them: they change when the group is resized."""
    uses_gpus = True
    """False: on a GPU node the role's processes hold no GPU (a CPU-only role such as the
    environments, beside processes that each hold one) and run `processes_per_node` of them."""

    @classmethod
    def warm_up(cls) -> None:
        """Import now what __init__ will (a model's code): an idle standby process calls it, so that
        taking a dead rank over costs only __init__ itself. Touches no GPU."""

    @property
    def role(self) -> str:
        return self._ctx.role

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def device(self) -> torch.device:
        return torch.device(self._ctx.device)


class RoleLog(io.TextIOBase):
    """Replaces sys.stdout/sys.stderr in a worker: every line goes, prefixed with role and rank, to
    logs/<role>/rank<k>.log of the role whose code is running, and to the original stream (which
    Ray forwards to the driver's console). A line longer than LINE_LIMIT characters (a progress bar
    redrawn in place, a dump on one line) goes out in pieces of that length, each marked as cut, the
    rest in the next line: an unfinished line never holds more than that in memory while it waits for
    a newline that may never come, and a long line reads alike however it was written."""
    LINE_LIMIT = 64 << 10
    CUT = " [cut: no newline in {} characters]"

    def __init__(self, host: WorkerHost, echo):
        self.host, self.echo, self.pending = host, echo, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, pending = (self.pending + text).split("\n")
        for line in lines:
            self.host.log_line(self._cut(line), self.echo)
        self.pending = self._cut(pending)
        return len(text)

    def _cut(self, line: str) -> str:
        """What is left of line once its first LINE_LIMIT characters have gone out, marked as cut, for
        as long as more than that is left."""
        while len(line) > self.LINE_LIMIT:
            self.host.log_line(line[:self.LINE_LIMIT] + self.CUT.format(self.LINE_LIMIT), self.echo)
            line = line[self.LINE_LIMIT:]
        return line

    def flush(self) -> None:
        self.echo.flush()

    def fileno(self) -> int:
        """The original stream's descriptor: code that writes below Python (C libraries, vLLM's
        suppress_stdout, which silences them by redirecting it) reaches the process's own stream."""
        return self.echo.fileno()


class WorkerHost:
    """One actor process: hosts the Workers of one or more (colocated) roles at one rank.
    Created idle (torch already imported); `setup` gives it its rank. A standby host waits,
    idle, to replace a dead rank without paying for a process start and a torch import."""

    def __init__(self, roles: list[str], log_dir: str | None):
        self.roles, self.log_dir = roles, log_dir
        self.rank, self.current = 0, roles[0]
        self.workers: dict[str, Worker] = {}
        self.files, self.calls = {}, {}
        self.store: dist.TCPStore | None = None   # where its group meets: opened by rank 0, joined by the others
        startup.mark("process")    # Python, Ray's worker and this module's imports (torch) are done
        self.phases: dict[str, list[tuple[str, float, float]]] = {}

    def log_line(self, line: str, echo) -> None:
        prefixed = f"[{self.current} rank{self.rank}] {line}\n"
        if self.current in self.files:   # dated in the file, so `hpcrl logs` can merge files by time
            self.files[self.current].write(f"{log_stamp()} {prefixed}")
        echo.write(prefixed)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 opens the store every rank of this group meets at and names its address. The
        store binds its own free port and holds it: a port picked free and released for the store to
        bind later can be taken meanwhile (another group forming, any outgoing connection)."""
        import ray

        address = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
        return address, self.store.port

    def setup(self, rank: int, world_size: int, master: tuple[str, int], workers: dict[str, tuple],
              num_threads: int, gpu_ids: list | None, timeout_s: float) -> tuple[int, list, str]:
        """Take rank `rank`: open its logs, join the group's torch.distributed group, build each
        role's Worker. gpu_ids is given to a standby process taking over a dead rank's GPUs.
        Returns the process's pid, GPU ids and device."""
        import ray

        if gpu_ids is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))   # before CUDA is first touched
        torch.set_num_threads(max(1, num_threads))
        # trainer and sampler share the GPU, with activations of changing shapes: growable segments
        # instead of fixed blocks keep fragmentation (and allocator retries) down
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self._join(rank, world_size, master, timeout_s)
        startup.mark("group")
        shared, own = startup.count(), {}
        for role, (cls, args, kwargs) in workers.items():
            self.current = role
            print(f"rank {rank} of {world_size} on node {ray.util.get_node_ip_address()}, pid {os.getpid()}, {self.device}")
            worker = cls.__new__(cls)
            worker._ctx = WorkerContext(role, rank, world_size, self.device)
            before = startup.count()
            worker.__init__(*args, **kwargs)
            startup.mark("built")
            self.workers[role] = worker
            own[role] = before, startup.count()
        timed = startup.timed(startup.process_started())
        self.phases = {role: timed[:shared] + timed[a:b] for role, (a, b) in own.items()}
        return os.getpid(), [str(g) for g in ray.get_gpu_ids()] if gpu_ids is None else gpu_ids, self.device

    def regroup(self, rank: int, world_size: int, master: tuple[str, int], timeout_s: float) -> tuple[int, list, str]:
        """Keep the roles' workers, take rank `rank` of a resized group (an elastic role): a new
        torch.distributed group, and the logs of the new rank."""
        import ray

        if dist.is_initialized():
            dist.destroy_process_group()
        self._join(rank, world_size, master, timeout_s)
        for role, worker in self.workers.items():
            self.current = role
            worker._ctx = replace(worker._ctx, rank=rank, world_size=world_size)
            print(f"rank {rank} of {world_size} now (the group was resized)")
        return os.getpid(), [str(g) for g in ray.get_gpu_ids()], self.device

    def _join(self, rank: int, world_size: int, master: tuple[str, int], timeout_s: float) -> None:
        """This rank's log files, and its place in the group's torch.distributed group."""
        self.rank = rank
        if self.log_dir:
            for files in (self.files, self.calls):
                for f in files.values():
                    f.close()
            for role in self.roles:
                path = rank_log(self.log_dir, role, rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.files[role] = open(path, "a", buffering=1)
                self.calls[role] = open(rank_calls(self.log_dir, role, rank), "a", buffering=1)
            if not isinstance(sys.stdout, RoleLog):
                sys.stdout, sys.stderr = RoleLog(self, sys.__stdout__), RoleLog(self, sys.__stderr__)
        stacks = stacks_path(self.log_dir, self.roles[0], rank, os.getpid())
        stacks.parent.mkdir(parents=True, exist_ok=True)
        if getattr(self, "stacks_file", None):
            self.stacks_file.close()
        self.stacks_file = open(stacks, "a")     # kept open: faulthandler writes to its descriptor
        faulthandler.register(STACKS_SIGNAL, file=self.stacks_file, all_threads=True)
        gpu = torch.cuda.is_available()
        self.device = f"cuda:{torch.cuda.current_device()}" if gpu else "cpu"
        timeout = timedelta(seconds=timeout_s)
        if rank != 0:   # rank 0's was opened by rendezvous (a former rank 0 of a resized group lets its old one go)
            self.store = dist.TCPStore(*master, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if gpu else "gloo", store=self.store, rank=rank, world_size=world_size,
                                timeout=timeout)

    def execute(self, role: str, method: str, /, *args, **kwargs):
        self.current, start = role, time.time()
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        try:
            return getattr(self.workers[role], method)(*args, **kwargs)
        except Exception as e:
            # where it came from travels with the error (pickled with it) and shows in its traceback
            e.hpcrl_origin = {"role": role, "rank": self.rank, "method": method, "pid": os.getpid()}
            e.add_note(f"[hpcrl] raised in role {role}, rank {self.rank}, method {method} (pid {os.getpid()})")
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            if role in self.calls:   # when each call ran, for the report's lanes and for overlap tests
                step = next((a.meta.get("step") for a in args if hasattr(a, "meta")), None)
                self.calls[role].write(json.dumps({"method": method, "step": step, "start": round(start, 4),
                                                   "end": round(time.time(), 4), **gpu_memory()}) + "\n")

    def pid(self) -> int:
        return os.getpid()

    def warm(self, workers: dict[str, tuple]) -> None:
        """A standby process, idle until it takes a rank over: the roles' classes imported (unpickled
        here) and what their warm_up imports."""
        for cls, _, _ in workers.values():
            cls.warm_up()
        startup.mark("imports")

    def layer_calls(self) -> list:
        """How this rank calls its compiled layers (layer_rehearsal), for its standby to rehearse."""
        return layer_rehearsal.export_all()

    def rehearse(self, gpu_ids: list | None, device: str, rehearsals: list) -> dict:
        """A standby process: the compiled layers of the rank it stands by for, called as that rank
        calls them, on its GPUs (taken now, as setup would when taking it over), so that taking the
        rank over compiles nothing. A rehearsal that fails (the GPU's memory full) leaves a standby
        that still takes a rank over, compiling as a new process does."""
        if not rehearsals:
            return {"calls": 0, "seconds": 0.0}
        if gpu_ids is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        try:
            done = layer_rehearsal.rehearse(rehearsals, torch.device(device))
        except Exception as e:
            print(f"standby for {self.roles}: the rehearsal of their compiled layers failed ({e!r}); a rank taken "
                  "over compiles them again", flush=True)
            return {"error": repr(e)}
        startup.mark("rehearsed")
        return done

    def startup(self) -> dict:
        """How this process started: when (Unix time), and each role's phases (hpcrl.controller.startup)
        in order, (phase, when it ended, seconds it took)."""
        return {"started": startup.process_started(), "phases": self.phases}


def gpu_memory() -> dict:
    """This process's GPU memory during the call just made, GiB: torch's peak reserved and allocated
    memory, and what NVML counts for the process (nvidia-smi's figure: the CUDA context too; None
    where NVML does not see the process); nothing where the process never touched CUDA."""
    if not torch.cuda.is_initialized():
        return {}
    gib = 2**30
    return {"gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 3),
            "gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 3), "gpu_process_gib": _nvml_process()}


def _nvml_process() -> float | None:
    try:
        import pynvml

        used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_device())
                if p.pid == os.getpid()]
        return round(used[0] / 2**30, 3) if used and used[0] is not None else None
    except Exception:        # no NVML, another pid namespace, a driver that does not say
        return None


@functools.cache
def _nvml_device():
    """NVML's handle of this process's GPU (by UUID: NVML numbers every GPU, CUDA the visible ones)."""
    import pynvml

    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return next(h for h in map(pynvml.nvmlDeviceGetHandleByIndex, range(pynvml.nvmlDeviceGetCount()))
                if uuid in str(pynvml.nvmlDeviceGetUUID(h)))


def local_worker(cls: type, *args, role: str = "local", **kwargs) -> Worker:
    """A Worker in this process as rank 0 of 1, without Ray (tests, notebooks, debugging a role)."""
    worker = cls.__new__(cls)
    worker._ctx = WorkerContext(role, 0, 1, "cuda:0" if torch.cuda.is_available() else "cpu")
    worker.__init__(*args, **kwargs)
    return worker
