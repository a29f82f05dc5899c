"""Submit a HetJob with `sbatch`, or as a submitit job running a Python function.

Both paths write the same script (`render_hetjob`) into the run directory and return a JobHandle.
submitit cannot write heterogeneous jobs (facebookincubator/submitit#1741); `HetjobExecutor`
subclasses its SlurmExecutor and overrides only the submission text, so pickling, result(),
stdout()/stderr() and Checkpointable requeue stay submitit's. Tested with submitit 1.5.x.
"""
from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any, Callable

import submitit
import yaml
from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from hpcrl.files import atomic_write_text
from hpcrl.run_dir import RunDir
from hpcrl.slurm.cluster_info import SlurmCommandError, parse_records, slurm_cmd
from hpcrl.slurm.job import HetJob
from hpcrl.slurm.render import render_hetjob

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
LIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
        "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


class SubmitError(RuntimeError):
    pass


STUCK_S = 60.0
"""How long a hetjob may stay half-requeued before `wait` gives up on it."""


def half_requeued(states: dict[int, str]) -> bool:
    """Some components pending again, others ended: Slurm never starts such a hetjob (it waits for
    resources of components that will not run again)."""
    return any(s in TERMINAL for s in states.values()) and any(s in ("PENDING", "REQUEUED") for s in states.values())


def component_states(job_id: str) -> dict[int, str]:
    """Component index -> Slurm state. slurmctld first (current), accounting once it forgot the job."""
    try:
        recs = parse_records(slurm_cmd("scontrol", "show", "job", "-o", job_id))
        return {int(r.get("HetJobOffset", 0)): r["JobState"] for r in recs}
    except SlurmCommandError:
        pass
    out = slurm_cmd("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State")
    states = {}
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        base, _, offset = jid.partition("+")
        if base == job_id:
            states[int(offset or 0)] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    if not states:
        raise SubmitError(f"job {job_id} is unknown to slurmctld and to accounting")
    return states


class JobHandle:
    """A submitted hetjob: `job_id` (the leader), `state()` per component, `wait()`, `cancel()`,
    `logs(role)`, and `result()` when it was submitted through submitit."""

    def __init__(self, job_id: str, run_dir: Path, members: dict[str, int], submitit_job=None):
        self.job_id = job_id
        self.run_dir = Path(run_dir)
        self.members = members
        self.submitit_job = submitit_job

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id!r}, run_dir={str(self.run_dir)!r})"

    def state(self) -> dict[int, str]:
        return component_states(self.job_id)

    def role_state(self, role: str) -> str:
        return self.state()[self.members[role]]

    def done(self) -> bool:
        return all(s in TERMINAL for s in self.state().values())

    def wait(self, timeout: float | None = None, poll_s: float = 1.0,
             on_change: Callable[[dict[int, str]], None] | None = None,
             on_poll: Callable[[], None] | None = None) -> dict[int, str]:
        """Block until every component reached a final state; returns the states. on_change gets
        the states when they change, on_poll is called at every poll. A hetjob left half-requeued
        (half_requeued) for STUCK_S raises SubmitError saying so and how to go on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last, stuck_since = None, None
        while True:
            states = self.state()
            stuck_since = (stuck_since or time.monotonic()) if half_requeued(states) else None
            if stuck_since is not None and time.monotonic() - stuck_since >= STUCK_S:
                ended = ", ".join(f"{i} {s}" for i, s in sorted(states.items()) if s in TERMINAL)
                waiting = ", ".join(str(i) for i, s in sorted(states.items()) if s not in TERMINAL)
                raise SubmitError(
                    f"job {self.job_id} is half-requeued: components {ended}, while {waiting} are pending again, "
                    f"for {STUCK_S:.0f} s: Slurm never starts it so. `scontrol requeue {self.job_id}` requeues "
                    f"every component (the run resumes from its last checkpoint); or `scancel {self.job_id}` and "
                    "later hpcrl submit --resume")
            if states != last and on_change is not None:
                on_change(states)
            if on_poll is not None:
                on_poll()
            last = states
            if all(s in TERMINAL for s in states.values()):
                return states
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {states} after {timeout}s")
            time.sleep(poll_s)

    def cancel(self) -> None:
        slurm_cmd("scancel", self.job_id)

    def result(self) -> Any:
        if self.submitit_job is None:
            raise SubmitError("result() needs a job submitted with via='submitit'")
        return self.submitit_job.result()

    def logs(self, role: str | None = None) -> str:
        """The Slurm output of the job, or the logs of one role (every file under logs/<role>/)."""
        paths = RunDir(self.run_dir)
        if role is None:
            files = sorted(paths.logs.glob(paths.slurm_log(self.job_id).name))
        else:
            if role not in self.members:
                raise KeyError(f"no role {role!r} in this job (roles: {', '.join(self.members)})")
            files = sorted(paths.role_logs(role).glob("*.log"))
        return "".join(f.read_text(errors="replace") for f in files)


# ------------------------------------------------------------------ run directory guard
def _recorded_job(run_dir: Path) -> dict | None:
    try:
        return json.loads(RunDir(run_dir).job.read_text())
    except (OSError, ValueError):
        return None


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Never two live jobs in one run directory, never a silent restart over an earlier run."""
    rec = _recorded_job(run_dir)
    if rec is not None:
        try:
            states = component_states(rec["job_id"])
        except (SubmitError, SlurmCommandError):
            states = {}
        if any(s in LIVE for s in states.values()):
            raise SubmitError(f"{run_dir} belongs to job {rec['job_id']}, which is still "
                              f"{sorted(set(states.values()))}: wait for it, `scancel {rec['job_id']}`, "
                              "or choose another --run-dir")
    earlier = rec is not None or RunDir(run_dir).ckpt.exists()
    if earlier and not resume:
        raise SubmitError(f"{run_dir} holds an earlier run (job.json or ckpt/): pass --resume to continue it, "
                          "or choose another --run-dir; nothing there is overwritten")


