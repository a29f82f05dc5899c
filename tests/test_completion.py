"""Shell completion (hpcrl/completion.py): the candidates from the real parser, and the bash
function run as bash runs it, with COMP_WORDS split at `=` the way bash splits them."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpcrl.cli import build_parser
from hpcrl.completion import candidates, complete_main, shell_script

ROOT = Path(__file__).resolve().parents[1]
SPEC = "jobs/tiny-cpu.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)         # the spec on the line is relative, as a user types it


def cands(line: str) -> list[str]:
    """`line` as typed after `hpcrl`, its last word (after the last space) the one being completed."""
    *words, current = line.split(" ")
    return candidates(build_parser(), words, current)


def test_subcommands_and_nested():
    top = cands("")
    assert {"validate", "render", "submit", "run", "status", "ckpt", "data", "completion"} <= set(top)
    assert "__complete" not in top
    assert set(cands("data ")) >= {"reasoning-gym", "mathqa", "smollm2"}
    assert "--train" in cands("data reasoning-gym --")


def test_options_and_choices():
    assert {"--via", "--wait", "--resume", "--run-dir"} <= set(cands("submit --"))
    assert cands("submit --via ") == ["sbatch", "submitit"]
    assert cands(f"submit {SPEC} --via ") == ["sbatch", "submitit"]
    assert cands("submit --via=") == ["--via=sbatch", "--via=submitit"]
    assert cands("ckpt ") == ["ls", "verify", "upgrade"]
    assert cands("completion ") == ["bash", "zsh"]
    assert cands("export runs/x out --dtype ") == ["auto", "bf16", "fp32"]


def test_file_arguments_are_left_to_the_shell():
    assert cands("submit ") == []               # the spec file
    assert cands("submit jo") == []
    assert cands("ckpt ls ") == []              # the run directory
    assert cands("submit --run-dir ") == []


def test_override_paths():
    assert cands(f"submit {SPEC} tr") == ["train."]
    assert cands(f"submit {SPEC} train.o") == ["train.optim."]
    assert cands(f"submit {SPEC} train.optim.actor_") == ["train.optim.actor_lr="]
    assert cands(f"submit {SPEC} train.seed=1 train.optim.critic_l") == ["train.optim.critic_lr="]
    assert cands(f"validate {SPEC} roles.critic.par") == ["roles.critic.partition="]
    assert "metrics.wandb." in cands(f"render {SPEC} metrics.")
    assert cands(f"submit {SPEC} train.seed=") == []    # a value: nothing to offer
    assert cands(f"submit {SPEC} train.seed.x") == []   # below a value: nothing


def test_role_names_come_from_the_spec_file():
    roles = yaml.safe_load((ROOT / SPEC).read_text())["roles"]
    assert sorted(cands(f"submit {SPEC} roles.")) == sorted(f"roles.{r}." for r in roles)
    assert cands("submit no/such.yaml roles.") == []


def test_a_new_subcommand_completes_without_a_change(tmp_path):
    p = argparse.ArgumentParser(prog="hpcrl")
    sub = p.add_subparsers(dest="command")
    c = sub.add_parser("sweep")
    c.add_argument("spec")
    c.add_argument("overrides", nargs="*")
    c.add_argument("--max-running", type=int)
    c.add_argument("--mode", choices=["grid", "zip"])
    spec = tmp_path / "s.yaml"
    spec.write_text("roles: {gen: {}, judge: {}}\n")
    assert candidates(p, [], "sw") == ["sweep"]
    assert candidates(p, ["sweep"], "--m") == ["--max-running", "--mode"]
    assert candidates(p, ["sweep", "--max-running", "4", "--mode"], "") == ["grid", "zip"]
    assert candidates(p, ["sweep", str(spec)], "roles.j") == ["roles.judge."]


def test_complete_main_prints_the_part_bash_replaces(capsys):
    assert complete_main(build_parser(), ["4", "hpcrl", "submit", "--via", "=", "sub"]) == 0
    assert capsys.readouterr().out == "submitit\n"      # bash replaces only `sub`, after the `=`


def bash_complete(*lines: list[str]) -> list[list[str]]:
    """The bash function of `hpcrl completion bash`, called as bash calls it for each line, given as
    the words bash split it into (COMP_WORDBREAKS splits at `=`), the cursor at the end of the last;
    COMPREPLY of each. One bash for all: each hpcrl start costs a few tenths of a second."""
    bin_dir = Path(sys.executable).parent
    script = f'eval "$({bin_dir / "hpcrl"} completion bash)"\n'
    for words in lines:
        line = "".join(w if w == "=" or i == 0 or words[i - 1] == "=" else " " + w for i, w in enumerate(words))
        quoted = " ".join("'" + w + "'" for w in words)
        script += (f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; COMP_LINE='{line}'; COMP_POINT={len(line)}\n"
                   'COMPREPLY=(); _hpcrl hpcrl "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
                   'echo "${COMPREPLY[*]}"\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line.split() for line in out.stdout.splitlines()]


def test_bash_function():
    assert bash_complete(["hpcrl", "ckpt", "v"],
                         ["hpcrl", "submit", SPEC, "train.optim.actor_l"],
                         ["hpcrl", "submit", SPEC, "roles.critic.par"]) \
        == [["verify"], ["train.optim.actor_lr="], ["roles.critic.partition="]]


def test_bash_words_split_at_equals():
    assert bash_complete(
        # `hpcrl submit --via=` reaches the function as ... `--via` `=`; bash replaces the text after `=`
        ["hpcrl", "submit", "--via", "="],
        ["hpcrl", "submit", "--via", "=", "subm"],
        # an earlier override `train.seed=1` is three words to bash, not three arguments
        ["hpcrl", "submit", SPEC, "train.seed", "=", "1", "train.optim.actor_l"],
        ["hpcrl", "submit", SPEC, "train.seed", "="],
    ) == [["sbatch", "submitit"], ["submitit"], ["train.optim.actor_lr="], []]


def test_shell_scripts():
    assert "complete -o default -F _hpcrl hpcrl" in shell_script("bash")
    assert "compdef _hpcrl hpcrl" in shell_script("zsh")
    with pytest.raises(ValueError):
        shell_script("fish")
