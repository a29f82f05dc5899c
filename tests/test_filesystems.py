"""Run directories on the filesystems users have: one where file locks fail (as on many NFS, Lustre,
GPFS and Cray DVS mounts) and one that fills up during a run. Real HDF5, real driver, real Ray."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, start_local_training, wait_until
from test_requeue import assert_same_training

from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.observe.metrics import read_metrics
from hpcrl.ppo.config import TrainConfig

# flock and fcntl's lock commands fail with ENOLCK ("No locks available", errno 37): what h5py #1082
# reports from NFS; everything else fcntl does goes through
NO_LOCKS_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <sys/file.h>
int flock(int fd, int op) { errno = ENOLCK; return -1; }
static int locks(int cmd) {
    return cmd == F_SETLK || cmd == F_SETLKW || cmd == F_GETLK || cmd == F_OFD_SETLK || cmd == F_OFD_SETLKW
        || cmd == F_OFD_GETLK;
}
#define PASS_ON(name) int name(int fd, int cmd, ...) { \
    va_list ap; va_start(ap, cmd); void *arg = va_arg(ap, void *); va_end(ap); \
    if (locks(cmd)) { errno = ENOLCK; return -1; } \
    static int (*real)(int, int, ...); if (!real) real = dlsym(RTLD_NEXT, #name); \
    return real(fd, cmd, arg); }
PASS_ON(fcntl)
PASS_ON(fcntl64)
"""


@pytest.fixture
def no_locks(tmp_path, monkeypatch):
    """LD_PRELOAD for every process started from here on: no file lock can be taken."""
    src, lib = tmp_path / "no_locks.c", tmp_path / "no_locks.so"
    src.write_text(NO_LOCKS_C)
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True)
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    return lib


def test_checkpoints_write_read_verify_and_resume_without_file_locks(tmp_path, no_locks):
    # the shim bites as such filesystems do: HDF5 with its default locking cannot create a file
    probe = subprocess.run([sys.executable, "-c", "import h5py; h5py.File(__import__('sys').argv[1], 'w')",
                            str(tmp_path / "probe.h5")], capture_output=True, text=True)
    assert probe.returncode != 0 and "unable to lock file, errno = 37" in probe.stderr, probe.stderr

    cfg = TrainConfig(total_steps=6, save_every=2, progress=False)
    with pytest.MonkeyPatch.context() as unlocked:      # the reference, meanwhile: an ordinary disk, no stop
        unlocked.delenv("LD_PRELOAD")
        once = start_local_training(tmp_path / "once", cfg)

    seed = random.randrange(2**32)
    stop_after = random.Random(seed).randint(1, 4)
    proc = start_local_training(tmp_path / "twice", cfg)
    wait_until(lambda: len(read_metrics(tmp_path / "twice" / "metrics.jsonl")) >= stop_after, 300,
               f"{stop_after} steps (seed {seed})")
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == 3, f"seed {seed}"     # committed a checkpoint without a lock
    ckpt = tmp_path / "twice" / "ckpt"
    stopped = json.loads((ckpt / (ckpt / "LATEST").read_text().strip() / "MANIFEST.json").read_text())["step"]
    verify = subprocess.run([sys.executable, "-m", "hpcrl", "ckpt", "verify", str(tmp_path / "twice")],
                            capture_output=True, text=True, cwd=ROOT)
    assert verify.returncode == 0 and f"step {stopped}" in verify.stdout, verify.stdout + verify.stderr
    assert start_local_training(tmp_path / "twice", cfg).wait(timeout=600) == 0     # resumed and finished
    assert once.wait(timeout=600) == 0
    assert_same_training(tmp_path / "once", tmp_path / "twice", 6)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own at RUN_DIR/ckpt (needs root, as CI has)."""
    mount = tmp_path / "run" / "ckpt"
    mount.mkdir(parents=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "hpcrl-test-ckpt", str(mount)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"mounting a tmpfs needs root: {out.stderr}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def start_driver(run, cfg: TrainConfig) -> subprocess.Popen:
    """The driver, locally, its output kept (the one error message is read from it)."""
    from hpcrl.launch.entrypoint import write_local_spec

    write_local_spec(run, cfg)
    return subprocess.Popen([sys.executable, "-m", "hpcrl.launch", str(run), "--local", "--num-cpus", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fill(disk, leave: int) -> None:
    """Fill the filesystem at `disk` until `leave` bytes are free."""
    with open(disk / "filler", "wb", buffering=0) as f:
        while shutil.disk_usage(disk).free > leave:
            try:
                f.write(b"\0" * min(2**20, shutil.disk_usage(disk).free - leave))
            except OSError:
                break


def stopped_with_one_message(proc, run, said: tuple[str, ...]) -> str:
    """The driver exited 1 with one error line, no traceback, saying all of `said`; status.json and
    events.jsonl (outside the refusing filesystem here) say it too. The line."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    errors = [line for line in err.splitlines() if " error: " in line or line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    for part in said:
        assert part in errors[0], errors[0]
    if run.exists():
        status = json.loads((run / "status.json").read_text())
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert status["state"] == "failed" and said[1] in status["error"], status
        assert events[-1]["event"] == "fail" and said[1] in events[-1]["error"]
    return errors[0]


