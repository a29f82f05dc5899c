"""Overrides on the command line: `hpcrl submit SPEC train.actor_lr=1e-6 roles.critic.nodes=2`.

Each is a dotted path into the spec and a value read as a YAML scalar (`2` an int, `1e-6` a float,
`true` a bool, `[a, b]` a list, `null` None). They are merged into the spec's data before it is
checked, so an overridden value is checked exactly as one in the file; a path that names no field
is refused with the nearest known ones. The merged spec records them (`overridden:`), which
`hpcrl status` shows.
"""
from __future__ import annotations

import copy
import difflib
import re
from typing import Any

import yaml


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class OverrideError(ValueError):
    """Overrides that cannot be merged: every problem at once, each naming its path; `merged`: the
    spec's data with the others merged (None when they could not be read)."""

    def __init__(self, problems: list[str], merged: dict | None = None):
        self.problems, self.merged = problems, merged
        super().__init__("\n".join(problems))


def parse_overrides(items: list[str] | dict[str, Any]) -> dict[str, Any]:
    """["train.actor_lr=1e-6", ...] (or a dict of path -> value) -> {path: value}."""
    if isinstance(items, dict):
        return dict(items)
    out, problems = {}, []
    for item in items:
        path, eq, text = item.partition("=")
        if not eq or not path.strip():
            problems.append(f"{item!r}: an override is PATH=VALUE, e.g. train.actor_lr=1e-6")
            continue
        try:
            out[path.strip()] = scalar(text)
        except yaml.YAMLError as e:
            problems.append(f"{path}: {text!r} is not a YAML value ({str(e).splitlines()[0]})")
    if problems:
        raise OverrideError(problems)
    return out


ANY = "*"       # in the tree of fields: a key of the spec's own (a role's name)


def scalar(text: str) -> Any:
    """A value as YAML reads it, except that 1e-6 is a number (YAML 1.1 wants 1.0e-6; nobody types that)."""
    if _EXPONENT.fullmatch(text.strip()):
        return float(text)
    return yaml.safe_load(text) if text.strip() else ""


def known_fields() -> dict:
    """The spec's fields as a tree: name -> its fields ({} for a value; None where the keys below
    are the user's own, as in worker_args)."""
    import dataclasses

    from hpcrl.spec.models import JobSpec, MetricsSpec, RoleSpec, WandbSpec
    from hpcrl.ppo.config import PPOConfig

    role = {f: (None if f == "worker_args" else {}) for f in RoleSpec.model_fields}
    train = {f.name: (None if f.name == "processes_per_node" else {}) for f in dataclasses.fields(PPOConfig)}
    metrics = {f: {} for f in MetricsSpec.model_fields} | {"wandb": {f: {} for f in WandbSpec.model_fields}}
    return {f: {} for f in JobSpec.model_fields} | {"roles": {ANY: role}, "train": train, "metrics": metrics}


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """A copy of the spec's data with every override set, and `overridden` recording them."""
    out, problems, tree = copy.deepcopy(data), [], known_fields()
    for path, value in overrides.items():
        parts = path.split(".")
        problem = _path_problem(parts, tree, out)
        if problem:
            problems.append(f"{path}: {problem}")
            continue
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if overrides:
        out["overridden"] = {**out.get("overridden", {}), **overrides}
    if problems:
        raise OverrideError(problems, out)
    return out


def _path_problem(parts: list[str], tree: dict, data: dict) -> str | None:
    """Why the path names no field of the spec, with the nearest known names; or None."""
    node = tree
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth])
        if node is None:             # the user's own keys from here down
            return None
        if not node:
            return f"{here} is a value, not a mapping"
        if ANY in node:
            roles = list(data.get("roles") or {})
            if part not in roles:
                return f"no role {part!r} in the spec{_nearest(part, roles)} (roles: {', '.join(roles)})"
            node = node[ANY]
            continue
        if part not in node:
            return f"{here or 'the spec'} has no field {part!r}{_nearest(part, node)}"
        node = node[part]
    return None


def _nearest(name: str, known) -> str:
    near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(near)}?" if near else ""


def parse_sweep(items: list[str]) -> tuple[dict[str, Any], dict[str, list[tuple[str, Any]]]]:
    """`hpcrl sweep`'s words -> (overrides for every run, axes: path -> [(value as typed, value)]).
    PATH=A,B,C is an axis; a comma inside [..], {..} or quotes belongs to its value, so
    roles.rollout.gres=[gpu:1] stays one value and x=[1,2],[3,4] is an axis of two lists."""
    fixed, axes, problems = {}, {}, []
    for item in items:
        path, eq, text = item.partition("=")
        if not eq or not path.strip():
            problems.append(f"{item!r}: a sweep's override is PATH=VALUE[,VALUE...], e.g. train.actor_lr=1e-6,3e-6")
            continue
        texts = _top_level_split(text)
        try:
            values = [(t, scalar(t)) for t in texts]
        except yaml.YAMLError as e:
            problems.append(f"{path}: {text!r} is not a list of YAML values ({str(e).splitlines()[0]})")
            continue
        if path.strip() in axes or path.strip() in fixed:
            problems.append(f"{path}: given twice; list its values once, comma-separated")
        elif len(values) > 1:
            axes[path.strip()] = values
        else:
            fixed[path.strip()] = values[0][1]
    if problems:
        raise OverrideError(problems)
    return fixed, axes


def _top_level_split(text: str) -> list[str]:
    parts, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts + [text[start:]]]
