"""The batch script's half of stopping and requeueing (Slurm only; the driver's half is EXIT_REQUEUE).

    python -m hpcrl.slurm.requeue deadline   epoch seconds by which the driver must have stopped:
                                             the job's end time from Slurm, minus the signal lead
    python -m hpcrl.slurm.requeue after RC   RC == 3: requeue the job (its hetjob leader) unless
                                             requeue is off, the restart count reached the limit
                                             or `hpcrl cancel` asked (then the job cancels itself);
                                             says which, and why, in the job log. Exits with the
                                             batch script's status: non-zero (the job ends FAILED)
                                             when training stopped before its last step and the
                                             job neither requeues nor was cancelled.
                                             Where Slurm requeued the job itself for a failed node
                                             (the driver then dies with its steps), it makes the
                                             requeue whole: Slurm 22.05 requeues only the hetjob
                                             components up to the failed node's and leaves the
                                             others to end FAILED with the batch script, so that
                                             the job would pend forever
    python -m hpcrl.slurm.requeue after-submitit RC
                                             the same for a job of --via submitit, whose function
                                             exited with RC: submitit requeues the whole job itself
                                             on USR2; only a requeue Slurm left partial after a
                                             failed node is made whole (or cancelled whole)
"""
from __future__ import annotations

import os
import sys
import time

from hpcrl.env_vars import EXIT_REQUEUE, JobEnv
from hpcrl.run_dir import RunDir
from hpcrl.slurm.allocation import restart_count
from hpcrl.slurm.cluster_info import SlurmCommandError, parse_records, slurm_cmd


def job_end_time(job_id: str) -> float | None:
    """Slurm's own end time of the job (not when the driver started), or None without a limit."""
    if os.environ.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(os.environ["SLURM_JOB_END_TIME"])
    out = slurm_cmd("squeue", "-h", "-o", "%e", "-j", job_id).split()
    if not out or out[0] in ("N/A", "NONE", "Unknown"):
        return None
    return time.mktime(time.strptime(out[0], "%Y-%m-%dT%H:%M:%S"))


def deadline() -> str:
    end = job_end_time(os.environ["SLURM_JOB_ID"])
    return "" if end is None else f"{end - JobEnv.read().signal_lead:.0f}"


def requeued_components(job: str, count: int) -> tuple[list[int], list[int], str]:
    """(components Slurm requeued since this start, the others, the failed node or '') of the
    hetjob `job`, whose batch script started at restart `count`."""
    recs = parse_records(slurm_cmd("scontrol", "show", "job", "-o", job))
    done = sorted(int(r.get("HetJobOffset", 0)) for r in recs if int(r.get("Restarts", 0)) > count)
    rest = sorted(int(r.get("HetJobOffset", 0)) for r in recs if int(r.get("Restarts", 0)) <= count)
    failed = next((r["FailedNode"] for r in recs if r.get("FailedNode", "(null)") != "(null)"), "")
    return done, rest, failed


def after_node_failure(job: str, rc: int, count: int, limit: int, requeued: list[int], node: str) -> int:
    """Slurm requeued components `requeued` of the hetjob for a failed node while this batch script
    runs: requeue every component (`scontrol requeue` of the leader takes the ones still running;
    it refuses the pending ones, so its status says nothing), or cancel them all where no restart
    is left or hpcrl cancel asked. Never a job left with some components pending, others ended."""
    env = JobEnv.read()
    failure = f"Slurm requeued components {','.join(map(str, requeued))} of job {job} after the failure of " \
              f"{'node ' + node if node else 'a node'} (the driver exited with {rc}: its error is above)"
    why = ("hpcrl cancel asked" if RunDir(env.run_dir).cancel.exists() else
           f"restart count {count} has reached max_restarts {limit}" if count >= limit else None)
    if why is None:
        print(f"[hpcrl] {failure}; requeueing the whole hetjob (restart {count + 1} of at most {limit}): the run "
              "resumes from its last committed checkpoint", flush=True)
        for _ in range(5):
            try:
                slurm_cmd("scontrol", "requeue", job)
            except SlurmCommandError:
                pass    # "Job is pending execution" for the components Slurm requeued
            left = requeued_components(job, count)[1]
            if not left:
                return 0
            time.sleep(1)
        why = f"components {','.join(map(str, left))} refused to requeue"
    print(f"[hpcrl] {failure}; not requeued: {why}: the whole hetjob is cancelled (CANCELLED); continue the run "
          "from its last committed checkpoint with hpcrl submit --resume", flush=True)
    try:
        slurm_cmd("scancel", job)
    except SlurmCommandError as e:
        print(f"[hpcrl] scancel {job} refused ({e})", flush=True)
    return rc


