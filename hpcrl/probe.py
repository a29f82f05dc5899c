"""What another Python interpreter can do: the job's interpreter is probed before submission."""
from __future__ import annotations

import subprocess


def interpreter_problem(python: str, code: str) -> str | None:
    """None if `python -c code` exits 0; else why not: the last line it printed, or that it did not run."""
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} did not run: {e}"
    if out.returncode:
        lines = (out.stderr or out.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit {out.returncode}"
    return None
