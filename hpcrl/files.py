"""Writes that survive a crash (a reader sees the old file or the new one, never a part of one),
and where downloads are kept."""
from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path

# what makes a run directory refuse a write, as OSError's errno
STORAGE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "the disk quota is exceeded",
                  errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission is denied",
                  errno.ENOENT: "the directory is gone", errno.ESTALE: "the file handle is stale (NFS)",
                  errno.EIO: "an I/O error"}


class StorageError(OSError):
    """The run directory could not take a write (full, over quota, read-only, gone): the run stops
    with one message that says what is safe and how to go on. Raised by `writing`, where the write
    failed: a storage failure is known by the errno of the storage operation, never by an error's text."""


# HDF5 reports the system call that failed inside its own message: "..., errno = 28, error message = ..."
_HDF5_ERRNO = re.compile(r"\berrno = (\d+)\b")


@contextmanager
def writing(path: Path):
    """Around a write into the run directory: an OSError whose errno says the storage refused it
    (STORAGE_ERRNOS; HDF5's own report of the failed call included) becomes a StorageError naming path."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        code = e.errno if e.errno in STORAGE_ERRNOS else next(
            (int(m) for m in _HDF5_ERRNO.findall(str(e)) if int(m) in STORAGE_ERRNOS), None)
        if code is None:
            raise
        raise StorageError(code, f"{STORAGE_ERRNOS[code]} ({os.strerror(code)})", str(path)) from e


def storage_failure(error: BaseException) -> str | None:
    """Why a write into the run directory failed, where `error` is (or came from, also in another
    process: a role's error arrives as a RayTaskError of the same class) a StorageError; None for
    any other error, whatever its text says."""
    seen = 0
    while error is not None and seen < 10:
        inner = getattr(error, "cause", None)   # Ray's copy of a role's error holds the original as its cause
        if isinstance(error, StorageError) and not isinstance(inner, StorageError):
            return error.strerror
        error, seen = inner or error.__cause__ or error.__context__, seen + 1
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
    with writing(path):
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
