"""Run directories on the filesystems users have: one where file locks fail (as on many NFS, Lustre,
GPFS and Cray DVS mounts) and one that fills up during a run. Real HDF5, real driver, real Ray."""
import dataclasses
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
from hpcrl.ppo.config import PPOConfig

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

    cfg = PPOConfig(total_steps=6, save_every=2, progress=False)
    with pytest.MonkeyPatch.context() as unlocked:      # the reference, meanwhile: an ordinary disk, no stop
        unlocked.delenv("LD_PRELOAD")
        once = start_local_training(tmp_path / "once", cfg)

    proc = start_local_training(tmp_path / "twice", cfg)
    wait_until(lambda: len(read_metrics(tmp_path / "twice" / "metrics.jsonl")) >= random.randint(1, 4), 300, "steps")
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == 3                  # committed a checkpoint without a lock
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


def test_a_full_disk_stops_the_run_with_one_message_and_keeps_every_committed_step(tmp_path, small_disk):
    run = tmp_path / "run"
    # saves 3 steps apart, so that the disk is filled between two saves, not during one
    cfg = PPOConfig(total_steps=200, save_every=3, keep_last=100, progress=False)
    from hpcrl.launch.driver import write_local_spec

    write_local_spec(run, dataclasses.asdict(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.launch", str(run), "--local", "--num-cpus", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = CheckpointStore(run)
    wait_until(lambda: store.committed_steps(), 300, "the first committed step")
    smallest = min(r["bytes"] for r in store.manifest(store.committed_steps()[0])["roles"].values())
    # leave room for half of the smallest role file: the next save cannot fit
    with open(small_disk / "filler", "wb", buffering=0) as f:
        while shutil.disk_usage(small_disk).free > smallest // 2:
            try:
                f.write(b"\0" * min(2**20, shutil.disk_usage(small_disk).free - smallest // 2))
            except OSError:
                break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]

    committed = store.committed_steps()
    assert committed and committed[-1] < 200
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    errors = [line for line in err.splitlines() if " error: " in line or line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    message = errors[0]
    for said in (str(run), "no space left", "MB are free on", f"step {committed[-1]}'s did",
                 f"the newest is step {committed[-1]}", "--resume"):
        assert said in message, message
    assert not [p for step in committed for p in store.verify(step)], "a committed step was damaged"
    leftovers = [p.name for p in small_disk.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers

    # the status and the events say so too (they live outside the full filesystem here)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "no space left" in status["error"], status
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "fail" and "no space left" in events[-1]["error"]
    os.remove(small_disk / "filler")
