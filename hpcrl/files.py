"""Writes that survive a crash (a reader sees the old file or the new one, never a part of one),
and where downloads are kept."""
from __future__ import annotations

import errno
import os
from pathlib import Path

# what makes a run directory refuse a write, as OSError's errno
STORAGE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "the disk quota is exceeded",
                  errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission is denied",
                  errno.ENOENT: "the directory is gone", errno.ESTALE: "the file handle is stale (NFS)",
                  errno.EIO: "an I/O error"}


class StorageError(OSError):
    """The run directory could not take a write (full, over quota, read-only, gone): the run stops
    with one message that says what is safe and how to go on."""


def storage_failure(error: BaseException) -> str | None:
    """Why a write failed, where an error (or one it came from, also in another process: a role's
    traceback travels as text) is the storage refusing it; None for any other error."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            return f"{STORAGE_ERRNOS[error.errno]} ({os.strerror(error.errno)})"
        text = str(error)
        for code, why in STORAGE_ERRNOS.items():
            if code != errno.ENOENT and (os.strerror(code) in text or f"[Errno {code}]" in text):
                return f"{why} ({os.strerror(code)})"
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def free_bytes(path: Path) -> int | None:
    """Free space of the filesystem that holds path (or its nearest existing parent)."""
    import shutil

    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


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


def atomic_write_text(path: Path, text: str | bytes, mode: int | None = None) -> None:
    """Write to a temporary name in the same directory, fsync, rename: readers see the old or the new
    file, never a part of one, even after a crash. `text` may be bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
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
