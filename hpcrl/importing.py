"""Objects named in a spec as `package.module:name` (reward functions, workers, drivers, environments, tools)."""
from __future__ import annotations

import importlib


def import_object(path: str):
    """"package.module:name" -> the object, or a ValueError that says what is wrong."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"{path!r}: write it as 'package.module:name'")
    try:
        target = importlib.import_module(module)
    except Exception as e:   # noqa: BLE001 - the user's module: anything may fail on import
        raise ValueError(f"{path!r}: module {module} does not import here ({type(e).__name__}: {e}); "
                         "install it where the job runs, or put it on PYTHONPATH") from None
    for part in name.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{path!r}: module {module} has no {name}") from None
        target = getattr(target, part)
    return target
