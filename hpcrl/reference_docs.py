"""The reference pages of the docs site, generated from the code so that nothing is written twice:

    spec.md      every field of a job spec: the pydantic models (JobSpec, and every model a field
                 holds, at its path), with type, default, allowed values and the field's docstring
    cli.md       every command and option of `hpcrl`: its argparse parser
    metrics.md   every metric of the built-in loop: hpcrl/ppo/step_metrics.py
    events.md    every event of RUN_DIR/events.jsonl: hpcrl/observe/event_kinds.py

    python -m hpcrl.reference_docs            write them to docs/pages/reference/
    python -m hpcrl.reference_docs --check    exit 1, naming the pages that differ from what the code gives now

It sits in hpcrl so that `python -m` finds it in the checkout's environment and the tests import it
plainly; nothing that runs a job imports it. tests/test_reference_docs.py fails on a stale page.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hpcrl.cli import build_parser
from hpcrl.observe.event_kinds import EVENTS, EVERY_EVENT
from hpcrl.ppo.config import FLAT_KEYS
from hpcrl.ppo.step_metrics import METRICS
from hpcrl.jobspec.models import JobSpec

PAGES = Path(__file__).resolve().parents[1] / "docs" / "pages" / "reference"
REGENERATE = "python -m hpcrl.reference_docs"
NOTICE = f"<!-- generated from the code by `{REGENERATE}`: edit the code, not this page -->\n"


# --- Markdown

def prose(text: str) -> str:
    """Text as Markdown shows it, on one line: code spans kept, and outside them whatever Markdown
    would read as markup (emphasis, HTML tags, a table's cell border) escaped."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(part if part.startswith("`") else re.sub(r"([\\*_|])", r"\\\1", part).replace("<", "&lt;")
                   for part in parts)


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


# --- spec.md: the models

@dataclasses.dataclass
class Section:
    """One model at its path in the spec: a heading, the model's docstring, a row per field."""
    path: str
    doc: str
    rows: list[list[str]]


def attribute_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, the string literal below it in the class body (read from the source:
    pydantic keeps them only with use_attribute_docstrings, a dataclass never)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):          # a subclass's docstring wins over its base's
        if klass.__module__ == "builtins" or klass.__module__.startswith("pydantic"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):            # defined where no source is (a REPL): its docs are not there
            continue
        body = ast.parse(textwrap.dedent(source)).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                    isinstance(after.value.value, str):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _bare(annotation):
    """The type without Annotated's metadata."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _arms(annotation) -> list:
    """The alternatives of a union (X | Y, Optional[X]); a single type is its own."""
    annotation = _bare(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [_bare(a) for a in typing.get_args(annotation)]
    return [annotation]


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_text(annotation) -> str:
    """A type as a reader of the spec writes it: `int`, `list[str]`, `RoleSpec | "host" | None`."""
    annotation = _bare(annotation)
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "Any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    return "path" if annotation is Path else annotation.__name__


def nested(name: str, annotation) -> tuple[type[BaseModel], str] | None:
    """The model a field holds (in a union, its model arm), and where its fields hang below the
    field: the model itself right there (`train` -> `train.seed`), a mapping's values under a key
    (`roles` -> `roles.<role>.nodes`), a list's items under an index (`scorers` -> `scorers[i].role`)."""
    for arm in _arms(annotation):
        origin, args = typing.get_origin(arm), typing.get_args(arm)
        if _is_model(arm):
            return arm, ""
        if origin is dict and _is_model(_bare(args[1])):
            return _bare(args[1]), f".<{name.removesuffix('s')}>"
        if origin is list and _is_model(_bare(args[0])):
            return _bare(args[0]), "[i]"
    return None


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}


def _choices(annotation) -> list | None:
    """The values a field of a few values may take (None among them when it is optional), or None
    for a field of any other type."""
    arms = _arms(annotation)
    if not all(typing.get_origin(a) is typing.Literal or a is type(None) for a in arms):
        return None
    return [v for a in arms for v in (typing.get_args(a) if a is not type(None) else [None])]


