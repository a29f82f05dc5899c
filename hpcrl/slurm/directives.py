"""The one place a job's values become lines of its batch script, and what it refuses.

An `#SBATCH` line is read by Slurm, which stops reading directives at the first line that is not
one: a value holding a newline would end the header (the rest of the job silently dropped, the line
after it run by the shell), and whitespace, quotes or `#` change how Slurm splits the line. So
every directive value is checked against what Slurm takes for its option; a value that is not is
refused, naming the spec field it came from, before anything is written or submitted. Everything
else of the job that reaches the script is a shell word, quoted (`shell_word`), or a comment
(`comment`); only the spec's `setup:` lines are shell as written, by design.
"""
from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.slurm.job import Component, HetJob

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
NAMES = re.compile(rf"{NAME.pattern}(,{NAME.pattern})*")
# node features joined by Slurm's operators: & | , * [ ] ( ) and counts (`[ib*2&gpu]`)
FEATURES = re.compile(r"[A-Za-z0-9_.+\-&|,*\[\]()!:]+")
# other options' values (sbatch_extra): Slurm's lists, times, sizes, paths, key=value pairs
PLAIN = re.compile(r"[A-Za-z0-9_.,:=/@%+\-\[\]*&|()!~^]+")
OPTION = re.compile(r"--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"[A-Za-z0-9_./+@~-]+")    # the job's interpreter: one word the shell needs no quotes for

KINDS = {"job-name": (NAME, "letters, digits, '_', '.', '+', '-'"),
         "partition": (NAMES, "partition names, comma-separated"),
         "account": (NAME, "an account name (letters, digits, '_', '.', '+', '-')"),
         "qos": (NAMES, "QoS names, comma-separated"),
         "reservation": (NAMES, "reservation names, comma-separated"),
         "constraint": (FEATURES, "node features and Slurm's operators & | , * [ ] ( ), no spaces")}
# options hpcrl writes from fields of their own: sbatch_extra must not set them again
OWN = {"job-name": "name", "output": "run_dir", "open-mode": None, "requeue": "requeue", "no-requeue": "requeue",
       "signal": "signal_lead", "partition": "partition", "nodes": "nodes", "ntasks-per-node": None,
       "cpus-per-task": "cpus_per_task", "mem": "mem", "gres": "gres or gpus_per_node", "time": "time",
       "account": "account", "qos": "qos", "constraint": "constraint", "exclusive": "exclusive",
       "ntasks": None, "mem-per-cpu": "mem", "gpus": "gpus_per_node", "gpus-per-node": "gpus_per_node", "chdir": None}


class UnsafeValue(ValueError):
    """Values that cannot stand in the batch script; each line names its field and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def control_characters(text: str) -> list[str]:
    """The control characters in text (a newline, a NUL, DEL, ...): none may stand in one line."""
    return sorted({c for c in text if ord(c) < 32 or ord(c) == 127})


def _control(text: str, field: str) -> str | None:
    bad = control_characters(text)
    if not bad:
        return None
    return (f"{field}: {text!r} holds control characters {bad} (a newline ends Slurm's header: what follows "
            "would run as shell); remove them")


def value_problem(option: str, value: str, field: str) -> str | None:
    """Why `--option=value` cannot be written into an #SBATCH line, or None."""
    text = str(value)
    pattern, allowed = KINDS.get(option, (PLAIN, "letters, digits and , : = / @ % + - [ ] * & | ( ) ! ~ ^ "
                                          "(no spaces, quotes, '#', '$', ';' or '\\')"))
    control = _control(text, field)
    if control:
        return control
    if not pattern.fullmatch(text):
        return f"{field}: {text!r} is not a valid --{option} value; use {allowed}"
    return None


def extra_problem(flag: str, field: str) -> str | None:
    """Why a raw sbatch_extra flag ("--reservation=x", "--exclusive") cannot be written, or None."""
    option, eq, value = str(flag).partition("=")
    if not OPTION.fullmatch(option):
        return (f"{field}: {flag!r} is not one long option; write it as --name=value or --name "
                "(one option per list entry)")
    name = option[2:]
    if name in OWN:
        where = f"; set it with the spec's {OWN[name]}" if OWN[name] else "; hpcrl sets it itself"
        return f"{field}: {option} is written by hpcrl{where}"
    return value_problem(name, value, field) if eq else None


def output_path_problem(path: str, field: str) -> str | None:
    """A path in `#SBATCH --output`: no spaces or quotes (Slurm splits the line there), no % (its
    file-name patterns), no '#'."""
    text = str(path)
    bad = sorted(set(text) & set(" \t'\"#%\\"))
    control = _control(text, field)
    if control or not bad:
        return control
    return (f"{field}: {text!r} holds {bad}, which an #SBATCH --output line cannot carry (Slurm splits it at "
            "spaces and quotes, and reads % as a file pattern); choose a run directory without them")


def component_lines(c: Component) -> tuple[list[str], list[str]]:
    """(the component's #SBATCH option texts, the problems that keep them out of a script)."""
    lines, problems = [], []
    for option, value, field in c.options():
        problem = value_problem(option, value, field) if value is not None else None
        problems += [problem] if problem else []
        lines.append(f"--{option}" if value is None else f"--{option}={value}")
    for k, flag in enumerate(c.extra):
        problem = extra_problem(flag, f"{c.source}.sbatch_extra[{k}]")
        problems += [problem] if problem else []
        lines.append(str(flag))
    return lines, problems


def problems(job: HetJob, output: str) -> list[str]:
    """Every value of the job that cannot stand in its script (empty: it renders safely)."""
    found = [p for p in (value_problem("job-name", job.name, "name"), output_path_problem(output, "run_dir")) if p]
    if not COMMAND.fullmatch(job.python):
        found.append(f"python: {job.python!r} is not a plain path to an interpreter (letters, digits, / . _ + @ ~ -); "
                     "the batch script runs it in several places, so give its path without spaces or shell characters")
    for c in job.components:
        found += component_lines(c)[1]
    return found


def shell_word(value) -> str:
    """A value as one shell word, whatever it holds."""
    return shlex.quote(str(value))


def comment(value) -> str:
    """A value inside a comment line: control characters shown, never a line break."""
    return "".join(c if 32 <= ord(c) != 127 else f"\\x{ord(c):02x}" for c in str(value))
