"""Where torch.compile keeps what it compiled: Inductor's graphs and Triton's kernels go to one cache
of the user's (train.engine.compile_cache, $XDG_CACHE_HOME/hpcrl/torch-compile by default) instead of
the node's /tmp, so that a requeued job, on whichever node Slurm gives it, and the user's next run
load the kernels the runs before them compiled (both caches write their entries atomically: runs at
the same time share them safely)."""
from __future__ import annotations

import os
from pathlib import Path

from hpcrl.files import cache_dir


def use_compile_cache(path: str | Path = "") -> None:
    """Before the process's first compile: the caches under `path`, or the user's hpcrl cache.
    TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR already in the environment (a site's own) are kept."""
    root = Path(path) if path else cache_dir() / "torch-compile"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
