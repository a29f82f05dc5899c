"""Writes that survive a crash (a reader sees the old file or the new one, never a part of one),
and where downloads are kept."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """hpcrl's downloads (a model, a dataset's source file), kept between runs: $XDG_CACHE_HOME/hpcrl."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcrl"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """A fully written and synced tmp becomes path, atomically, and the rename survives a crash."""
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write to a temporary name in the same directory, fsync, rename: readers see the old or the new
    file, never a part of one, even after a crash."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
