"""The docs site (docs/mkdocs.yml, docs/pages/) and the README: the site builds strictly, every
```bash and ```python block is run, is the file it shows, or names only files and commands that exist
(the convention: docs/pages/contributing.md, "The docs"), every relative link resolves, and the
README stays short."""
import argparse
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

import hpcrl
from hpcrl.cli import build_parser

README = ROOT / "README.md"
PAGES = ROOT / "docs" / "pages"
MARKDOWN = [README, *sorted(PAGES.rglob("*.md"))]
README_LIMIT = 10_240       # bytes: the README is the front door; the rest is the site's

# Material for MkDocs prints its end-of-life notice on every build; it says nothing of this site
QUIET = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}

FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
MARKER = re.compile(r"<!-- (run|excerpt of (?P<path>\S+)) -->")
# files a block names: the checkout's own folders (a run directory or /shared/... is the reader's)
NAMED_PATH = re.compile(r"(?<![\w./$-])((?:jobs|bench|tests|\.ci|slurm|templates|docs)/[\w./-]*\w)")
# `hpcrl CMD` as a shell runs it: `hpcrl`, `.venv/bin/hpcrl`, `python -m hpcrl`, `$(hpcrl ...)`
COMMAND = re.compile(r"(?:^|[\s/(])hpcrl[ \t]+(?P<rest>[^&|;>\n]*)")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str
    how: str | None         # "run", "excerpt", or None: named files and commands are checked
    shows: Path | None      # the file an excerpt is of

    def __str__(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().splitlines()
        marker = MARKER.fullmatch(before[-1].strip()) if before else None
        how = None if marker is None else "excerpt" if marker["path"] else "run"
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, m["lang"], textwrap.dedent(m["body"]), how,
                           ROOT / marker["path"] if marker and marker["path"] else None))
    return found


BLOCKS = [b for page in MARKDOWN for b in blocks(page)]
CHECKED = [b for b in BLOCKS if b.lang in ("bash", "python")]


def test_the_site_builds_strictly(tmp_path):
    """mkdocs is a dependency of CI (the docs extra): missing, the test fails rather than skips."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml",
                           "-d", str(tmp_path / "site")], cwd=ROOT, env=QUIET, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_the_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move the detail into docs/pages/"


def test_every_block_says_what_it_is():
    """A fence names its language (bash/python are run or checked, the rest shown); a marker goes only on
    bash/python blocks, and an excerpt names a file that exists."""
    assert CHECKED, "no bash or python block found: is FENCE still right?"
    unnamed = [str(b) for b in BLOCKS if not b.lang]
    assert not unnamed, f"fences without a language (```bash, ```python, ```console, ```text, ```yaml): {unnamed}"
    misplaced = [str(b) for b in BLOCKS if b.how and b.lang not in ("bash", "python")]
    assert not misplaced, f"<!-- run --> or <!-- excerpt of ... --> on a block that is not bash or python: {misplaced}"
    missing = [f"{b}: {b.shows}" for b in CHECKED if b.shows and not b.shows.is_file()]
    assert not missing, missing


@pytest.mark.parametrize("block", [b for b in CHECKED if b.how == "run"], ids=str)
def test_runnable_blocks_run(block, tmp_path):
    """From a scratch folder that has the checkout's jobs/ (what a reader who ran `hpcrl init NAME` has at
    hand), with the venv's hpcrl first on PATH: nothing the block writes lands in the checkout."""
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    env = {**QUIET, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = ["bash", "-euo", "pipefail", "-c", block.body] if block.lang == "bash" else [sys.executable, "-c", block.body]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{block}:\n{block.body}\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("block", [b for b in CHECKED if b.how == "excerpt"], ids=str)
def test_excerpts_are_lines_of_the_file_they_show(block):
    """Every line but `...` ones is a line of the file, trailing comments aside (the page may say it shorter)."""
    def code(line):
        return line.split("  #")[0].strip()

    lines = {code(line) for line in block.shows.read_text().splitlines()}
    shown = [code(line) for line in block.body.splitlines() if line.strip() and "..." not in line]
    assert len(shown) > 5, f"{block}: an excerpt of {len(shown)} lines"
    stray = [line for line in shown if line not in lines]
    assert not stray, f"{block}: not in {block.shows.relative_to(ROOT)}: {stray}"


def _commands() -> dict[str, argparse.ArgumentParser]:
    """hpcrl's subcommands by name, nested ones (`hpcrl data smollm2`) as 'data smollm2', and `hpcrl`
    itself (`hpcrl --help`) as ''."""
    def subparsers(parser):
        return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})

    top = build_parser()
    out = {"": top}
    for name, parser in subparsers(top).items():
        out[name] = parser
        out.update({f"{name} {sub}": p for sub, p in subparsers(parser).items()})
    return out


def _command_problems(line: str, commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Each `hpcrl ...` of a shell line (its comment aside) is a command of the CLI with its options."""
    problems = []
    for m in COMMAND.finditer(re.sub(r"(^|\s)#.*", "", line)):
        words = m["rest"].split()
        if not words:
            continue      # `pip install hpcrl`
        nested = " ".join(words[:2])
        name = "" if words[0].startswith("-") else nested if nested in commands else words[0]
        if name not in commands:
            problems.append(f"hpcrl {words[0]}: no such command")
            continue
        options = commands[name]._option_string_actions
        problems += [f"{' '.join(filter(None, ('hpcrl', name, w)))}: no such option" for w in words
                     if w.startswith("-") and w.split("=")[0] not in options]
    return problems


def _problems(block: Block, commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    problems = [f"{path}: no such file or folder" for path in NAMED_PATH.findall(block.body)
                if not (ROOT / path).exists()]
    if block.lang == "bash":
        return problems + [p for line in block.body.splitlines() for p in _command_problems(line, commands)]
    try:
        compile(block.body, str(block), "exec")
    except SyntaxError as e:
        problems.append(f"does not compile: {e}")
    return problems + [f"hpcrl.{name}: hpcrl has no such name" for name in re.findall(r"\bhpcrl\.(\w+)", block.body)
                       if name not in hpcrl.__all__]


def test_the_other_blocks_name_only_what_exists():
    """Blocks that need a cluster or a long run (the suite runs those elsewhere) still name real files,
    real `hpcrl` commands and options, and, in Python, names hpcrl has."""
    commands = _commands()
    problems = [f"{b}: {p}" for b in CHECKED if b.how != "excerpt" for p in _problems(b, commands)]
    assert not problems, "\n".join(problems)


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def test_every_relative_link_resolves():
    """Links and images in the README and the pages, code aside; the site's build checks anchors too."""
    broken = []
    for page in MARKDOWN:
        prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
        for target in LINK.findall(prose):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
