"""Your own roles and your own loop (docs/pages/how-to/own-role.md, own-loop.md): jobs/rule_engine.py's
role on a hetjob component of its own, its score a term of the reward; jobs/own_loop.py in place
of the built-in driver, killed and preempted, against the built-in loop uninterrupted; and a spec
that names code which is not there, refused before anything is written."""
import json
import random
import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from conftest import ROOT, job_finished, keeping_off, kill_dead, preempt_and_finish, slurm_log, submit, wait_until, with_train
from test_requeue import assert_same_training

from hpcrl.checkpoint.format import read_role_file
from hpcrl.jobspec import SpecError, load_spec
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.report import CURVES, expand
from hpcrl.observe.status import read_events

RULES = ROOT / "jobs" / "tiny-cpu-rules.yaml"
STEPS = 60      # about 0.25 s each: the kill, the rebuild and the preemption fall inside the run


def rules_spec(tmp_path, name, steps, **top):
    spec = yaml.safe_load(RULES.read_text())
    with_train(spec, total_steps=steps, progress=False)
    spec.update(top)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_spec_naming_code_that_is_not_there_is_refused_naming_the_field(tmp_path):
    load_spec(RULES)
    spec = yaml.safe_load(RULES.read_text())
    cases = {
        "roles.rule_engine.worker: 'nopkg.rules:RuleEngineWorker': module nopkg.rules does not import":
            lambda s: s["roles"]["rule_engine"].update(worker="nopkg.rules:RuleEngineWorker"),
        "roles.rule_engine.worker: 'hpcrl.jobs.rule_engine:Nope': module hpcrl.jobs.rule_engine has no Nope":
            lambda s: s["roles"]["rule_engine"].update(worker="hpcrl.jobs.rule_engine:Nope"),
        "roles.rule_engine.worker: 'hpcrl.jobs.own_loop:main' is a function, not a class":
            lambda s: s["roles"]["rule_engine"].update(worker="hpcrl.jobs.own_loop:main"),
        "roles.rule_engine.worker: 'hpcrl.jobs.rule_engine:RuleEngineWorker': RuleEngineWorker.__init__ does not "
        "take these worker_args ['bonus']":
            lambda s: s["roles"]["rule_engine"].update(worker_args={"bonus": 1}),
        "train.reward.scorers[1].method: RuleEngineWorker has no method compute_rule_scores (registered: "
        "compute_rule_score)":
            lambda s: s["train"]["reward"]["scorers"][1].update(method="compute_rule_scores"),
        "train.reward.scorers[1].role: rules is not a role of this spec (roles: actor_rollout, reward, rule_engine)":
            lambda s: s["train"]["reward"]["scorers"][1].update(role="rules"),
        "roles.reward.worker: reward is a built-in role":
            lambda s: s["roles"]["reward"].update(worker="hpcrl.jobs.rule_engine:RuleEngineWorker"),
        "driver: 'hpcrl.jobs.own_loop:man': module hpcrl.jobs.own_loop has no man":
            lambda s: s.update(driver="hpcrl.jobs.own_loop:man"),
    }
    for i, (message, change) in enumerate(cases.items()):
        bad = json.loads(json.dumps(spec))
        change(bad)
        bad["run_dir"] = str(tmp_path / f"run{i}")
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(SpecError) as refused:
            load_spec(path)
        assert any(p.startswith(message) for p in refused.value.problems), (message, refused.value.problems)
    # hpcrl submit refuses it before anything is written (no Slurm needed to see that)
    out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr and not (tmp_path / f"run{i}").exists(), out.stderr


