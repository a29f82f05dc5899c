"""A run's log files, one at a time or merged by time (`hpcrl logs`).

    driver     logs/slurm-<job>.out: the batch script's [hpcrl] lines and the driver's dated lines
               (one file per start of the job: a requeued job writes a new one)
    <role>     logs/<role>/rank<k>.log: every line dated, with [role rankK]; beside it
               rank<k>.calls.jsonl, each call the rank ran (method, step, start, end; on a GPU its peak
               memory: gpu_reserved_gib, gpu_allocated_gib, gpu_process_gib): read_calls
    ray        logs/ray/<node>.log: each node's `ray start`

Merging uses the date that starts a line; a line without one (a traceback, a script line) keeps
the date of the line before it in its file. Following (`hpcrl logs -f`) prints whole lines only
and ends once the run has (run_ended): its Slurm job, or for a local run its driver's status.
"""
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from hpcrl.observe.status import read_status
from hpcrl.run_dir import RunDir
from hpcrl.slurm.cluster_info import SlurmCommandError
from hpcrl.slurm.sbatch import TERMINAL, SubmitError, component_states

_DATE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,](\d{3}))?")


@dataclass(frozen=True)
class LogFile:
    source: str          # "driver", "actor_rollout/rank0", "ray/a100n1"
    path: Path


def log_files(run_dir: Path, which: str | None = None, rank: int | None = None) -> list[LogFile]:
    """The files of one source ("driver", "ray" or a role), or of all of them (which=None)."""
    paths = RunDir(run_dir)
    logs = paths.logs
    roles = sorted(p.name for p in logs.iterdir() if p.is_dir() and p != paths.ray_logs) if logs.is_dir() else []
    if which not in (None, "driver", "ray", *roles):
        raise ValueError(f"no logs for {which!r} in {logs}; there are: driver, ray" + "".join(f", {r}" for r in roles))
    files = []
    if which in (None, "driver"):
        files += [LogFile("driver", p) for p in sorted(logs.glob(paths.slurm_log().name), key=_job_number)]
    if which in (None, "ray"):
        files += [LogFile(f"ray/{p.stem}", p) for p in sorted(paths.ray_logs.glob("*.log"))]
    for role in roles if which is None else [which] if which in roles else []:
        for p in sorted(paths.role_logs(role).glob("rank*.log"), key=lambda p: int(p.stem[4:])):
            if rank is None or p.stem == f"rank{rank}":
                files.append(LogFile(f"{role}/{p.stem}", p))
    if rank is not None and not any("/rank" in f.source for f in files):
        raise ValueError(f"no rank{rank}.log for {which or 'any role'} in {logs}")
    return files


def read_calls(run_dir: Path, rank: int = 0) -> dict[str, list[dict]]:
    """role -> the calls its rank `rank` ran, in order (roles without a calls file are left out)."""
    paths, out = RunDir(run_dir), {}
    if not paths.logs.is_dir():
        return out
    for role in sorted(p.name for p in paths.logs.iterdir() if p.is_dir() and p != paths.ray_logs):
        path = paths.rank_calls(role, rank)
        if path.exists():   # a line cut short by a crash is skipped
            out[role] = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return out


def _job_number(path: Path) -> int:
    digits = re.findall(r"\d+", path.stem)
    return int(digits[-1]) if digits else 0


def line_time(line: str) -> float | None:
    m = _DATE.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2) or 0) / 1000


def _dated(f: LogFile, lines: list[str]):
    t = 0.0
    for line in lines:
        t = line_time(line) or t
        yield t, f.source, line


def merged_lines(files: list[LogFile]) -> list[str]:
    """Every line of every file, ordered by time (stable within a file), prefixed with its source."""
    width = max((len(f.source) for f in files), default=0)
    dated = [x for f in files for x in _dated(f, f.path.read_text(encoding="utf-8", errors="replace").splitlines())]
    return [f"{src:<{width}}  {line}" for _, src, line in sorted(dated, key=lambda x: x[0])]


def run_ended(run_dir: Path) -> bool:
    """A submitted run has ended when its job has: a driver that stopped (deadline, preemption) is
    requeued and goes on, one that was killed never says it ended. Where Slurm cannot say (no client
    here, slurmctld unreachable) and for a local run, the driver's last word in status.json."""
    paths = RunDir(run_dir)
    if paths.job.exists():
        try:
            return all(s in TERMINAL for s in component_states(json.loads(paths.job.read_text())["job_id"]).values())
        except SubmitError:
            return True         # forgotten by slurmctld and by accounting: long over
        except SlurmCommandError:
            pass
    return (read_status(run_dir) or {}).get("state") in ("finished", "stopped", "failed")


def follow(run_dir: Path, which: str | None, rank: int | None, poll_s: float = 0.5, out=sys.stdout,
           until=lambda: False) -> None:
    """What is there now, then each new line once it is whole (new files too: a rebuilt rank, a
    requeued job's new output), until the run has ended (run_ended) or `until()` is true, or Ctrl-C;
    what was written before the end is printed, a last line without its newline too."""
    offsets: dict[Path, int] = {}     # bytes printed of each file: a character may span bytes
    width = 0
    try:
        while True:
            ended = until() or run_ended(run_dir)     # asked before reading: nothing written before the end is left
            files = log_files(run_dir, which, rank)
            width = max([width, *(len(f.source) for f in files)])
            for f in files:
                start = offsets.get(f.path, 0)
                if f.path.stat().st_size <= start:
                    continue
                with open(f.path, "rb") as fh:
                    fh.seek(start)
                    chunk = fh.read()
                # a line still being written waits for its end; a "\n" byte is never inside a UTF-8 character
                done = len(chunk) if ended else chunk.rfind(b"\n") + 1
                offsets[f.path] = start + done
                for line in chunk[:done].decode(errors="replace").splitlines():
                    out.write(f"{f.source:<{width}}  {line}\n")
            out.flush()
            if ended:
                return
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return
