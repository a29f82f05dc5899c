"""Writes that survive a crash (a reader sees the old file or the new one, never a part of one),
and where downloads are kept."""
from __future__ import annotations

import errno
import os
import re
import stat
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


def atomic_write_text(path: Path, text: str | bytes, mode: int = 0o666) -> None:
    """Write to a temporary name in the same directory, fsync, rename: readers see the old or the new
    file, never a part of one, even after a crash. `text` may be bytes. `mode` is what open() asks
    for, less the umask (0o600: this user's alone, whatever the umask); the file is never opened wider."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with writing(path):
        tmp.unlink(missing_ok=True)      # a crashed write's leftover would keep its own mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def private_dir(path: Path) -> Path:
    """path as a folder only this user can use: made 0700, or where it is there already, refused
    (PermissionError) unless it is a real folder of this user's that no one else may enter. For a
    folder of a predictable name in a place others write (/dev/shm, /tmp)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(errno.EPERM, f"{path} is there already and is not a folder of this user's closed "
                              f"to others (uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): remove it, or "
                              "ask whoever made it", str(path))
    return path


class UnsafePath(ValueError):
    """A path read from the run directory that leads out of the folder it must stay in."""


def confined(root: Path, relative: str, what: str) -> Path:
    """root/relative, where `relative` was read from a file (a manifest): refused (UnsafePath) where
    it is absolute or leads out of root, through '..' or a symbolic link."""
    root = Path(root)
    path = root / relative
    if Path(relative).is_absolute() or not path.resolve().is_relative_to(root.resolve()):
        raise UnsafePath(f"{what} names {relative!r}, which leads out of {root}: hpcrl never writes such a path, so "
                         f"someone or something else changed it; look at who can write {root}, then remove or "
                         "restore the file")
    return path