@pytest.mark.slurm
@pytest.mark.cluster_exclusive    # an urgent job preempts its node
def test_own_role_on_its_component_and_own_loop_killed_and_preempted_train_as_the_builtin_loop(slurm_cluster, tmp_path):
    """jobs/tiny-cpu-rules.yaml with driver: hpcrl.jobs.own_loop:main, the rule engine's process
    killed (only that role is rebuilt) and the job preempted (it requeues and resumes); beside it,
    on other nodes, the spec as it ships (the built-in GRPO driver), uninterrupted: the own loop
    trains bitwise what the built-in loop trained, which is what jobs/own_loop.py claims to be a copy of."""
    once, twice = tmp_path / "once", tmp_path / "twice"
    job = submit(rules_spec(tmp_path, "own", STEPS, driver="hpcrl.jobs.own_loop:main"), twice)
    plain = submit(keeping_off(rules_spec(tmp_path, "builtin", STEPS), twice), once)     # at the same time, elsewhere
    seed = random.randrange(2**32)
    kill_at = random.Random(seed).randint(3, 10)
    print(f"kill after step {kill_at} (seed {seed})")        # shown with a failure
    wait_until(lambda: len(read_metrics(twice / "metrics.jsonl")) >= kill_at, 300, f"{kill_at} steps (seed {seed})")
    roles = lambda: json.loads((twice / "status.json").read_text())["roles"]  # noqa: E731
    before = {r: s["ranks"][0]["pid"] for r, s in roles().items()}
    kill_dead(before["rule_engine"])
    wait_until(lambda: any(e["event"] == "rebuilt" for e in read_events(twice)), 120, "the rule engine rebuilt")
    after = {r: s["ranks"][0]["pid"] for r, s in roles().items()}
    assert after["rule_engine"] != before["rule_engine"]
    assert {r: p for r, p in after.items() if r != "rule_engine"} == {r: p for r, p in before.items() if r != "rule_engine"}
    assert [e["role"] for e in read_events(twice) if e["event"] in ("rebuild", "rebuilt")] == ["rule_engine"] * 2

    preempt_at = len(read_metrics(twice / "metrics.jsonl")) + 1
    wait_until(lambda: len(read_metrics(twice / "metrics.jsonl")) >= preempt_at, 300, f"{preempt_at} steps")
    preempt_and_finish(twice, job)
    wait_until(lambda: job_finished(plain), 600, "the built-in loop's run")
    records = read_metrics(once / "metrics.jsonl")
    assert len(records) == STEPS, slurm_log(once)
    components = json.loads((once / "allocation.json").read_text())["components"]
    assert [(c["members"], c["partition"]) for c in components] == [
        (["actor_rollout"], "a100"), (["reward"], "cpu"), (["rule_engine"], "cpu")]
    assert components[1]["nodes"] != components[2]["nodes"]
    for r in records:    # each term logged, the sample's score their weighted sum
        assert r["reward/mean"] == pytest.approx(r["score/reward"] + 0.5 * r["score/rule_engine"], abs=1e-6)
    # the role's own state_dict is its checkpoint file: one batch scored per step
    state, _ = read_role_file(once / "ckpt" / f"step_{STEPS:08d}" / "rule_engine.h5")
    assert state["role"] == {"batches": STEPS}
    for term in ("score/reward", "score/rule_engine"):    # both go up (the run is seeded: not by chance)
        assert sum(r[term] for r in records[-10:]) / 10 > sum(r[term] for r in records[:5]) / 5

    own = read_metrics(twice / "metrics.jsonl")
    assert [r["step"] for r in own] == list(range(1, STEPS + 1))
    assert [(r["reward/mean"], r["score/rule_engine"], r["actor/pg_loss"]) for r in own] == \
        [(r["reward/mean"], r["score/rule_engine"], r["actor/pg_loss"]) for r in records]
    assert_same_training(once, twice, STEPS, roles=("actor_rollout",), metrics=False)


def test_the_docs_place_and_wire_the_role_as_the_example_does():
    """docs/pages/how-to/own-role.md, "Add a role in three steps": its placement and wiring are
    jobs/tiny-cpu-rules.yaml's (which the test above runs). Its worker class, and your own loop's
    code, are checked line for line against jobs/rule_engine.py and jobs/own_loop.py by
    tests/test_docs.py (their blocks are marked as excerpts of those files)."""
    page = (ROOT / "docs" / "pages" / "how-to" / "own-role.md").read_text()
    section = page[page.index("## Add a role in three steps"):page.index("## A slow scorer")]
    blocks = re.findall(r"^( *)```yaml\n(.*?)^\1```", section, re.M | re.S)     # indented in the list
    placed, wired = (yaml.safe_load(textwrap.dedent(body)) for _, body in blocks)
    spec = yaml.safe_load(RULES.read_text())
    assert {k: spec["roles"]["rule_engine"][k] for k in placed["rule_engine"]} == placed["rule_engine"]
    assert wired["train"]["reward"]["scorers"] == spec["train"]["reward"]["scorers"]


def test_two_critics_side_by_side_leave_the_built_in_training_as_it_was(tmp_path):
    """jobs/tiny-cpu-two-critics.yaml (locally, one Ray node): its driver trains a second, smaller
    critic on the same data; the actor and the first critic train bitwise as the built-in loop
    trains them without it, both value losses fall, and the report draws them on one plot."""
    runs, procs = {}, {}
    for name, own in (("two", True), ("builtin", False)):
        spec = yaml.safe_load((ROOT / "jobs" / "tiny-cpu-two-critics.yaml").read_text())
        with_train(spec, total_steps=12, progress=False)
        if not own:
            spec.pop("driver")
            spec["roles"].pop("critic_small")
        runs[name] = tmp_path / name
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**spec, "run_dir": str(runs[name])}))
        # both at once, each on its own local Ray: a 12-step run is mostly its start
        with open(tmp_path / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", str(path), "--local", "--num-cpus", "2"],
                                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        assert proc.wait(timeout=900) == 0, (tmp_path / f"{name}.log").read_text()
    assert_same_training(runs["builtin"], runs["two"], 12, metrics=False)
    two, builtin = read_metrics(runs["two"] / "metrics.jsonl"), read_metrics(runs["builtin"] / "metrics.jsonl")
    assert [(r["reward/mean"], r["vf_loss/critic"]) for r in two] == [(r["reward/mean"], r["critic/vf_loss"]) for r in builtin]
    for role in ("critic", "critic_small"):
        assert two[-1][f"vf_loss/{role}"] < two[0][f"vf_loss/{role}"] / 4, [r[f"vf_loss/{role}"] for r in two]
    subprocess.run([sys.executable, "-m", "hpcrl", "report", str(runs["two"])], cwd=ROOT, check=True, capture_output=True)
    assert 'src="losses.png"' in (runs["two"] / "report" / "index.html").read_text()
    losses = next(series for name, _, series, _ in CURVES if name == "losses.png")
    assert {"vf_loss/critic", "vf_loss/critic_small"} <= {key for key, _ in expand(losses, two)}
