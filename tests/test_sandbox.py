"""The code sandbox, for real: bwrap runs each snippet; hostile code is contained and reported by outcome.
Small limits keep the file to seconds; no assertion depends on the machine's speed (CPU-time cases get a
wall clock far above their CPU limit)."""
import os
import shutil
import socket
import subprocess
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from textwrap import dedent

import pytest

from hpcrl.environments.sandbox import Execution, Limits, SandboxUnavailable, check_sandbox, run_python

XDIST_GROUP = "sandbox"    # one worker for the modules that run sandboxes: a test counts every sandbox process on the host

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bwrap is not installed (apt-get install bubblewrap; .ci/install does)")

SMALL = Limits(wall_s=30, cpu_s=1, memory_mb=256, file_mb=4, processes=16, output_bytes=4096)
ROOT = Path(__file__).resolve().parents[1]


def run(code: str, limits: Limits = SMALL, stdin: str = "") -> Execution:
    return run_python(dedent(code), limits, stdin)


def host_processes(token: str) -> list[int]:
    """Pids, as the host sees them, whose command line holds token."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        if token.encode() in cmdline:
            found.append(int(entry))
    return found


def test_check_sandbox_passes_and_ordinary_code_prints_its_answer():
    check_sandbox()
    result = run("""
        import math
        print(sum(math.comb(10, k) for k in range(11)))
        """)
    assert (result.stdout, result.stderr, result.exit_code, result.outcome) == ("1024\n", "", 0, "ok")
    assert not result.truncated and result.summary() == "1024"
    # stdin reaches the code; the system Python runs it, not the caller's venv
    echo = run("""
        import sys
        print(input()[::-1], sys.executable, sys.prefix)
        """, stdin="abc\n")
    assert echo.stdout == "cba /usr/bin/python3 /usr\n", echo.summary()


def test_code_and_stdin_larger_than_a_pipe_pass_whole():
    megabyte = 1 << 20
    result = run(f"# {'x' * megabyte}\nimport sys\nprint(len(sys.stdin.read()))", stdin="z" * megabyte)
    assert (result.outcome, result.stdout) == ("ok", f"{megabyte}\n")
    # code that never reads its stdin: what cannot be written is dropped, and the run ends as usual
    ignored = run("print('done')", stdin="z" * megabyte)
    assert (ignored.outcome, ignored.stdout) == ("ok", "done\n")


def test_an_exception_is_an_error_with_the_tracebacks_last_line():
    result = run("""
        print('before')
        raise ValueError('no such value: 7')
        """)
    assert (result.outcome, result.exit_code, result.stdout) == ("error", 1, "before\n")
    assert result.stderr.strip().splitlines()[-1] == "ValueError: no such value: 7"
    assert "ValueError: no such value: 7" in result.summary() and "exit code 1" in result.summary()


FORK_BOMB = """
    import os, time
    n = 0
    try:
        while True:
            if os.fork() == 0:
                time.sleep(60)
            n += 1
    except OSError:
        print(n)
        raise
    """


def test_a_fork_bomb_stops_at_the_process_limit():
    result = run(FORK_BOMB)
    assert result.outcome == "error" and result.stderr.strip().endswith("Resource temporarily unavailable")
    # the limit counts the sandbox's own processes: bwrap's pid 1, the interpreter and its forks
    assert int(result.stdout) == SMALL.processes - 2
    # two at once: each sandbox has its own count, though both run as the same host user
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: run(FORK_BOMB), range(2)))
    assert [r.stdout for r in both] == [result.stdout] * 2


def test_an_infinite_loop_stops_at_the_cpu_limit():
    spin = run("""
        while True:
            pass
        """, Limits(wall_s=60, cpu_s=1))
    assert (spin.outcome, spin.exit_code) == ("cpu_limit", None)
    assert "CPU time limit" in spin.summary() and 1 <= spin.seconds < 60


def test_sleeping_forever_times_out_and_leaves_no_process_behind():
    # children and a detached grandchild, each a `sleep` named by a token of this test's process
    token = f"{os.getpid():07d}"
    code = f"""
        import os, subprocess
        subprocess.Popen(['sleep', '1000.{token}1'])
        subprocess.Popen(['sleep', '1000.{token}2'], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            os.execv('/usr/bin/sleep', ['sleep', '1000.{token}3'])
        print('started')
        os.execv('/usr/bin/sleep', ['sleep', '1000.{token}4'])
        """
    limits = replace(SMALL, wall_s=3)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run, code, limits)
        seen = []
        while not running.done() and len(seen) < 4:
            seen = host_processes(token)
            time.sleep(0.05)
        result = running.result()
    assert len(seen) == 4, "the four sleeps ran while the sandbox did"
    assert (result.outcome, result.exit_code, result.stdout) == ("timeout", None, "started\n")
    assert limits.wall_s <= result.seconds
    assert host_processes(token) == [], "a sandbox process outlived run_python"


def test_allocating_4_gb_hits_the_memory_limit():
    result = run("""
        block = bytearray(4 << 30)
        print(len(block))
        """)
    assert (result.outcome, result.stdout) == ("memory_limit", "")
    assert result.stderr.strip().splitlines()[-1] == "MemoryError"


def test_a_huge_file_or_a_full_scratch_hits_the_file_limit():
    huge = run("open('big', 'wb').write(bytes(64 << 20))")
    assert huge.outcome == "file_limit" and "File too large" in huge.stderr
    # files each under the limit, but more in all than /tmp holds
    many = run("""
        for i in range(8):
            open(f'/tmp/f{i}', 'wb').write(bytes(1 << 20))
        """)
    assert many.outcome == "file_limit" and "No space left on device" in many.stderr
    # nothing else is writable
    elsewhere = run("""
        for path in ['/main.py', '/usr/x', '/x', '/dev/x']:
            try:
                open(path, 'w')
                print('wrote', path)
            except OSError as e:
                print(e.strerror)
        """)
    assert elsewhere.stdout.splitlines() == ["Read-only file system"] * 4


def test_printing_100_mb_is_cut_at_the_output_limit_in_bounded_memory():
    tracemalloc.start()
    try:
        result = run("""
            import sys
            sys.stdout.write('x' * 100_000_000)
            print('never seen')
            """, Limits(wall_s=30, cpu_s=10, memory_mb=512))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (result.outcome, result.exit_code, result.truncated) == ("output_limit", None, True)
    assert result.stdout == "x" * 4096 + "\n[output truncated at 4096 bytes]"
    assert peak < 1 << 20, f"the caller held {peak} bytes for 100 MB of output"


def test_files_of_the_host_cannot_be_read(tmp_path):
    # a secret in each place the code must not reach: the checkout, the home folder, pytest's tmp_path
    secret = "s3cr3t-43"
    places = [ROOT / ".sandbox-secret", Path.home() / ".sandbox-secret", tmp_path / "secret"]
    for place in places:
        place.write_text(secret)
    paths = ["/etc/shadow", "/etc/passwd", "/root", "/work", "/home", *map(str, places)]
    try:
        result = run(f"""
            import os
            for path in {paths!r}:
                try:
                    print(path, open(path).read() if os.path.isfile(path) else os.listdir(path))
                except OSError as e:
                    print(path, type(e).__name__)
            """)
    finally:
        for place in places[:2]:
            place.unlink()
    assert result.outcome == "ok" and secret not in result.stdout
    assert result.stdout.splitlines() == [f"{path} FileNotFoundError" for path in paths]


def test_the_callers_environment_does_not_reach_the_code(monkeypatch):
    monkeypatch.setenv("HPCRL_SANDBOX_SECRET", "s3cr3t-43")
    result = run("""
        import os
        print(sorted(os.environ), open('/proc/1/environ').read() == '')
        """)
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'PWD'] True\n", result.summary()


def test_the_network_is_unreachable_even_on_this_machine():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0hpcrl-sandbox-test-{port}")  # abstract: no file; reachable from its network namespace only
    unix.listen()
    try:
        result = run(f"""
            import errno, socket
            for where in [('1.1.1.1', 53), ('127.0.0.1', {port})]:
                try:
                    socket.create_connection(where, timeout=2)
                    print('connected')
                except OSError as e:
                    print(errno.errorcode.get(e.errno, repr(e)))
            try:
                socket.socket(socket.AF_UNIX).connect('\\0hpcrl-sandbox-test-{port}')
                print('connected')
            except OSError as e:
                print(errno.errorcode.get(e.errno, repr(e)))
            """)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        unix.close()
    # no route out at all; this machine's loopback and abstract sockets are not the sandbox's
    assert result.stdout.splitlines() == ["ENETUNREACH", "ECONNREFUSED", "ECONNREFUSED"], result.summary()


def test_killing_its_parent_or_every_process_it_can_reaches_nothing_outside():
    bystander = subprocess.Popen(["sleep", "60"])  # the caller's own child, of the same user
    try:
        result = run(f"""
            import os, signal
            print(os.getpid(), os.getppid())
            for pid in (os.getppid(), -1, {bystander.pid}):
                try:
                    os.kill(pid, signal.SIGKILL)
                    print('sent')
                except OSError as e:
                    print(type(e).__name__)
            print('alive')
            """)
        assert bystander.poll() is None, "the sandbox killed a process outside it"
    finally:
        bystander.kill()
        bystander.wait()
    # it is pid 2 under the sandbox's own pid 1, which ignores SIGKILL from inside; -1 finds no one else
    assert result.stdout.splitlines() == ["2 1", "sent", "ProcessLookupError", "ProcessLookupError", "alive"]
    assert result.outcome == "ok"


def test_many_threads_at_once_each_get_their_own_sandbox():
    code = """
        import os, sys
        n = int(sys.stdin.read())
        open('/tmp/mine', 'a').write(str(n))
        print(n * n, open('/tmp/mine').read(), len(os.listdir('/tmp')))
        """
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: run(code, stdin=str(n)), range(24)))
    assert [r.stdout for r in results] == [f"{n * n} {n} 1\n" for n in range(24)]
    assert host_processes("-B\0/main.py") == []


def test_the_summary_says_why_a_run_stopped():
    cases = {"ok": "[no output]", "timeout": "[stopped: the wall-clock time limit was reached]",
             "killed": "[killed by a signal]"}
    for outcome, text in cases.items():
        assert Execution("", "", 0 if outcome == "ok" else None, outcome, 0.1, False).summary() == text
    error = Execution("3\n", "Traceback\nKeyError: 'x'\n", 1, "error", 0.1, False).summary()
    assert error == "3\n[stderr]\nTraceback\nKeyError: 'x'\n[the program exited with an error, exit code 1]"


def test_limits_are_checked_by_name():
    with pytest.raises(ValueError, match=r"Limits.memory_mb must be > 0, got 0"):
        Limits(memory_mb=0)


def test_a_missing_bwrap_is_named_with_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        check_sandbox()
