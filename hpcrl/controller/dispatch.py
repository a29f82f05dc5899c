"""How one driver call becomes a call on every rank of a WorkerGroup, and back.

A dispatch mode is two functions: `split(world_size, args, kwargs)` gives each rank its
(args, kwargs), or None to leave that rank out; `collect(results)` turns the ranks' results
(in rank order) into what the driver gets. `@register(dispatch=...)` on a Worker method makes it
a method of the WorkerGroup.

    ONE_TO_ALL   every rank gets the same arguments; the driver gets the list of results
    ALL_RANK_ZERO  every rank runs it (a collective: gathering sharded weights); rank 0's result comes back
    ALL_TO_ALL   each argument is a list with one entry per rank; a list comes back
    RANK_ZERO    only rank 0 runs it; its result comes back
    DP_COMPUTE   every Batch argument is cut into world_size consecutive chunks, rank k gets
                 chunk k, other arguments go to all; Batch results are concatenated in rank order

Arguments may be futures of another group's call (`wg.method.future(...)`): they are handed
to the ranks as Ray object refs and never fetched by the driver.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hpcrl.controller.batch import Batch, concat_results


def _is_deferred(x) -> bool:
    """A value still being computed elsewhere (a GroupFuture: `whole()` is one object ref to the
    collected value, `shards(n)` n refs to its Batch chunks): the driver passes refs, not data."""
    return hasattr(x, "shards") and hasattr(x, "whole")


def _whole(x):
    return x.whole() if _is_deferred(x) else x


def _shards(x, n: int) -> list:
    if _is_deferred(x):
        return x.shards(n)
    if isinstance(x, Batch):
        return x.chunk(n)
    return [x] * n


@dataclass(frozen=True)
class DispatchMode:
    name: str
    split: Callable[[int, tuple, dict], list[tuple[tuple, dict] | None]]
    collect: Callable[[list], Any]
    concatenates: bool = False   # results are Batch chunks in rank order (a future can be re-chunked)
    rank_zero: bool = False      # the result is rank 0's alone (a future passes its ref on as it is)


def _one_to_all(n, args, kwargs):
    args, kwargs = tuple(_whole(a) for a in args), {k: _whole(v) for k, v in kwargs.items()}
    return [(args, kwargs)] * n


def _all_to_all(n, args, kwargs):
    for name, v in [*enumerate(args), *kwargs.items()]:
        if not isinstance(v, (list, tuple)) or len(v) != n:
            raise TypeError(f"ALL_TO_ALL argument {name!r} must be a list of {n} (one per rank), got {type(v).__name__}")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]


def _rank_zero(n, args, kwargs):
    return [_one_to_all(1, args, kwargs)[0]] + [None] * (n - 1)


def _dp_compute(n, args, kwargs):
    def shard(v):
        return _shards(v, n) if isinstance(v, Batch) or _is_deferred(v) else [v] * n
    a = [shard(v) for v in args]
    k = {name: shard(v) for name, v in kwargs.items()}
    return [(tuple(x[r] for x in a), {name: v[r] for name, v in k.items()}) for r in range(n)]


class Dispatch:
    ONE_TO_ALL = DispatchMode("ONE_TO_ALL", _one_to_all, list)
    ALL_TO_ALL = DispatchMode("ALL_TO_ALL", _all_to_all, list)
    RANK_ZERO = DispatchMode("RANK_ZERO", _rank_zero, lambda results: results[0], rank_zero=True)
    ALL_RANK_ZERO = DispatchMode("ALL_RANK_ZERO", _one_to_all, lambda results: results[0], rank_zero=True)
    DP_COMPUTE = DispatchMode("DP_COMPUTE", _dp_compute, concat_results, concatenates=True)


_CUSTOM: dict[str, DispatchMode] = {}


def register_dispatch(mode: DispatchMode) -> DispatchMode:
    """Make a custom mode usable by name: `@register(dispatch="my_mode")`."""
    _CUSTOM[mode.name] = mode
    return mode


def resolve(dispatch: DispatchMode | str) -> DispatchMode:
    if isinstance(dispatch, DispatchMode):
        return dispatch
    if hasattr(Dispatch, dispatch):
        return getattr(Dispatch, dispatch)
    if dispatch in _CUSTOM:
        return _CUSTOM[dispatch]
    raise ValueError(f"unknown dispatch mode {dispatch!r}: use one of ONE_TO_ALL, ALL_RANK_ZERO, ALL_TO_ALL, RANK_ZERO, "
                     f"DP_COMPUTE{''.join(', ' + n for n in _CUSTOM)} or register_dispatch() your own")


def register(dispatch: DispatchMode | str = Dispatch.ONE_TO_ALL, *, changes_state: bool = False, keeps: bool = False):
    """Mark a Worker method as a WorkerGroup method called with this dispatch mode.

    changes_state: the call changes what the role's checkpoint holds (an optimizer step). Once it
    has returned, the group keeps the call: if a process of the group dies before the role's next
    snapshot or checkpoint, the rebuilt group takes that state back and makes these calls again.
    keeps: the method returns (result, kept); the driver gets the result, and `future.kept` holds
    one object ref per rank to `kept`, which stays in the object store of that rank's node, owned
    by the driver (it outlives the process that made it) and is never fetched by the driver."""
    mode = resolve(dispatch)

    def mark(fn):
        fn.__hpcrl_dispatch__ = mode
        fn.__hpcrl_changes_state__ = changes_state
        fn.__hpcrl_keeps__ = keeps
        return fn
    return mark


def registered_methods(cls) -> dict[str, DispatchMode]:
    return {name: getattr(cls, name).__hpcrl_dispatch__ for name in dir(cls)
            if hasattr(getattr(cls, name, None), "__hpcrl_dispatch__")}
