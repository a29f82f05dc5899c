"""Overrides on the command line: `hpcrl submit SPEC train.optim.actor_lr=1e-6 roles.critic.nodes=2`.

Each is a dotted path into the spec and a value read as a YAML scalar (`2` an int, `1e-6` a float,
`true` a bool, `[a, b]` a list, `null` None). They are set on the typed spec, each checked by its
field's type exactly as a value from the file is, and then the checks that span fields run again; a
path that names no field is refused with the nearest known ones. The spec records them
(`overridden:`), which `hpcrl status` shows.
"""
from __future__ import annotations

import difflib
import re
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hpcrl.ppo.config import FLAT_KEYS, model_in, problem as config_problem
from hpcrl.jobspec.models import JobSpec


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class OverrideError(ValueError):
    """Overrides that cannot be set: every problem at once, each naming its path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def parse_overrides(items: list[str] | dict[str, Any]) -> dict[str, Any]:
    """["train.optim.actor_lr=1e-6", ...] (or a dict of path -> value) -> {path: value}."""
    if isinstance(items, dict):
        return dict(items)
    out, problems = {}, []
    for item in items:
        path, eq, text = item.partition("=")
        if not eq or not path.strip():
            problems.append(f"{item!r}: an override is PATH=VALUE, e.g. train.optim.actor_lr=1e-6")
            continue
        try:
            out[path.strip()] = scalar(text)
        except yaml.YAMLError as e:
            problems.append(f"{path}: {text!r} is not a YAML value ({str(e).splitlines()[0]})")
    if problems:
        raise OverrideError(problems)
    return out


def scalar(text: str) -> Any:
    """A value as YAML reads it, except that 1e-6 is a number (YAML 1.1 wants 1.0e-6; nobody types that)."""
    if _EXPONENT.fullmatch(text.strip()):
        return float(text)
    return yaml.safe_load(text) if text.strip() else ""


ANY = "*"       # in the tree of fields: a key of the spec's own (a role's name)


def known_fields(model: type[BaseModel] = JobSpec) -> dict:
    """The spec's fields as a tree: name -> its fields ({} for a value; None where the keys below
    are the user's own, as in worker_args; {ANY: fields} for a model per name, as in roles)."""
    tree = {}
    for name, info in model.model_fields.items():
        inner = model_in(info.annotation)
        if _is_mapping(info.annotation):
            tree[name] = {ANY: known_fields(inner)} if inner else None
        else:
            tree[name] = known_fields(inner) if inner else {}
    return tree


def apply_overrides(spec: JobSpec, overrides: dict[str, Any]) -> tuple[JobSpec, list[str]]:
    """A copy of the typed spec with the overrides set, each model on their paths built once with
    all of its changes and checked as one from a file is, and `overridden` recording them; and a note
    per flat training key (`train.actor_lr` sets train.optim.actor_lr). An OverrideError lists every
    path that names no field and every value its field refuses."""
    changes, problems, notes, tree = {}, [], [], known_fields()
    for path, value in overrides.items():
        parts = path.split(".")
        if len(parts) == 2 and parts[0] == "train" and parts[1] in FLAT_KEYS:
            parts = ["train", *FLAT_KEYS[parts[1]].split(".")]
            notes.append(f"{path}: now {'.'.join(parts)} (the flat key is read until hpcrl 0.3)")
        problem = _path_problem(parts, spec, tree)
        if problem:
            problems.append(f"{path}: {problem}")
        else:
            changes[tuple(parts)] = value
    errors: list[dict] = []
    out = set_fields(spec, {**changes, ("overridden",): {**spec.overridden, **overrides}}, errors)
    problems += [config_problem(err, JobSpec) for err in errors]
    if problems:
        raise OverrideError(problems)
    return out, notes


def set_fields(model: BaseModel, changes: dict[tuple, Any], errors: list[dict], where: tuple = ()) -> BaseModel:
    """A copy of `model` with each value of `changes` at its path (field names, then dict keys): the
    models on the paths are built again from their fields, each once with all of its changes, so
    each checks them together as it checks a file's. What a model refuses is added to `errors`
    (pydantic's, located from the outermost model), and that model is left as it was."""
    fields = {k: getattr(model, k) for k in model.model_fields_set}
    for name, below in _by_first(changes).items():
        value = below.pop((), fields.get(name, getattr(model, name)))
        fields[name] = _set_below(value, below, errors, (*where, name)) if below else value
    try:
        built = type(model).model_validate(fields)
    except ValidationError as e:
        errors += [{**err, "loc": (*where, *err["loc"])} for err in e.errors()]
        return model
    for attr, value in (model.__pydantic_private__ or {}).items():
        setattr(built, attr, value)
    return built


def _set_below(value: Any, changes: dict[tuple, Any], errors: list[dict], where: tuple) -> Any:
    """`changes` set inside a field's value: a model (a section), or a mapping (roles, worker_args)."""
    if isinstance(value, BaseModel):
        return set_fields(value, changes, errors, where)
    out = dict(value) if isinstance(value, dict) else {}
    for key, below in _by_first(changes).items():
        inner = below.pop((), out.get(key))
        out[key] = _set_below(inner, below, errors, (*where, key)) if below else inner
    return out


def _by_first(changes: dict[tuple, Any]) -> dict[str, dict[tuple, Any]]:
    groups: dict[str, dict[tuple, Any]] = {}
    for path, value in changes.items():
        groups.setdefault(path[0], {})[path[1:]] = value
    return groups


def _path_problem(parts: list[str], spec: JobSpec, tree: dict) -> str | None:
    """Why the path names no field of the spec (`tree`: known_fields()), with the nearest known
    names; or None."""
    node, value = tree, spec
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth])
        if node is None:             # the user's own keys from here down
            return None
        if not node:
            return f"{here} is a value, not a mapping"
        if ANY in node:              # a model per name (roles): the names the spec gives
            names = list(value or {})
            if part not in names:
                kind = parts[depth - 1]
                return f"no {kind.removesuffix('s')} {part!r} in the spec{_nearest(part, names)} ({kind}: {', '.join(names)})"
            node, value = node[ANY], value[part]
            continue
        if part not in node:
            near = _nearest(part, node)
            if here == "train" and not near:      # a flat key mistyped: offer its section's field
                near = _nearest(part, FLAT_KEYS, {flat: f"train.{path}" for flat, path in FLAT_KEYS.items()})
            return f"{here or 'the spec'} has no field {part!r}{near}"
        node, value = node[part], getattr(value, part, None)
    return None


def _is_mapping(annotation) -> bool:
    return typing.get_origin(annotation) is dict


def _nearest(name: str, known, shown: dict[str, str] | None = None) -> str:
    near = [(shown or {}).get(k, k) for k in difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)]
    return f"; did you mean {' or '.join(near)}?" if near else ""


def parse_sweep(items: list[str]) -> tuple[dict[str, Any], dict[str, list[tuple[str, Any]]]]:
    """`hpcrl sweep`'s words -> (overrides for every run, axes: path -> [(value as typed, value)]).
    PATH=A,B,C is an axis; a comma inside [..], {..} or quotes belongs to its value, so
    roles.rollout.gres=[gpu:1] stays one value and x=[1,2],[3,4] is an axis of two lists."""
    fixed, axes, problems = {}, {}, []
    for item in items:
        path, eq, text = item.partition("=")
        if not eq or not path.strip():
            problems.append(f"{item!r}: a sweep's override is PATH=VALUE[,VALUE...], e.g. train.optim.actor_lr=1e-6,3e-6")
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
