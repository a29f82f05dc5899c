"""`run(spec)`: a spec's training on this machine, one local Ray node carrying every role (`hpcrl run --local`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcrl.jobspec.load import configure, load_spec
from hpcrl.jobspec.models import JobSpec, SpecError
from hpcrl.launch import entrypoint
from hpcrl.run_dir import RunDir
from hpcrl.slurm.sbatch import write_spec


def run(spec: JobSpec | str | Path, *, overrides: list[str] | dict[str, Any] | None = None,
        run_dir: str | Path | None = None, resume: bool = False, num_cpus: int | None = None) -> list[dict]:
    """`hpcrl run --local` from Python: train the spec here and return the metrics records of this start.

    spec: a JobSpec or the path of its YAML file. overrides: fields by dotted path, as for
    hpcrl.submit. run_dir: instead of the spec's (--run-dir). resume: continue the run in it from its
    newest checkpoint (--resume); without it, a run directory that holds a run is refused.
    num_cpus: the CPUs the local Ray may use (default all)."""
    if not isinstance(spec, JobSpec):
        spec = load_spec(spec, run_dir=run_dir, overrides=overrides)
    elif run_dir is not None or overrides:
        spec = configure(spec, run_dir, overrides)
    source = spec.source
    if not spec.train:
        raise SpecError(["train: empty; there is nothing to run (the docs' reference/spec.md lists the settings)"], source)
    paths = RunDir(spec.run_dir)
    if paths.metrics.exists() and not resume:
        raise SpecError([f"run_dir: {paths.root} already holds a run ({paths.metrics.name}); add --resume to continue "
                         "it from its newest checkpoint, or choose a new --run-dir"], source)
    write_spec(paths.root, spec.as_data(), spec.run_dir_access == "group")
    return entrypoint.run(paths.root, local=True, num_cpus=num_cpus)[0]