def committed_and_intact(store: CheckpointStore, disk) -> list[int]:
    """The committed steps, each of which still verifies, and no temporary file left on the disk."""
    committed = store.committed_steps()
    assert committed and not [p for step in committed for p in store.verify(step)], "a committed step was damaged"
    leftovers = [p.name for p in disk.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers
    return committed


def test_a_full_disk_stops_the_run_with_one_message_and_keeps_every_committed_step(tmp_path, small_disk):
    run = tmp_path / "run"
    # saves 3 steps apart, so that the disk is filled between two saves, not during one
    proc = start_driver(run, TrainConfig(total_steps=200, save_every=3, keep_last=100, progress=False))
    store = CheckpointStore(run)
    wait_until(lambda: store.committed_steps(), 300, "the first committed step")
    smallest = min(r["bytes"] for r in store.manifest(store.committed_steps()[0])["roles"].values())
    fill(small_disk, smallest // 2)          # room for half of the smallest role file: the next save cannot fit
    message = stopped_with_one_message(proc, run, (str(run), "no space left", "MB are free on", "--resume"))
    committed = committed_and_intact(store, small_disk)
    assert committed[-1] < 200
    for said in (f"step {committed[-1]}'s did", f"the newest is step {committed[-1]}"):
        assert said in message, message
    os.remove(small_disk / "filler")


def test_a_step_that_cannot_fit_whole_is_refused_before_any_role_writes(tmp_path, small_disk):
    """The roles save at once: room for each role's file, not for all of them, refuses the step
    before any file of it is written."""
    run = tmp_path / "run"
    proc = start_driver(run, TrainConfig(total_steps=200, save_every=3, keep_last=100, progress=False))
    store = CheckpointStore(run)
    wait_until(lambda: store.committed_steps(), 300, "the first committed step")
    first = store.committed_steps()[0]
    sizes = {r: info["bytes"] for r, info in store.manifest(first)["roles"].items()
             if info["path"].startswith(store.step_dir(first).name) and r in ("actor_rollout", "critic")}
    assert min(sizes.values()) > 2**20, sizes     # each file alone fits below, both do not
    fill(small_disk, max(sizes.values()) + 3 * 2**19)
    stopped_with_one_message(proc, run, (str(run), "no space left", "need about", "--resume"))
    committed = committed_and_intact(store, small_disk)
    refused = [d for d in (small_disk).glob("step_*") if int(d.name.removeprefix("step_")) > committed[-1]]
    assert not [f.name for d in refused for f in d.iterdir()], "a role wrote a file of the refused step"
    os.remove(small_disk / "filler")


def test_a_read_only_run_directory_stops_the_run_and_keeps_the_committed_steps(tmp_path, small_disk):
    run = tmp_path / "run"
    proc = start_driver(run, TrainConfig(total_steps=200, save_every=2, keep_last=100, progress=False))
    store = CheckpointStore(run)
    wait_until(lambda: store.committed_steps(), 300, "the first committed step")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        stopped_with_one_message(proc, run, (str(run), "the filesystem is read-only", "--resume"))
        committed_and_intact(store, small_disk)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)


# the filesystem's quota, as a quota answers: once the flag file exists, every write to a file under
# HPCRL_QUOTA_DIR fails with EDQUOT (tmpfs here has no quotas, and root would pass them anyway)
QUOTA_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>
static int over(int fd) {
    const char *dir = getenv("HPCRL_QUOTA_DIR"), *flag = getenv("HPCRL_QUOTA_FLAG");
    if (!dir || !flag || access(flag, F_OK) != 0) return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return strncmp(path, dir, strlen(dir)) == 0;
}
#define WRAP(name, params, args) ssize_t name params { \
    static ssize_t (*real) params; if (!real) real = dlsym(RTLD_NEXT, #name); \
    if (over(fd)) { errno = EDQUOT; return -1; } return real args; }
WRAP(write, (int fd, const void *b, size_t n), (fd, b, n))
WRAP(pwrite, (int fd, const void *b, size_t n, off_t o), (fd, b, n, o))
WRAP(pwrite64, (int fd, const void *b, size_t n, off_t o), (fd, b, n, o))
WRAP(writev, (int fd, const struct iovec *v, int c), (fd, v, c))
"""


def test_an_exceeded_quota_stops_the_run_and_keeps_the_committed_steps(tmp_path, monkeypatch):
    src, lib = tmp_path / "quota.c", tmp_path / "quota.so"
    src.write_text(QUOTA_C)
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True)
    run, flag = tmp_path / "run", tmp_path / "over-quota"
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    monkeypatch.setenv("HPCRL_QUOTA_DIR", str(run / "ckpt"))
    monkeypatch.setenv("HPCRL_QUOTA_FLAG", str(flag))
    proc = start_driver(run, TrainConfig(total_steps=200, save_every=2, keep_last=100, progress=False))
    store = CheckpointStore(run)
    wait_until(lambda: store.committed_steps(), 300, "the first committed step")
    flag.touch()
    stopped_with_one_message(proc, run, (str(run), "the disk quota is exceeded", "--resume"))
    flag.unlink()
    committed_and_intact(store, run / "ckpt")


def test_a_vanished_run_directory_stops_the_run_with_one_message(tmp_path):
    run = tmp_path / "run"
    proc = start_driver(run, TrainConfig(total_steps=200, save_every=2, keep_last=100, progress=False))
    wait_until(lambda: CheckpointStore(run).committed_steps(), 300, "the first committed step")
    run.rename(tmp_path / "moved")
    stopped_with_one_message(proc, run, (str(run), "the directory is gone", "is gone (deleted, moved"))
    assert not run.exists(), "the run directory came back"


def test_a_storage_failure_is_known_by_the_errno_of_the_write_that_failed(tmp_path):
    """Not by an error's text: a user's PermissionError, or a message that quotes one, is its own
    error; a write into the run directory refused with a storage errno is a StorageError, also when
    it comes from a role as Ray delivers it, and also where HDF5 reports the errno in its message."""
    import errno

    from ray.exceptions import RayTaskError

    from hpcrl.files import StorageError, storage_failure, writing

    def raised(fn):
        try:
            fn()
        except BaseException as e:     # noqa: BLE001
            return e

    def written(error: OSError):
        """What a write into the run directory that failed with `error` raises."""
        def write():
            with writing(tmp_path / "x"):
                raise error
        return raised(write)

    users = PermissionError(errno.EACCES, "Permission denied", "/etc/shadow")
    assert storage_failure(users) is None
    assert storage_failure(RuntimeError("scorer failed: [Errno 28] No space left on device")) is None
    assert storage_failure(RayTaskError("score", "Traceback...", users).as_instanceof_cause()) is None
    for code, said in ((errno.ENOSPC, "no space left"), (errno.EDQUOT, "quota"), (errno.EROFS, "read-only"),
                       (errno.ENOENT, "gone")):
        e = written(OSError(code, os.strerror(code), str(tmp_path / "x")))
        assert isinstance(e, StorageError) and said in storage_failure(e)
        remote = RayTaskError("save_checkpoint", "Traceback...", e).as_instanceof_cause()
        assert said in storage_failure(remote), remote
    hdf5 = OSError("Unable to synchronously create dataset (file write failed: errno = 122, error message = "
                   "'Disk quota exceeded')")
    assert "quota" in storage_failure(written(hdf5))
    assert storage_failure(written(OSError(errno.EBADF, "Bad file descriptor"))) is None
