"""The docs' reference pages (hpcrl/reference_docs.py): each committed page is what the code gives now,
a field holding a model gets its own table at the field's path, and the registries the metrics and
events pages are made of are complete: two short real trainings (PPO with a critic, reference,
two reward terms and validation; GRPO) log every metric of hpcrl/ppo/step_metrics.py and nothing
else, and every event kind the code writes is in hpcrl/observe/event_kinds.py (about 45 s on 2 cores)."""
import ast
import json
import subprocess
import sys
from typing import Literal

import pytest
import yaml
from conftest import ROOT
from pydantic import BaseModel, ConfigDict, Field

from hpcrl import reference_docs
from hpcrl.observe.event_kinds import EVENTS, EVERY_EVENT
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.status import read_events
from hpcrl.ppo.step_metrics import METRICS, entry

STALE = f"run {reference_docs.REGENERATE} to regenerate"


def test_the_committed_reference_pages_are_what_the_code_generates():
    stale = reference_docs.stale()
    assert not stale, f"docs/pages/reference/: {', '.join(stale)} out of date; {STALE}"


def test_check_exits_1_naming_only_the_stale_pages(tmp_path):
    assert reference_docs.main(["--out", str(tmp_path)]) == 0
    (tmp_path / "metrics.md").write_text("an older page\n")
    check = subprocess.run([sys.executable, "-m", "hpcrl.reference_docs", "--check", "--out", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 1 and "metrics.md" in check.stderr and STALE in check.stderr, check.stderr
    assert not any(name in check.stderr for name in ("spec.md", "cli.md", "events.md")), check.stderr
    assert reference_docs.main(["--out", str(tmp_path)]) == 0
    assert reference_docs.main(["--check", "--out", str(tmp_path)]) == 0


class Inner(BaseModel):
    """A section."""
    model_config = ConfigDict(use_attribute_docstrings=True)

    size: int = Field(2, ge=1)
    """how big"""


class Outer(BaseModel):
    """Its docstrings are read from the source (no use_attribute_docstrings)."""
    section: Inner = Field(default_factory=Inner)
    roles: dict[str, Inner] = Field(default_factory=dict)
    extra: Inner | None = None
    terms: list[Inner] = Field(default_factory=list)
    mode: Literal["fast", "slow"] | None = "fast"
    """how it runs"""


def test_a_field_holding_a_model_gets_a_table_at_its_path():
    """What lets `train:` become a model of sections with no change to the generator."""
    sections = reference_docs.model_sections(Outer)
    assert [s.path for s in sections] == ["", "section", "roles.<role>", "extra", "terms[i]"]
    assert all(s.rows == [[f"`{s.path}.size`", "`int`", "`2`", "≥ 1", "how big"]] and s.doc == "Inner: A section."
               for s in sections[1:])
    assert sections[0].rows[-1] == ["`mode`", "`str | None`", '`"fast"`', "one of `fast`, `slow`", "how it runs"]
    assert sections[0].rows[0][2] == "the defaults below" and sections[0].rows[1][1] == "`dict[str, Inner]`"


ROLES = {"ppo": {"actor_rollout": None, "critic": None, "ref": None, "reward": None,
                 "rule_engine": "hpcrl.jobs.rule_engine:RuleEngineWorker", "rollout": None},
         "grpo": {"actor_rollout": None, "reward": None, "env": None}}
"""Each run's roles, and the worker class of a role of your own."""
HELD_OUT = [{"prompt": "12=", "data_source": "copy"}, {"prompt": "34=", "data_source": "other"}]


def training_settings(held_out) -> dict[str, dict]:
    """Each run's `train:`, the one place that names settings: flat keys, which the sectioned
    `train:` reads too (with a note naming each new key). Every role in one process (one process start,
    not five), but PPO's rollout: asynchronous, it runs beside the trainers."""
    small = {"total_steps": 2, "batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 8, "ppo_epochs": 1,
             "progress": False, "save_every": 1}
    return {"ppo": {**small, "colocate": [list(ROLES["ppo"])[:-1]], "val_dataset": str(held_out), "val_every": 2,
                    "val_before_train": True,
                    # a rollout role of its own, asynchronous with partial rollouts: the buffer/ metrics
                    "rollout": {"own_role": True, "pipeline": "async", "partial_rollout": "continue", "segment_tokens": 2},
                    "rewards": [{"role": "reward"},
                                {"role": "rule_engine", "method": "compute_rule_score", "weight": 0.5}]},
            "grpo": {**small, "colocate": [list(ROLES["grpo"])], "advantage": "grpo", "n_samples": 2, "kl_coef": 0.0,
                     "algorithm": {"mis_band": [0.5, 2.0]},      # actor/mis_masked
                     # multi-turn, with the built-in tool task's calculator: the env/ metrics
                     "data": {"task": "tool_sums"}, "max_new_tokens": 6,
                     "environment": {"cls": "hpcrl.ppo.tasks.tool_sums:SumsEnvironment", "max_turns": 2,
                                     "max_tokens": 16}}}


def train_locally(run_dir, train: dict, roles: dict[str, str | None]) -> None:
    """`hpcrl run SPEC --local`, as a user runs it; the first role's component holds every role."""
    first, *rest = roles
    spec = {"name": run_dir.name, "run_dir": str(run_dir), "train": train,
            "roles": {first: {"partition": "local"}, **{r: {"same_nodes_as": first} for r in rest}}}
    for role, worker in roles.items():
        if worker:
            spec["roles"][role]["worker"] = worker
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec))
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(path), "--local", "--num-cpus", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The run directories of a PPO run (critic, reference, two reward terms, validation on prompts
    of two data sources, an asynchronous rollout role) and a multi-turn GRPO run, 2 steps each."""
    tmp = tmp_path_factory.mktemp("runs")
    held_out = tmp / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(p) + "\n" for p in HELD_OUT))
    for name, train in training_settings(held_out).items():
        train_locally(tmp / name, train, ROLES[name])
    return [tmp / name for name in ROLES]


def test_every_metric_a_run_logs_is_in_the_registry_and_every_entry_is_logged(runs):
    records = [r for run in runs for r in read_metrics(run / "metrics.jsonl")]
    unknown = sorted({k for r in records for k in r if entry(k) is None})
    assert not unknown, f"logged, but not in hpcrl/ppo/step_metrics.py: {unknown}"
    logged = {entry(k) for r in records for k, v in r.items() if v is not None}
    assert not set(METRICS) - logged, f"in hpcrl/ppo/step_metrics.py, never logged: {sorted(set(METRICS) - logged)}"


def event_calls():
    """(file:line, kind, keyword fields) of every `<status>.event(...)` call in hpcrl/."""
    for path in sorted((ROOT / "hpcrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "event":
                kind = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                yield f"{path.relative_to(ROOT)}:{node.lineno}", kind, {k.arg for k in node.keywords if k.arg}


def test_every_event_the_code_writes_is_in_the_registry_with_its_fields():
    calls = list(event_calls())
    unreadable = [where for where, kind, _ in calls if not isinstance(kind, str)]
    assert not unreadable, f"write the event kind as a string literal, so this test can read it: {unreadable}"
    unknown = [(where, kind) for where, kind, _ in calls if kind not in EVENTS]
    assert not unknown, f"written, but not in hpcrl/observe/event_kinds.py: {unknown}"
    undocumented = [(where, kind, sorted(fields - set(EVENTS[kind].fields))) for where, kind, fields in calls
                    if fields - set(EVENTS[kind].fields)]
    assert not undocumented, f"fields missing in hpcrl/observe/event_kinds.py: {undocumented}"
    never = set(EVENTS) - {kind for _, kind, _ in calls}
    assert not never, f"in hpcrl/observe/event_kinds.py, written nowhere: {sorted(never)}"


def test_the_events_of_a_run_have_the_registered_fields(runs):
    """What the source cannot show: the fields spread into an event from a dict (`**info`)."""
    events = [e for run in runs for e in read_events(run)]
    kinds = {e["event"] for e in events}
    assert {"start", "checkpoint", "finish"} <= kinds <= set(EVENTS), kinds
    extra = [e for e in events if set(e) - set(EVERY_EVENT) - set(EVENTS[e["event"]].fields)]
    assert not extra, f"fields missing in hpcrl/observe/event_kinds.py: {extra}"


def test_a_real_runs_startup_phases_come_in_order_and_cover_every_rank(runs):
    """The `startup` events of the PPO run: its own phases in order, every role's rank with its
    process's phases, and the first step's record saying when the last phase ended."""
    events = [e for e in read_events(runs[0]) if e["event"] == "startup"]
    own = [e for e in events if e["role"] is None]
    assert [e["phase"] for e in own] == ["driver", "ray", "roles", "validation", "first_step"], own
    assert all(a["since_start"] <= b["since_start"] for a, b in zip(own, own[1:])), own
    ranks = {(e["role"], e["rank"]) for e in events if e["role"]}
    assert {r for r, _ in ranks} == set(ROLES["ppo"]) and {k for _, k in ranks} == {0}, ranks
    for role, rank in ranks:
        mine = [e["phase"] for e in events if (e["role"], e["rank"]) == (role, rank)]
        assert mine[:2] == ["process", "group"] and mine[-1] == "built", (role, mine)
        assert ("model" in mine) == (role in ("actor_rollout", "critic", "ref")), (role, mine)
    first = next(r for r in read_metrics(runs[0] / "metrics.jsonl") if "timing/step" in r)
    assert abs(first["timing/startup"] - own[-1]["since_start"]) < 0.5, (first["timing/startup"], own[-1])
