"""Shell completion for `hpcrl`: subcommands, options, option and positional choices, and the dotted
spec paths of overrides (`hpcrl submit job.yaml train.optim.actor_<TAB>` -> `train.optim.actor_lr=`), with the
role names read from the spec file on the line. Everything else (spec files, run directories)
falls back to the shell's file name completion.

Enable it with one line in ~/.bashrc (or ~/.zshrc, with `zsh` instead of `bash`):

    eval "$(hpcrl completion bash)"

The shell function calls `hpcrl __complete CWORD WORD0 WORD1 ...` (bash's COMP_CWORD and
COMP_WORDS, WORD0 being `hpcrl`), which prints one candidate per line. Everything is read from
the argparse parser, so a new subcommand or option completes without a change here.
"""
from __future__ import annotations

import argparse
import os

from hpcrl.jobspec.overrides import ANY, known_fields

BREAKS = "=:"       # in bash's COMP_WORDBREAKS: `train.seed=1` reaches us as `train.seed`, `=`, `1`


def _is_break(word: str) -> bool:
    return word != "" and word.strip(BREAKS) == ""


def rejoin(words: list[str], cword: int) -> tuple[list[str], str]:
    """The words up to the cursor as the user typed them (bash's split at `=` and `:` undone), and
    the part of the current word that bash replaces (the text after its last `=` or `:`)."""
    words = (words + [""] * (cword + 1 - len(words)))[:cword + 1]
    out: list[str] = []
    glue = False
    for word in words:
        if out and (_is_break(word) or (glue and word)):    # an empty word after `=` came from a space
            out[-1] += word
        else:
            out.append(word)
        glue = _is_break(word)
    tail = "" if _is_break(words[-1]) else words[-1]
    return out, tail


def candidates(parser: argparse.ArgumentParser, words: list[str], current: str) -> list[str]:
    """What may follow `hpcrl WORDS...` as the word being typed, `current`, as whole words that
    start with it; [] leaves it to the shell's file names. `words`: without `hpcrl` and `current`."""
    return [c for c in _candidates(parser, words, current) if c.startswith(current)]


def _candidates(parser: argparse.ArgumentParser, words: list[str], current: str) -> list[str]:
    positionals = [a for a in parser._actions if not a.option_strings]
    given: dict[str, list[str]] = {}        # positional dest -> its words, for the spec file
    pending: argparse.Action | None = None  # an option waiting for its value
    only_positionals = False
    for i, word in enumerate(words):
        if pending is not None and not word.startswith("-"):
            if pending.nargs not in ("*", "+"):     # those go on taking words up to the next option
                pending = None
        elif word == "--":
            only_positionals = True
        elif word.startswith("-") and not only_positionals:
            action = parser._option_string_actions.get(word.split("=", 1)[0])
            takes_value = action is not None and action.nargs != 0 and "=" not in word  # not --wait, --via=x
            pending = action if takes_value else None
        elif positionals:
            action = positionals[0]
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(word)
                return _candidates(sub, words[i + 1:], current) if sub is not None else []
            given.setdefault(action.dest, []).append(word)
            if action.nargs not in ("*", "+"):
                positionals.pop(0)
    if current.startswith("-") and "=" in current and not only_positionals:    # --via=sb
        opt, _, _ = current.partition("=")
        action = parser._option_string_actions.get(opt)
        return [f"{opt}={c}" for c in (action.choices or [])] if action else []
    if pending is not None and not current.startswith("-"):
        return [str(c) for c in pending.choices or []]
    if current.startswith("-") and not only_positionals:
        return [o for a in parser._actions for o in a.option_strings if a.help != argparse.SUPPRESS]
    if not positionals:
        return []
    action = positionals[0]
    if isinstance(action, argparse._SubParsersAction):
        return [name for name in action.choices if not name.startswith("_")]
    if action.choices:
        return [str(c) for c in action.choices]
    if action.dest == "overrides" and "=" not in current:
        return spec_paths(current, _roles((given.get("spec") or [""])[0]))
    return []


def _roles(spec_file: str) -> list[str]:
    """The role names of the spec file on the line; none if it does not read."""
    import yaml

    try:
        with open(os.path.expanduser(spec_file)) as f:
            data = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):   # a half-typed or broken file must not break the shell
        return []
    roles = data.get("roles") if isinstance(data, dict) else None
    return [str(r) for r in roles] if isinstance(roles, dict) else []


def spec_paths(current: str, roles: list[str]) -> list[str]:
    """Dotted paths of spec fields that extend `current`: a mapping ends in `.`, a value in `=`."""
    *parents, last = current.split(".")
    node: dict | None = known_fields()
    for part in parents:
        if not node:                        # a value, or keys of the user's own: nothing to offer
            return []
        node = node[ANY] if ANY in node else node.get(part, {})
    if not node:
        return []
    children = {r: node[ANY] for r in roles} if ANY in node else node
    prefix = "".join(p + "." for p in parents)
    return [prefix + name + ("=" if child == {} else ".")     # None: the user's own keys below
            for name, child in children.items() if name.startswith(last)]


def complete_main(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """`hpcrl __complete CWORD WORD0 WORD1 ...`: the candidates, one a line, as bash inserts them."""
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:     # 0: the command's own name
        return 0
    words, tail = rejoin(argv[1:], int(argv[0]))
    current = words.pop()
    for c in candidates(parser, words[1:], current):
        print(c[len(current) - len(tail):])   # bash replaces only the text after the word's last `=`
    return 0


_BASH = r"""_hpcrl() {
    local IFS=$'\n' c
    COMPREPLY=($(command hpcrl __complete "$COMP_CWORD" "${COMP_WORDS[@]}" 2>/dev/null))
    # `train.` and `train.seed=` are halfway: no space after them (while names are still offered)
    for c in "${COMPREPLY[@]}"; do [[ $c == *[.=] ]] || return 0; done
    [[ ${#COMPREPLY[@]} -gt 0 ]] && compopt -o nospace 2>/dev/null
    return 0
}
complete -o default -F _hpcrl hpcrl
"""

_ZSH = r"""_hpcrl() {
    local -a reply
    reply=(${(f)"$(command hpcrl __complete $((CURRENT - 1)) "${words[@]}" 2>/dev/null)"})
    (( $#reply )) || { _files; return }
    compadd -S '' -- ${(M)reply:#*[.=]}     # halfway, as in bash: no space after `.` and `=`
    compadd -- ${reply:#*[.=]}
}
(( $+functions[compdef] )) || { autoload -Uz compinit && compinit -i }
compdef _hpcrl hpcrl
"""


def shell_script(shell: str) -> str:
    """The script that `eval "$(hpcrl completion SHELL)"` runs."""
    if shell not in ("bash", "zsh"):
        raise ValueError(f"no completion for {shell!r}; there is bash and zsh")
    return _BASH if shell == "bash" else _ZSH
