"""Runs one piece of model-written Python in a throwaway bubblewrap sandbox, under resource limits.

Each call starts `bwrap` with new user, pid, network, IPC, UTS and cgroup namespaces; the code sees a
read-only /usr (the system Python and its libraries), a fresh /proc and /dev, and a size-limited tmpfs
/tmp as its scratch, and nothing else of the host: no /home, /root, /work, /etc or run directory. Inside,
`prlimit` sets the CPU, address-space, file-size, process and open-file limits before Python starts;
the caller enforces wall-clock time and output size and then kills the sandbox's process group, which
takes the whole pid namespace with it. Nothing is written on the host: the code goes in through a
memfd and the scratch lives in the sandbox's own mount namespace. docs/pages/how-to/code-sandbox.md
says what is and is not isolated.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import select
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Debian's and RHEL's own interpreter: outside every home and run directory, so binding /usr read-only
# gives the sandbox a whole Python (stdlib, and packages installed system-wide by apt/dnf) and nothing else.
PYTHON = "/usr/bin/python3"
PRLIMIT = "/usr/bin/prlimit"
# --disable-userns (no nested user namespaces inside the sandbox) came in bubblewrap 0.8
BWRAP_MIN_VERSION = (0, 8)
# `nobody`: when the caller is root, bwrap runs as this uid instead, so the sandbox's user maps to an
# unprivileged host user (root is exempt from RLIMIT_NPROC, and an escape would land as root)
NOBODY = 65534
OPEN_FILES = 256
_READ_CHUNK = 1 << 16
_STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class Limits:
    """What one execution may use. CPU time is per process, rounded up to whole seconds (RLIMIT_CPU);
    memory is each process's address space; file_mb bounds every file and, separately, the total of
    /tmp and of /dev/shm (each a tmpfs of that size); output_bytes bounds stdout and stderr each."""
    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 16
    processes: int = 32
    output_bytes: int = 4096

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "file_mb", "processes", "output_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {value!r}")


# why a non-"ok" execution stopped, as summary() tells the model
_STOPPED = {
    "error": "the program exited with an error",
    "timeout": "stopped: the wall-clock time limit was reached",
    "cpu_limit": "stopped: the CPU time limit was reached",
    "memory_limit": "failed: the memory limit was reached",
    "output_limit": "stopped: the program printed more than the output limit",
    "file_limit": "failed: the file size or scratch space limit was reached",
    "killed": "killed by a signal",
}


@dataclass(frozen=True)
class Execution:
    """What one run_python call gave. outcome is one of:
    "ok" (exit 0), "error" (nonzero exit, e.g. an uncaught exception; a fork that hit the process limit
    shows here as BlockingIOError), "timeout" (wall clock), "cpu_limit" (SIGXCPU), "memory_limit" (exited
    with MemoryError), "file_limit" (SIGXFSZ, or exited with EFBIG/ENOSPC), "output_limit" (stdout or
    stderr passed limits.output_bytes; stopped there), "killed" (any other signal, e.g. SIGKILL at the
    hard CPU limit or from the OOM killer). exit_code is None when the sandbox was killed."""
    stdout: str
    stderr: str
    exit_code: int | None
    outcome: str
    seconds: float
    truncated: bool

    def summary(self) -> str:
        """The output (stdout, then stderr) and, unless the run was "ok", why it stopped."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.outcome != "ok":
            code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
            parts.append(f"[{_STOPPED[self.outcome]}{code}]")
        return "\n".join(parts) if parts else "[no output]"


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox; the message names what is missing and the fix."""


_INSTALL = "install bubblewrap >= 0.8 (Debian/Ubuntu: apt-get install bubblewrap; RHEL/Fedora: dnf install bubblewrap)"


def _bwrap() -> str:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"the code sandbox needs bwrap, which is not on PATH: {_INSTALL}")
    return bwrap


def check_sandbox() -> None:
    """Raise SandboxUnavailable unless a sandbox starts here and runs Python (one real execution)."""
    bwrap = _bwrap()
    for path, package in ((PYTHON, "python3"), (PRLIMIT, "util-linux")):
        if not os.access(path, os.X_OK):
            raise SandboxUnavailable(f"the code sandbox runs {path}, which is missing: install {package}")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, check=False).stdout
    found = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if found < BWRAP_MIN_VERSION:
        raise SandboxUnavailable(f"{bwrap} is {version.strip() or 'of unknown version'}: {_INSTALL}")
    trial = run_python("print(6 * 7)", Limits(wall_s=30))
    if trial.stdout != "42\n":
        # bwrap's own message, e.g. "bwrap: No permissions to creating new namespace"
        raise SandboxUnavailable(
            f"{bwrap} could not start a sandbox ({trial.outcome}: {trial.stderr.strip() or trial.stdout.strip()}); "
            "it needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone=1 (older Debian kernels), and on Ubuntu >= 23.10 "
            "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap")


def _command(bwrap: str, code_fd: int, limits: Limits) -> list[str]:
    scratch = str(limits.file_mb << 20)
    cpu = math.ceil(limits.cpu_s)
    view = []  # /bin, /lib, ... as the host has them: symlinks into /usr (merged /usr) or directories
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            view += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            view += ["--ro-bind", top, top]
    return [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        "--ro-bind", "/usr", "/usr", *view, "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
        "--proc", "/proc", "--dev", "/dev",
        "--size", scratch, "--tmpfs", "/tmp", "--size", scratch, "--tmpfs", "/dev/shm",
        "--ro-bind-data", str(code_fd), "/main.py",
        # only /tmp and /dev/shm stay writable: the root and /dev are tmpfs without a size limit
        "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
        PRLIMIT, f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}", f"--fsize={limits.file_mb << 20}",
        f"--nproc={limits.processes}", f"--nofile={OPEN_FILES}", "--core=0", "--",
        # -I: no environment variables, user site or script directory; -u: what was printed before a
        # timeout reaches the caller; -B: /usr is read-only anyway
        PYTHON, "-I", "-u", "-B", "/main.py",
    ]


def _exchange(proc: subprocess.Popen, stdin: bytes, cap: int, deadline: float) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and read stdout and stderr, keeping at most cap + 1 bytes of each, until both close, the
    deadline passes ("timeout") or one passes cap ("output_limit"). Polls, in the calling thread only."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    pending = memoryview(stdin)
    with selectors.PollSelector() as sel:
        for stream in kept:
            sel.register(stream, selectors.EVENT_READ)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        stopped = None
        while stopped is None and sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(left):
                stream = key.fileobj
                if stream is proc.stdin:
                    try:
                        pending = pending[os.write(stream.fileno(), pending[:_READ_CHUNK]):]
                    except BrokenPipeError:  # the code stopped reading: the rest is dropped
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(stream)
                        stream.close()
                    continue
                chunk = os.read(stream.fileno(), _READ_CHUNK)
                if not chunk:
                    sel.unregister(stream)
                    continue
                buf = kept[stream]
                buf += chunk[:cap + 1 - len(buf)]
                if len(buf) > cap:
                    stopped = "output_limit"
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), stopped


def _text(data: bytes, cap: int) -> str:
    text = data[:cap].decode("utf-8", "replace")
    return text + f"\n[output truncated at {cap} bytes]" if len(data) > cap else text


def _outcome(returncode: int, stderr: bytes) -> tuple[str, int | None]:
    """The outcome and exit code from bwrap's exit status, which is the code's, or 128 + a signal number."""
    if returncode == 0:
        return "ok", 0
    if returncode > 128 and returncode - 128 < signal.NSIG:
        sig = returncode - 128
        return {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_limit"}.get(sig, "killed"), None
    # Python ignores SIGXFSZ, so a file past the limit is an OSError (EFBIG), a full tmpfs ENOSPC
    last = stderr.strip().rsplit(b"\n", 1)[-1]
    if last.startswith(b"MemoryError"):
        return "memory_limit", returncode
    if b"[Errno 27]" in last or b"[Errno 28]" in last:
        return "file_limit", returncode
    return "error", returncode


def _stop(proc: subprocess.Popen) -> None:
    """Kill the sandbox, if still running, and return once none of its processes is left."""
    if proc.returncode is not None:  # reaped: it ended by itself, and its pid may be another's now
        return
    # The sandbox's pid 1 (bwrap's only child) first: the kernel then kills the rest of its pid namespace,
    # and pid 1 exits, and bwrap after it, only once they are all gone. The pidfd names one process for
    # good; the pid was pid 1's if, while that process has not exited, its parent is bwrap (our unreaped
    # child, so no other process can have bwrap's pid).
    killed = False
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid1 = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        pidfd = os.pidfd_open(pid1)
        try:
            ppid = int(Path(f"/proc/{pid1}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == proc.pid and not select.select([pidfd], [], [], 0)[0]:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed = True
        finally:
            os.close(pidfd)
    if killed:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_STOP_WAIT_S)
    if proc.returncode is None:  # no pid 1 yet, or it would not go: bwrap's group (--die-with-parent then
        os.killpg(proc.pid, signal.SIGKILL)  # kills pid 1, and the kernel the namespace, soon after)
        proc.wait()


def run_python(code: str, limits: Limits = Limits(), stdin: str = "") -> Execution:
    """Run `code` with /usr/bin/python3 in a fresh sandbox and return what it printed and how it ended.
    Blocks the calling thread for at most about limits.wall_s; safe to call from many threads at once."""
    bwrap = _bwrap()
    start = time.monotonic()
    code_fd = os.memfd_create("hpcrl-sandbox-code")
    try:
        os.write(code_fd, code.encode(errors="replace"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        # no preexec_fn (not thread-safe): the uid switch and new session happen in subprocess's C code
        as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        proc = subprocess.Popen(
            _command(bwrap, code_fd, limits), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(code_fd,), start_new_session=True, cwd="/", env={}, **as_nobody)
    finally:
        os.close(code_fd)
    with proc:
        try:
            stdin_bytes = stdin.encode(errors="replace")
            out, err, stopped = _exchange(proc, stdin_bytes, limits.output_bytes, start + limits.wall_s)
            if stopped is None:
                try:  # both pipes closed: the sandbox is exiting
                    proc.wait(max(0.0, start + limits.wall_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    stopped = "timeout"
        finally:
            _stop(proc)
    outcome, exit_code = (stopped, None) if stopped else _outcome(proc.returncode, err)
    cap = limits.output_bytes
    return Execution(stdout=_text(out, cap), stderr=_text(err, cap), exit_code=exit_code, outcome=outcome,
                     seconds=time.monotonic() - start, truncated=max(len(out), len(err)) > cap)