def make_run_dir(run_dir: Path, group_access: bool = False) -> None:
    """A new run directory is this user's alone (0700), or with group_access its group's too as far
    as the umask lets (0770 less the umask); one that exists keeps its mode."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir(mode=0o770 if group_access else 0o700)
    except FileExistsError:
        pass


def write_spec(run_dir: Path, spec_data: dict | None, group_access: bool = False) -> None:
    """The run directory (make_run_dir) with its logs folder and, given, the spec the job's steps
    read back; a new start of the run is not cancelled by an earlier `hpcrl cancel`."""
    paths = RunDir(run_dir)
    make_run_dir(paths.root, group_access)
    paths.logs.mkdir(exist_ok=True)
    paths.cancel.unlink(missing_ok=True)
    if spec_data is not None:
        atomic_write_text(paths.spec, yaml.safe_dump(spec_data, sort_keys=False))


def secret_values(names: list[str] | tuple[str, ...], environ=None) -> dict[str, str]:
    """The values of the secrets `names` in this environment (hpcrl submit's); SubmitError naming
    each one that is not set, before anything is written."""
    environ = os.environ if environ is None else environ
    missing = [n for n in names if n not in environ]
    if missing:
        raise SubmitError(f"secrets: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set in this "
                          f"environment: export {'it' if len(missing) == 1 else 'them'} before hpcrl submit (the "
                          "values are read here and go to RUN_DIR/secrets.env only), or leave the name out of secrets")
    return {n: environ[n] for n in names}


def write_secrets(job: HetJob, values: dict[str, str]) -> None:
    """RUN_DIR/secrets.env, created 0600 whatever the umask: the `export` lines the batch script
    sources at start (never echoed); a container's steps get them as the host's other variables
    (apptainer also by APPTAINERENV_, which --cleanenv keeps). No secrets: no file."""
    path = RunDir(job.run_dir).secrets
    if not values:
        path.unlink(missing_ok=True)
        return
    apptainer = any(c.container and c.container.runtime == "apptainer" for c in job.components)
    lines = [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    lines += [f"export APPTAINERENV_{k}=\"${k}\"" for k in values] if apptainer else []
    atomic_write_text(path, "\n".join(["# hpcrl secrets: sourced by job.sbatch; keep this file 0600", *lines, ""]),
                      mode=0o600)


def prepare_run_dir(job: HetJob, spec_data: dict | None, script: str, secrets: dict[str, str]) -> Path:
    write_spec(job.run_dir, spec_data, job.group_access)
    write_secrets(job, secrets)
    script_path = RunDir(job.run_dir).script
    atomic_write_text(script_path, script, mode=0o777)    # executable as far as the umask lets
    return script_path


def record_job(job: HetJob, job_id: str, via: str) -> None:
    atomic_write_text(RunDir(job.run_dir).job, json.dumps(
        {"job_id": job_id, "via": via, "name": job.name, "submitted_at": time.time(),
         "members": job.members()}, indent=1))


# ------------------------------------------------------------------ submitit path
class HetjobSubmititWatcher(SlurmInfoWatcher):
    """sacct names hetjob components `<leader>+<offset>`; submitit looks for `<leader>`.
    Component 0 runs the function, so its state is the job's state."""

    def read_info(self, string):
        info = super().read_info(string)
        return {k.removesuffix("+0"): v for k, v in info.items() if "+" not in k or k.endswith("+0")}


class HetjobSubmititJob(SlurmJob):
    watcher = HetjobSubmititWatcher(delay_s=600)

    def stderr(self) -> str | None:
        """The function's stderr or, where the function never ran (the job failed in its batch
        shell, say a Ray node that never joined), the batch script's log, which says why: submitit
        shows it when a job ends without a result."""
        own = super().stderr()
        if own is not None:
            return own
        batch_log = RunDir(self.paths.folder.parent).slurm_log(self.job_id)
        return batch_log.read_text(errors="replace") if batch_log.exists() else None


class HetjobExecutor(submitit.SlurmExecutor):
    """A submitit executor whose jobs are hpcrl hetjobs: the function runs as one task in
    component 0, after every component has recorded its nodes."""

    job_class = HetjobSubmititJob

    def __init__(self, job: HetJob, folder: str | Path | None = None, max_num_timeout: int = 3,
                 dependency: str | None = None):
        super().__init__(folder or RunDir(job.run_dir).submitit, max_num_timeout=max_num_timeout,
                         python=job.python)
        self.hetjob, self.dependency = job, dependency
        # submitit tells a timeout from a preemption by the job's time limit
        t0 = job.components[0].time_min
        if t0 is not None:
            self.parameters["time"] = t0

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        paths = submitit_utils.JobPaths(self.folder)
        # a job of one component is not a hetjob, and srun refuses --het-group there
        het = ["--het-group=0"] if len(self.hetjob.components) > 1 else []
        srun = ["srun", *het, "--nodes=1", "--ntasks=1", "--unbuffered",
                "--output", str(paths.stdout), "--error", str(paths.stderr)]
        payload = "\n".join(["# the submitted Python function (submitit)", "export SUBMITIT_EXECUTOR=slurm",
                             " ".join(shlex.quote(a) for a in srun) + " " + command])
        # submitit's own handler requeues on USR2 delivered to the step (no B:)
        script = render_hetjob(self.hetjob, payload=payload, signal=f"USR2@{self.hetjob.signal_lead_s}")
        prepare_run_dir(self.hetjob, None, script, secret_values(self.hetjob.secrets))
        return script

    def _num_tasks(self) -> int:
        return 1

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        # submitit runs it in this process's environment: `env --unset` keeps the secrets out of sbatch's
        # (as job.sbatch_env does for ours)
        return ["env", *(f"--unset={name}" for name in self.hetjob.secrets), "sbatch",
                *_dependency_args(self.dependency), str(submission_file_path)]


# ------------------------------------------------------------------ entry point
VIAS = ("sbatch", "submitit")


def _dependency_args(dependency: str | None) -> list[str]:
    # on the command line, not in the script: a resubmission of the script does not wait again
    return [f"--dependency={dependency}"] if dependency else []


def submit_hetjob(job: HetJob, via: str = "sbatch", *, resume: bool = False, spec_data: dict | None = None,
                  fn: Callable | None = None, args: tuple = (), dependency: str | None = None) -> JobHandle:
    """Write the run directory and submit (the job's checks are the caller's: hpcrl.jobspec.checks).
    The run directory is refused, untouched, when it holds a live job or, without resume, an earlier run.
    dependency: sbatch's --dependency (afterany:123), which a whole hetjob waits for."""
    if via not in VIAS:
        raise SubmitError(f"via must be 'sbatch' or 'submitit', got {via!r}")
    check_run_dir(job.run_dir, resume)
    secrets = secret_values(job.secrets)
    if via == "submitit":
        from hpcrl.slurm.allocation import read_allocation

        write_spec(job.run_dir, spec_data, job.group_access)
        sjob = HetjobExecutor(job, dependency=dependency).submit(fn or read_allocation, *(args if fn else (str(job.run_dir),)))
        record_job(job, sjob.job_id, via)
        return JobHandle(sjob.job_id, job.run_dir, job.members(), submitit_job=sjob)
    script_path = prepare_run_dir(job, spec_data, render_hetjob(job), secrets)
    try:
        out = slurm_cmd("sbatch", "--parsable", *_dependency_args(dependency), str(script_path),
                        env=job.sbatch_env(os.environ))
    except SlurmCommandError as e:
        raise SubmitError(str(e)) from None
    job_id = out.strip().split(";")[0]
    record_job(job, job_id, via)
    return JobHandle(job_id, job.run_dir, job.members())
