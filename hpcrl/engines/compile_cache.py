"""Where torch.compile keeps what it compiled: Inductor's graphs and Triton's kernels go to the
run's cache folder (train.rollout.cache_dir, RUN_DIR/cache by default) instead of the node's /tmp,
so that a requeued job, on whichever node Slurm gives it, finds what the job before it compiled,
and runs that name one cache_dir share it."""
from __future__ import annotations

import os
from pathlib import Path


def use_compile_cache(cache_dir: str | Path) -> None:
    """Before the process's first compile. TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR already in
    the environment (a site's own shared cache) are left as they are; no cache_dir: torch's own."""
    if not cache_dir:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(cache_dir) / "triton"))
