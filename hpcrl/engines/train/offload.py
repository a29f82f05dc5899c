"""AdamW's moments in host memory between steps (`train.engine.offload: optimizer`, torch engine).

A full fine-tune holds 16 bytes a parameter on its GPU: fp32 weights, gradients, and AdamW's two
moments (exp_avg, exp_avg_sq), the half that only the optimizer step reads. Here the moments live in
pinned host memory and each step streams them through the GPU in chunks of parameters: a chunk's
moments come to the device on one copy stream while the chunk before it updates, and go back on a
second copy stream (the two directions of PCIe at once) while the next one updates. The optimizer
is the engine's one ordinary torch AdamW, stepped on one chunk at a time, so the arithmetic, its
state_dict, the LR scheduler and the checkpoint format are what they are without offload.

What it costs, per optimizer step: 8 bytes a trained parameter to the GPU and 8 back, which bound
the step (on an H100: 1.07B parameters' moments, 8.6 GB each way, in 0.19 s, 46 GB/s a direction,
where the resident fused step took 0.011 s; a 7B model's would take about 1.3 s); on the GPU the
moments of at most three chunks at once (arriving, updating, leaving: 1.5 GiB at the default chunk
size); on the host 8 bytes a trained parameter, pinned, in one buffer (the caching host allocator
would round each tensor up to a power of two, up to twice that), pinned once in seconds (8.6 GB: 3 s).
"""
from __future__ import annotations

import weakref

import torch

CHUNK_BYTES = 256 * 2**20
"""Parameters' bytes per chunk: its moments (twice that) are what each copy moves at a time."""
MOMENTS = ("exp_avg", "exp_avg_sq")
ALIGN = 256        # bytes: each moment starts at a multiple of it in the host buffer


class HostOptimizerState:
    """Keeps `optimizer`'s moments on the host and steps it chunk by chunk: call `step()` in place
    of optimizer.step(). Its state_dict() and load_state_dict() stay the optimizer's own (hooks
    keep the moments on the host: a load never puts them all on the device)."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunk_bytes: int | None = None):
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.device = self.params[0].device
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        self.chunks: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in self.params:
            if self.chunks[-1] and size + p.nbytes > chunk_bytes:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(p)
            size += p.nbytes
        slots = [-(-p.nbytes // ALIGN) * ALIGN for p in self.params]     # one moment's place
        self.host = torch.empty(len(MOMENTS) * sum(slots), dtype=torch.uint8)
        self.views: dict[torch.Tensor, dict[str, torch.Tensor]] = {}      # parameter -> its moments on the host
        start = 0
        for p, slot in zip(self.params, slots):
            self.views[p] = {k: self.host[start + i * slot:][:p.nbytes].view(p.dtype).view(p.shape)
                             for i, k in enumerate(MOMENTS)}
            start += len(MOMENTS) * slot
        if self.device.type == "cuda":
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(self.host.data_ptr(), self.host.nbytes, 0)) != 0:
                raise RuntimeError(f"offload: could not pin {self.host.nbytes / 2**30:.1f} GiB of host memory")
            weakref.finalize(self, cudart.cudaHostUnregister, self.host.data_ptr())
            self.to_device, self.to_host = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        optimizer.register_state_dict_pre_hook(lambda _: self.synchronize())
        optimizer.register_load_state_dict_pre_hook(self._hold_back)
        optimizer.register_load_state_dict_post_hook(self._put_back)

    def step(self) -> None:
        """optimizer.step(), one chunk at a time: torch's AdamW skips a parameter without a gradient,
        so the other chunks' gradients are hidden meanwhile. A first step makes the moments on the
        device (torch's lazy init), and they go to the host after it as later ones do."""
        grads = {p: p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        try:
            if self.device.type == "cuda":
                self.to_device.wait_stream(self.to_host)     # the last step's moments are back on the host
            arriving = self._fetch(self.chunks[0])
            for i, chunk in enumerate(self.chunks):
                current, ready = arriving
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
                if i + 1 < len(self.chunks):
                    arriving = self._fetch(self.chunks[i + 1])    # overlaps this chunk's update
                for p, moments in current.items():
                    self.optimizer.state[p].update(moments)
                for p in chunk:
                    p.grad = grads[p]
                self.optimizer.step()
                for p in chunk:
                    p.grad = None
                self._store(chunk)
        finally:
            for p, g in grads.items():
                p.grad = g

    def _fetch(self, chunk: list[torch.Tensor]) -> tuple[dict, torch.cuda.Event | None]:
        """The chunk's moments on the device, copying on the to_device stream, and the event that
        says they have arrived (on the host: the moments themselves, None)."""
        if self.device.type != "cuda":
            return {}, None
        held = [p for p in chunk if MOMENTS[0] in self.optimizer.state.get(p, {})]
        # made on the compute stream, whose work may still use the memory they reuse: the copies wait for it
        moments = {p: {k: torch.empty_like(v, device=self.device) for k, v in self.views[p].items()} for p in held}
        self.to_device.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.to_device):
            for p in held:
                for k, v in moments[p].items():
                    v.copy_(self.views[p][k], non_blocking=True)
        return moments, self.to_device.record_event()

    def _store(self, chunk: list[torch.Tensor]) -> None:
        """The chunk's updated moments into their places on the host (copies on the to_host stream
        once the update is done), which the optimizer's state then holds again."""
        if self.device.type == "cuda":
            self.to_host.wait_stream(torch.cuda.current_stream(self.device))
        for p in chunk:
            state = self.optimizer.state.get(p, {})
            for k, host in self.views[p].items():
                if k not in state or state[k] is host:
                    continue
                if self.device.type == "cuda":
                    with torch.cuda.stream(self.to_host):
                        host.copy_(state[k], non_blocking=True)
                    state[k].record_stream(self.to_host)     # its memory is not reused before the copy has read it
                else:
                    host.copy_(state[k])
                state[k] = host

    def synchronize(self) -> None:
        """Wait for the copies in flight: the host buffer then holds the last step's moments."""
        if self.device.type == "cuda":
            self.to_device.synchronize()
            self.to_host.synchronize()

    def _hold_back(self, optimizer, state_dict: dict) -> dict:
        """load_state_dict's pre-hook: torch would copy every moment to its parameter's device at
        once (more than a GPU that needs offload holds); they are taken out of what it loads, by
        the parameter each belongs to (as torch pairs them: in order), and _put_back copies them to the host."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        param = dict(zip(ids, self.params))
        self.loaded = {param[i]: {k: s[k] for k in MOMENTS if k in s} for i, s in state_dict["state"].items() if i in param}
        state = {i: {k: v for k, v in s.items() if k not in MOMENTS} for i, s in state_dict["state"].items()}
        return {**state_dict, "state": state}

    def _put_back(self, optimizer) -> None:
        self.synchronize()       # no copy of the last step still reads or writes the buffer
        for p, moments in self.loaded.items():
            for k, v in moments.items():
                self.views[p][k].copy_(v)
                optimizer.state[p][k] = self.views[p][k]
        self.loaded = {}
