"""Where torch.compile keeps what it compiled: Inductor's graphs and Triton's kernels go to one cache
of the user's (train.engine.compile_cache, $XDG_CACHE_HOME/hpcrl/torch-compile by default) instead of
the node's /tmp, so that a requeued job, on whichever node Slurm gives it, and the user's next run
load the kernels the runs before them compiled (both caches write their entries atomically: runs at
the same time share them safely). Where that cache cannot be written (a container's read-only home),
the run's own cache folder serves.

The kernels are not all of a compile: Dynamo traces every graph again in each new process, and traces
twice where a call meets a second shape (a static graph first, then one with symbolic sizes). Dynamo
records which sizes changed (its automatic-dynamic profile, "local PGO") in the same cache, under the
job's name: a process of a job named so (a requeued start, a rebuilt rank) traces the graph with
symbolic sizes at once. (A standby imports Dynamo before its role names the cache and the job, so its
profile is kept in torch's default cache, the node's /tmp.)"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from hpcrl.files import cache_dir


def use_compile_cache(path: str | Path = "", fallback: str | Path = "", job: str | Path = "") -> None:
    """Before the process's first compile, and before torch._dynamo is imported (it makes its cache
    folder on import): the caches under `path`, else the user's hpcrl cache where it can be written,
    else under `fallback` (the run's cache folder). TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR already
    in the environment (a site's own) are kept. `job`: what names the training job across its starts
    (its run's cache folder): torch.compile's job id, under which Dynamo keeps which sizes change, unless
    TORCH_COMPILE_JOB_ID names one already."""
    if job:
        import torch.compiler.config

        if torch.compiler.config.job_id is None:
            torch.compiler.config.job_id = "hpcrl-" + hashlib.sha256(str(Path(job).absolute()).encode()).hexdigest()[:16]
        # the profile is off by default before torch 2.7; Dynamo's config reads the variable when imported
        if os.environ.setdefault("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO", "1") == "1" and \
                (dynamo := sys.modules.get("torch._dynamo.config")) is not None:
            dynamo.automatic_dynamic_local_pgo = True
    root = Path(path) if path else _writable(cache_dir() / "torch-compile") or (Path(fallback) if fallback else None)
    if root is None:
        return       # torch's own: the node's /tmp
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def _writable(folder: Path) -> Path | None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None
