"""Your own roles: a worker class named in the spec (`roles.<role>.worker: package.module:Class`).

The class subclasses `hpcrl.Worker` and marks the methods the driver calls with
`@register(dispatch=...)`, as the built-in roles do. Its state goes into the role's checkpoint
file through its own `state_dict()` / `load_state_dict(state)` (tensors, numbers, strings, nested
dicts and lists); a class without `state_dict` is frozen: its file is written once per run.
"""
from __future__ import annotations

import inspect

from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Worker
from hpcrl.controller.dispatch import registered_methods
from hpcrl.importing import import_object


def worker_class(path: str, init_args: dict | None = None) -> type:
    """The class `path` names, checked: a Worker subclass whose __init__ takes `init_args`;
    ValueError (what is wrong and the fix) otherwise."""
    cls = import_object(path)
    if not inspect.isclass(cls):
        raise ValueError(f"{path!r} is a {type(cls).__name__}, not a class; name a subclass of hpcrl.Worker")
    if not issubclass(cls, Worker):
        raise ValueError(f"{path!r} is not a subclass of hpcrl.Worker (write `class {cls.__name__}(hpcrl.Worker)` "
                         "and mark its methods with @hpcrl.register)")
    try:
        inspect.signature(cls.__init__).bind(None, **(init_args or {}))
    except TypeError as e:
        raise ValueError(f"{path!r}: {cls.__name__}.__init__ does not take these worker_args "
                         f"{sorted(init_args or {})}: {e}") from None
    return cls


def method_problem(cls: type, method: str) -> str | None:
    """Why the driver cannot call `method` on the role of this class, or None."""
    methods = registered_methods(cls)
    if method in methods:
        return None
    if callable(getattr(cls, method, None)):
        return f"{cls.__name__}.{method} is not registered (decorate it with @register(dispatch=...))"
    return f"{cls.__name__} has no method {method} (registered: {', '.join(sorted(methods)) or 'none'})"


def checkpointed(cls: type) -> type:
    """cls with the checkpoint methods every role has (hpcrl/checkpoint/role.py), its state from its
    own state_dict/load_state_dict; frozen when it has no state_dict."""
    if issubclass(cls, Checkpointed):
        return cls
    has_state = callable(getattr(cls, "state_dict", None))
    says_elastic = any("elastic" in k.__dict__ for k in cls.__mro__ if k is not Worker)
    # a class without state of its own may be resized (`hpcrl scale`) unless it says otherwise
    members = {"frozen": not has_state, "__doc__": cls.__doc__, "elastic": cls.elastic if says_elastic else not has_state}
    if has_state:
        members["checkpoint_state"] = lambda self: self.state_dict()
        members["load_checkpoint_state"] = lambda self, state: self.load_state_dict(state)
    return type(cls.__name__, (Checkpointed, cls), members)