def type_cell(info: FieldInfo) -> str:
    """The field's type; a field of a few values shows their type (`str`), the values go to Values."""
    choices = _choices(info.annotation)
    if choices is None:
        return code(type_text(info.annotation))
    return code(" | ".join(dict.fromkeys(type_text(type(v)) for v in choices)))


def allowed(info: FieldInfo) -> str:
    """The field's bounds (`≥ 1`), or its values when it takes one of a few."""
    bounds = [f"{sign} {getattr(m, name)}" for m in info.metadata for name, sign in _BOUNDS.items()
              if getattr(m, name, None) is not None]
    choices = [v for v in _choices(info.annotation) or [] if v is not None]
    return prose(", ".join(bounds + (["one of " + ", ".join(code(str(v)) for v in choices)] if choices else [])))


def default_cell(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    return "the defaults below" if isinstance(value, BaseModel) else code(json.dumps(value, default=str))


def model_sections(model: type[BaseModel], path: str = "") -> list[Section]:
    """The model's fields at `path`, then, depth first, every model a field holds at the field's path."""
    docs, rows, below = attribute_docs(model), [], []
    for name, info in model.model_fields.items():
        where = f"{path}.{name}" if path else name
        rows.append([code(where), type_cell(info), default_cell(info), allowed(info),
                     prose(info.description or docs.get(name, ""))])
        inner = nested(name, info.annotation)
        if inner:
            below += model_sections(inner[0], where + inner[1])
    doc = vars(model).get("__doc__") or ""
    return [Section(path, f"{model.__name__}: {inspect.cleandoc(doc)}" if doc else model.__name__, rows), *below]


def spec_page() -> str:
    sections = model_sections(JobSpec)
    out = [NOTICE, "# Job spec\n",
           "Every field of a job spec (the YAML file `hpcrl submit` reads), at its path: `roles.<role>.partition` "
           "is the `partition` of each role under `roles`, `[i]` an item of a list. A field given on the command "
           "line (`hpcrl submit job.yaml train.seed=2`) takes the same path.\n"]
    for s in sections:
        out += [f"## {code(s.path) if s.path else 'Top level'}\n", prose(s.doc) + "\n",
                table(["Field", "Type", "Default", "Values", "Description"], s.rows)]
    out += ["## The flat training keys of earlier releases\n",
            "Read until hpcrl 0.3, each moved to its section with a note (`hpcrl validate` prints it); a setting "
            "given both ways is refused.\n",
            table(["Flat key", "Now"], [[code(f"train.{flat}"), code(f"train.{path}")] for flat, path in FLAT_KEYS.items()])]
    return "\n".join(out)


# --- cli.md: the argparse parser

def _value(action: argparse.Action) -> str:
    """What an argument takes, as a usage line writes it: `RUN_DIR`, `[PATH=VALUE ...]`."""
    choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else None
    name = action.metavar or choices or (action.dest.upper() if action.option_strings else action.dest)
    return {0: "", "?": f"[{name}]", "*": f"[{name} ...]", "+": f"{name} [{name} ...]"}.get(action.nargs, name)


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments, without -h (every command has it) and the choice of subcommand."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def usage(prog: str, parser: argparse.ArgumentParser) -> str:
    """The command's usage on one line. Not argparse's own: that wraps at the terminal's width and
    changes between Python versions, and the page must come out the same everywhere."""
    words = [prog]
    for a in _arguments(parser):
        if a.option_strings:
            option = " ".join(filter(None, [a.option_strings[0], _value(a)]))
            words.append(option if a.required else f"[{option}]")
        else:
            words.append(_value(a))
    sub = _subcommands(parser)
    return " ".join(words + ([f"{sub.dest.upper()} ..."] if sub else []))


def commands(parser: argparse.ArgumentParser, prog: str, help_: str = ""):
    """(the command as typed, its parser, its one-line help) for the parser and, depth first, every
    subcommand under it."""
    yield prog, parser, help_
    sub = _subcommands(parser)
    if sub:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        for name, child in sub.choices.items():
            yield from commands(child, f"{prog} {name}", helps.get(name, ""))


def command_section(prog: str, parser: argparse.ArgumentParser, help_: str) -> str:
    out = [f"## {code(prog)}\n"]
    out += [prose(text) + "\n" for text in dict.fromkeys(filter(None, [parser.description, help_]))]
    out.append(f"```text\n{usage(prog, parser)}\n```\n")
    sub = _subcommands(parser)
    if sub:
        out.append(table(["Command", "What it does"], [[code(f"{prog} {a.dest}"), prose(a.help or "")]
                                                       for a in sub._choices_actions]))
    rows = []
    for a in _arguments(parser):
        rows.append([code(" ".join(filter(None, [", ".join(a.option_strings), _value(a)])) if a.option_strings
                          else _value(a)),
                     prose((a.help or "") % {**vars(a), "prog": prog}),
                     "" if a.default in (None, False, argparse.SUPPRESS) else code(str(a.default)),
                     ", ".join(code(str(c)) for c in a.choices or [])])
    if rows:
        out.append(table(["Argument", "Description", "Default", "Choices"], rows))
    if parser.epilog:
        out.append(f"```text\n{parser.epilog.strip()}\n```\n")
    return "\n".join(out)


def cli_page() -> str:
    out = [NOTICE, "# Command line\n",
           "Every command of `hpcrl`, its arguments and options; each also takes `-h` / `--help`.\n"]
    out += [command_section(prog, parser, help_) for prog, parser, help_ in commands(build_parser(), "hpcrl")]
    return "\n".join(out)


# --- metrics.md and events.md: the registries

def metrics_page() -> str:
    return "\n".join([
        NOTICE, "# Metrics\n",
        "What the built-in training loop logs: one JSON object per step in `RUN_DIR/metrics.jsonl`, and the same "
        "numbers in TensorBoard and Weights & Biases when the spec's `metrics:` asks for them. A key in angle "
        "brackets stands for one key per role or data source. A value is null in a step where it does not apply "
        "(the critic's under GRPO); a key that appears only in some steps says so. A loop of your own (`driver:`) "
        "logs what it logs.\n",
        table(["Metric", "Unit", "Meaning"], [[code(name), prose(m.unit), prose(m.meaning)]
                                              for name, m in METRICS.items()])])


def events_page() -> str:
    out = [NOTICE, "# Events\n",
           "What happened to a run, in order: `RUN_DIR/events.jsonl`, one JSON object per line, appended as it "
           "happens (`hpcrl status` and `hpcrl report` read it). Every event has these fields:\n",
           table(["Field", "Meaning"], [[code(k), prose(v)] for k, v in EVERY_EVENT.items()])]
    for kind, e in EVENTS.items():
        out += [f"## {code(kind)}\n", prose(e.meaning) + "\n",
                table(["Field", "Meaning"], [[code(k), prose(v)] for k, v in e.fields.items()])]
    return "\n".join(out)


# --- writing and checking

def pages() -> dict[str, str]:
    """File name -> what it holds, as the code gives it now."""
    return {"spec.md": spec_page(), "cli.md": cli_page(), "metrics.md": metrics_page(), "events.md": events_page()}


def stale(folder: Path = PAGES) -> list[str]:
    """The pages in `folder` that are missing or differ from what the code gives now."""
    return [name for name, text in pages().items() if _differs(folder / name, text)]


def write(folder: Path = PAGES) -> list[str]:
    """Write every page that changed; their names."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = [(name, text) for name, text in pages().items() if _differs(folder / name, text)]
    for name, text in changed:
        (folder / name).write_text(text)
    return [name for name, _ in changed]


def _differs(path: Path, text: str) -> bool:
    return not path.exists() or path.read_text() != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=REGENERATE, description="Generate the docs' reference pages from the code.")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    ap.add_argument("--out", type=Path, default=PAGES, help=f"the pages' folder (default {PAGES})")
    args = ap.parse_args(argv)
    if args.check:
        names = stale(args.out)
        if names:
            print(f"out of date in {args.out}: {', '.join(names)}; run {REGENERATE} to regenerate", file=sys.stderr)
        return 1 if names else 0
    for name in write(args.out):
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
