"""A job spec from YAML: every problem at once, each naming its field, before anything else runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hpcrl.spec.checks import spec_problems
from hpcrl.spec.overrides import OverrideError, apply_overrides, parse_overrides
from hpcrl.spec.models import JobSpec, RoleSpec, SpecError
from hpcrl.ppo.config import PPOConfig, spec_key


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


def _pydantic_problem(err: dict) -> str:
    path = ".".join(spec_key(p) for p in err["loc"]) or "top level"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = err["loc"][:-1]
        model = RoleSpec if len(parent) == 2 and parent[0] == "roles" else JobSpec
        return f"{path}: unknown field (valid fields: {', '.join(model.model_fields)})"
    if kind == "missing":
        return f"{path}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    given = err.get("input")
    if "input" in err and not isinstance(given, dict) and repr(given) not in msg:     # the parsers name it already
        return f"{path}: {msg} (got {given!r})"
    return f"{path}: {msg}"


def parse_spec(data: Any, source: str = "spec", run_dir: str | Path | None = None,
               overrides: list[str] | dict[str, Any] | None = None) -> JobSpec:
    """A validated JobSpec from parsed YAML, or a SpecError listing every problem. `overrides`:
    PATH=VALUE strings (or a dict of them) merged in first (hpcrl/spec/overrides.py)."""
    if not isinstance(data, dict):
        raise SpecError([f"top level: expected a mapping of fields, got {type(data).__name__}"], source)
    problems = []
    if overrides:
        try:
            data = apply_overrides(data, parse_overrides(overrides))
        except OverrideError as e:     # the rest are merged: their values are checked too
            problems, data = [f"override {p}" for p in e.problems], e.merged or data
    if run_dir is not None:
        data = {**data, "run_dir": str(run_dir)}
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems + [_pydantic_problem(err) for err in e.errors()], source) from None
    problems += spec_problems(spec)
    if problems:
        raise SpecError(problems, source)
    spec.run_dir = spec.run_dir.expanduser().resolve()
    spec.train = PPOConfig.resolve_paths(spec.train, Path.cwd())
    spec._source = source
    return spec


def load_spec(path: str | Path, run_dir: str | Path | None = None,
              overrides: list[str] | dict[str, Any] | None = None) -> JobSpec:
    """Read and validate a YAML job spec; `run_dir` replaces the spec's run directory, `overrides`
    (["train.actor_lr=1e-6", ...]) set fields by dotted path."""
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
