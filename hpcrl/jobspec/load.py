"""A job spec from YAML: every problem at once, each naming its field, before anything else runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hpcrl.jobspec.checks import spec_problems
from hpcrl.ppo.config import BUILTIN_ROLES, problem, upgrade_flat_keys
from hpcrl.jobspec.models import JobSpec, SpecError
from hpcrl.jobspec.overrides import OverrideError, apply_overrides, parse_overrides, set_fields


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML silently keeps the last of two equal keys; a duplicated role must be an error."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
            seen[key] = True
        return super().construct_mapping(node, deep)


def parse_spec(data: Any, source: str = "spec", run_dir: str | Path | None = None,
               overrides: list[str] | dict[str, Any] | None = None) -> JobSpec:
    """A validated JobSpec from parsed YAML, or a SpecError listing every problem; then `run_dir`
    and `overrides` (PATH=VALUE strings, or a dict of them) set on it as `configure` does."""
    if not isinstance(data, dict):
        raise SpecError([f"top level: expected a mapping of fields, got {type(data).__name__}"], source)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([problem(err, JobSpec) for err in e.errors()], source) from None
    notes = upgrade_flat_keys(data["train"])[1] if isinstance(data.get("train"), dict) else []
    spec._source, spec._notes = source, notes
    return configure(spec, run_dir, overrides)


def configure(spec: JobSpec, run_dir: str | Path | None = None,
              overrides: list[str] | dict[str, Any] | None = None) -> JobSpec:
    """The typed spec with its run directory replaced and the overrides set (hpcrl/jobspec/overrides.py),
    checked across fields (hpcrl/jobspec/checks.py), and its paths absolute: relative ones are taken
    from the working directory, where hpcrl runs. A SpecError lists every problem."""
    problems, notes, spec = [], [], spec.model_copy(deep=True)
    if run_dir is not None:
        errors: list[dict] = []
        spec = set_fields(spec, {("run_dir",): Path(run_dir)}, errors)
        problems += [problem(err, JobSpec) for err in errors]
    if overrides and not problems:
        try:
            spec, notes = apply_overrides(spec, parse_overrides(overrides))
        except OverrideError as e:
            problems = [f"override {p}" for p in e.problems]
    problems += spec_problems(spec) if not problems else []
    if problems:
        raise SpecError(problems, spec.source)
    spec.run_dir = spec.run_dir.expanduser().resolve()
    spec.train = spec.train.with_paths_from(Path.cwd()) if spec.train else None
    spec._notes = [*spec._notes, *notes, *idle_roles(spec), *spec.exposed_env()]
    return spec


def idle_roles(spec: JobSpec) -> list[str]:
    """Built-in roles the spec places that its training does not run (their nodes would wait idle)."""
    if spec.train is None:
        return []
    runs = spec.train.roles()
    why = {"ref": " (with LoRA the reference is the actor's own base, its adapters off)" if spec.train.reference_in_actor
           else " (no KL term: algorithm.kl_coef is 0, or neither kl_in_reward nor kl_loss)",
           "critic": f" (advantage {spec.train.algorithm.advantage} needs no critic)"}
    return [f"roles.{r}: placed, but this training runs no {r}{why.get(r, '')}; its processes would not start"
            for r, role in spec.roles.items() if r in BUILTIN_ROLES and r not in runs and not role.worker]


def load_spec(path: str | Path, run_dir: str | Path | None = None,
              overrides: list[str] | dict[str, Any] | None = None) -> JobSpec:
    """Read and validate a YAML job spec; `run_dir` replaces the spec's run directory, `overrides`
    (["train.optim.actor_lr=1e-6", ...]) set fields by dotted path."""
    return parse_spec(read_spec_data(path), str(path), run_dir, overrides)


def read_spec_data(path: str | Path) -> Any:
    """The YAML of a spec file, not yet checked; a SpecError when it does not read."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError([f"cannot read the spec: {e.strerror}"], str(path)) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise SpecError([f"not valid YAML: {e}"], str(path)) from None
    return data
