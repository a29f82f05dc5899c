"""A compiled decoder layer's calls, rehearsed ahead in another process.

A rank's process compiles its decoder layers on their first calls (Dynamo traces, AOTAutograd and
Inductor compile or load from their caches: 7-8 s of an H100 rebuild's first call). A new process
pays it again, even with every kernel on disk. Dynamo keeps what it compiled per function, for any
module of the same class and the same kind of inputs; so a standby process that has called a layer
of the same class, built alike, with inputs alike (same dtypes, strides, grad and autocast modes, two
shapes so that the dynamic graph is there too), finds the compiled code in its own memory when it
takes the rank over and builds the real model.

`compile_layers` compiles a model's layers in place and records, outside the compiled region, how
the first layer is called (`LayerCalls`: the first two shapes of each kind of call). `export()` is
that record, the layer as a weightless (meta) copy, and the torch global state Dynamo guards on, all
picklable; `rehearse` makes the copy real with zero weights and calls it so, in the standby.
"""
from __future__ import annotations

import copy
import itertools
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

SHAPES_PER_KIND = 2      # a static graph, then the dynamic one a second shape makes
KINDS_PER_LAYER = 6      # no_grad and grad, train and eval, with and without autocast: more is something else
_recorded: weakref.WeakSet[LayerCalls] = weakref.WeakSet()
"""this process's, for export_all; weakly: a model let go (a test's, a notebook's) is not kept alive by its record"""


class Unrehearsable(Exception):
    """An argument that cannot be made again from its description (a cache object, a callable)."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    requires_grad: bool

    def make(self, device: torch.device) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        t.zero_() if not self.dtype.is_floating_point else t.normal_(0, 0.02)
        return t.requires_grad_(self.requires_grad)


def describe(x):
    """An argument as TensorSpecs and constants, the same nesting (Unrehearsable otherwise)."""
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(describe(v) for v in x)
    if isinstance(x, dict):
        return {k: describe(v) for k, v in x.items()}
    raise Unrehearsable(type(x).__name__)


def make(spec, device: torch.device):
    if isinstance(spec, TensorSpec):
        return spec.make(device)
    if isinstance(spec, (tuple, list)):
        return type(spec)(make(v, device) for v in spec)
    if isinstance(spec, dict):
        return {k: make(v, device) for k, v in spec.items()}
    return spec


def _shapeless(spec):
    """What a spec says but its shapes: calls alike but for their sizes are one kind of call."""
    if isinstance(spec, TensorSpec):
        return spec.dtype, spec.requires_grad, len(spec.shape)
    if isinstance(spec, (tuple, list)):
        return type(spec).__name__, tuple(_shapeless(v) for v in spec)
    if isinstance(spec, dict):
        return tuple((k, _shapeless(v)) for k, v in sorted(spec.items()))
    return spec


@dataclass
class Call:
    """One call of the layer: its arguments described, and the modes it ran in."""
    args: tuple
    kwargs: dict
    training: bool
    grad: bool
    inference: bool
    autocast: torch.dtype | None


@dataclass
class Rehearsal:
    """What a standby needs to call a layer as a rank did: picklable, no weights."""
    layer: torch.nn.Module          # on the meta device
    calls: list[Call]
    compile_options: dict
    global_state: dict
    env: dict = field(default_factory=dict)     # the compile caches' folders


def global_state() -> dict:
    """The torch settings Dynamo's global guard checks, as this process has them."""
    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_precision": torch.get_float32_matmul_precision()}


def _set_global_state(s: dict) -> None:
    torch.set_num_threads(s["num_threads"])
    torch.set_default_dtype(s["default_dtype"])
    torch.use_deterministic_algorithms(s["deterministic"])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = s["matmul_tf32"], s["cudnn_tf32"]
    torch.set_float32_matmul_precision(s["matmul_precision"])


class LayerCalls:
    """Records how `layer` (compiled in place) is called: wraps its compiled call, outside Dynamo."""

    def __init__(self, layer: torch.nn.Module, compile_options: dict):
        self.layer, self.compile_options = layer, compile_options
        self.kinds: dict[tuple, list[Call]] = {}
        self.usable = True
        compiled = layer._compiled_call_impl

        def recorded(*args, **kwargs):
            if self.usable:
                self._record(args, kwargs)
            return compiled(*args, **kwargs)
        layer._compiled_call_impl = recorded
        self._compiled = compiled

    def _record(self, args: tuple, kwargs: dict) -> None:
        try:
            a, k = describe(args), describe(kwargs)
        except Unrehearsable:
            self.usable = False     # a kind of call a standby cannot make: none is rehearsed
            return
        device = next(self.layer.parameters()).device.type
        call = Call(a, k, self.layer.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                    torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        kind = (_shapeless(a), _shapeless(k), call.training, call.grad, call.inference, call.autocast)
        calls = self.kinds.get(kind)
        if calls is None:
            if len(self.kinds) >= KINDS_PER_LAYER:
                return
            calls = self.kinds[kind] = []
        if len(calls) < SHAPES_PER_KIND and all((c.args, c.kwargs) != (a, k) for c in calls):
            calls.append(call)

    def export(self) -> Rehearsal | None:
        if not self.usable or not self.kinds:
            return None
        meta = {id(t): (torch.nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                        if isinstance(t, torch.nn.Parameter) else torch.empty_like(t, device="meta"))
                for t in itertools.chain(self.layer.parameters(), self.layer.buffers())}
        wrapped, self.layer._compiled_call_impl = self.layer._compiled_call_impl, None
        try:
            clone = copy.deepcopy(self.layer, meta)
        except Exception:     # a layer holding what cannot be copied (a process group's handle): not rehearsed
            self.usable = False
            return None
        finally:
            self.layer._compiled_call_impl = wrapped
        env = {k: os.environ[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if k in os.environ}
        return Rehearsal(clone, [c for calls in self.kinds.values() for c in calls], self.compile_options,
                         global_state(), env)


def compile_layers(layers: list[torch.nn.Module], **options) -> None:
    """Each layer compiled in place (torch.compile's `options`); the first one's calls recorded for a
    standby to rehearse (export_all)."""
    for layer in layers:
        layer.compile(**options)
    if layers:
        _recorded.add(LayerCalls(layers[0], options))


def export_all() -> list[Rehearsal]:
    """This process's compiled layers, as a standby would rehearse them."""
    return [r for r in (calls.export() for calls in _recorded) if r is not None]


def rehearse(rehearsals: list[Rehearsal], device: torch.device) -> dict:
    """Each layer made real on `device` (zero weights) and called as recorded, the backward too where
    the call made a graph; then let go. Returns the calls made and the seconds they took."""
    t0, made = time.perf_counter(), 0
    for r in rehearsals:
        for k, v in r.env.items():
            os.environ.setdefault(k, v)
        _set_global_state(r.global_state)
        layer = r.layer.to_empty(device=device)
        with torch.no_grad():
            for t in itertools.chain(layer.parameters(), layer.buffers()):
                t.zero_()
        layer.compile(**r.compile_options)
        for call in r.calls:
            layer.train(call.training)
            with torch.inference_mode(call.inference), torch.set_grad_enabled(call.grad), \
                    torch.autocast(device.type, dtype=call.autocast or torch.bfloat16, enabled=call.autocast is not None):
                out = layer(*make(call.args, device), **make(call.kwargs, device))
            grads = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])
            made += 1
        del layer
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return {"calls": made, "seconds": round(time.perf_counter() - t0, 3)}