def after_lost_node(job: str, rc: int, count: int, only_part: bool = False) -> int | None:
    """after_node_failure's status where Slurm requeued components of the hetjob since this start (it
    does so for a failed node; with only_part, only where it left others out), else None."""
    try:
        requeued, rest, node = requeued_components(job, count)
    except SlurmCommandError as e:
        print(f"[hpcrl] could not read job {job}'s state ({e})", flush=True)
        return None
    if not requeued or (only_part and not rest):
        return None
    return after_node_failure(job, rc, count, JobEnv.read().max_restarts, requeued, node)


def after_submitit(rc: int) -> int:
    """The requeue step of a job of `hpcrl submit --via submitit`, once the function's step exited with
    rc; the batch script's status. submitit requeues the job itself on USR2 (`scontrol requeue` of
    the whole job, its max_num_timeout the limit), which this leaves alone; what submitit cannot see
    is Slurm requeueing only some components after a failed node: made whole, or cancelled whole at
    max_restarts or after hpcrl cancel, as after() does."""
    if rc == 0:
        return 0
    status = after_lost_node(os.environ["SLURM_JOB_ID"], rc, restart_count(), only_part=True)
    return rc if status is None else status


def after(rc: int) -> int:
    """What the job does once its driver exited with rc; returns the batch script's exit status:
    0 when training finished, the job requeues (no failure: it goes on) or hpcrl cancel asked;
    else rc, non-zero, so that the job ends FAILED and `hpcrl submit --wait` fails."""
    job = os.environ["SLURM_JOB_ID"]
    if rc == 0:
        return 0
    count = restart_count()
    if rc != EXIT_REQUEUE:
        status = after_lost_node(job, rc, count)
        if status is not None:
            return status
        print(f"[hpcrl] the driver exited with {rc} (its error is above): training did not finish; the job ends "
              "FAILED", flush=True)
        return rc
    env = JobEnv.read()
    if RunDir(env.run_dir).cancel.exists():
        print("[hpcrl] not requeued: hpcrl cancel asked; the run stopped at its last checkpoint (continue it with "
              "hpcrl submit --resume); the job cancels itself", flush=True)
        try:
            slurm_cmd("scancel", job)    # its state says what happened: CANCELLED, as scancel leaves it
        except SlurmCommandError as e:
            print(f"[hpcrl] scancel {job} refused ({e}); the job ends COMPLETED instead", flush=True)
        return 0
    limit = env.max_restarts
    why = ("requeue is off in the spec" if not env.requeue else
           f"restart count {count} has reached max_restarts {limit}" if count >= limit else None)
    if why:
        print(f"[hpcrl] not requeued: {why}; training stopped before its last step, at its last checkpoint: the "
              f"job ends FAILED (exit {rc}); continue it with hpcrl submit --resume", flush=True)
        return rc
    stop = RunDir(env.run_dir).stop
    since = f", {time.time() - stop.stat().st_mtime:.2f} s after Slurm's signal" if stop.exists() else ""
    # said before, not after: Slurm may kill this batch shell as soon as the requeue is accepted
    print(f"[hpcrl] requeueing job {job} after a checkpoint (restart {count + 1} of at most {limit}{since})", flush=True)
    try:
        slurm_cmd("scontrol", "requeue", job)
    except SlurmCommandError as e:
        # a preempted job is requeued by Slurm itself (PreemptMode=REQUEUE); ours then comes too late
        print(f"[hpcrl] scontrol requeue {job} refused ({e}); Slurm requeues a preempted job itself", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["deadline"]:
        print(deadline())
        return 0
    if argv[:1] == ["after"] and len(argv) == 2:
        return after(int(argv[1]))
    if argv[:1] == ["after-submitit"] and len(argv) == 2:
        return after_submitit(int(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
