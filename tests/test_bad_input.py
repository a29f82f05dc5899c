"""Bad input, offline (pure logic, no cluster): nothing a spec holds reaches the batch script
unchecked, every setting has its range, the relations that stop a job are errors; and a fuzz test
over the shipped specs: every random mutation is either refused by field or renders exactly the
spec's components and values."""
import copy
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcrl.jobspec import SpecError, load_spec, parse_spec
from hpcrl.jobspec.checks import problems_before_submit, run_dir_warnings
from hpcrl.launch.submit import checked_hetjob, hetjob_of
from hpcrl.ppo.config import OptimSettings, TrainConfig, model_in, problem
from hpcrl.slurm.directives import UnsafeValue
from hpcrl.slurm.job import format_mem, format_minutes, parse_mem_mb, parse_time_minutes
from hpcrl.slurm.render import render_hetjob

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "jobs").glob("*.yaml"))
PARSED = {path: yaml.safe_load(path.read_text()) for path in SHIPPED}
"""The shipped specs parsed once: parsing one again for each fuzz case took a third of the fuzz's time."""
GOOD = {"name": "t", "run_dir": "/tmp/x",
        "roles": {"actor_rollout": {"partition": "a100", "gpus_per_node": 1, "gpu_type": "a100", "time": "01:00:00"},
                  "critic": {"partition": "h100"}, "ref": {"partition": "cpu"}, "reward": {"same_nodes_as": "ref"}}}


def refused(data) -> list[str]:
    with pytest.raises(SpecError) as e:
        checked_hetjob(parse_spec(data), offline=True)
    return e.value.problems


def with_role(**fields):
    return {**GOOD, "roles": {**GOOD["roles"], "critic": {"partition": "h100", **fields}}}


INJECTION = "--comment=x\necho owned > /tmp/owned"


def test_a_newline_in_any_script_value_is_refused_by_field():
    for field, value in (("sbatch_extra", [INJECTION]), ("account", "rlhf\necho owned"), ("qos", "normal\nid"),
                         ("constraint", "ib\n#SBATCH --partition=x"), ("partition", "h100\nrm -rf /")):
        problems = refused(with_role(**{field: value}))
        where = "roles.critic.sbatch_extra[0]" if field == "sbatch_extra" else f"roles.critic.{field}"
        assert any(p.startswith(f"{where}: ") and "control characters" in p for p in problems), (field, problems)


def test_values_slurm_would_read_otherwise_are_refused():
    assert "is not a valid --account value" in refused(with_role(account="rl hf"))[0]
    assert "is not a valid --constraint value" in refused(with_role(constraint="ib; date"))[0]
    assert "--time is written by hpcrl; set it with the spec's time" in refused(with_role(sbatch_extra=["--time=9"]))[0]
    assert "is not one long option" in refused(with_role(sbatch_extra=["-w node1"]))[0]
    assert "is not a valid --comment value" in refused(with_role(sbatch_extra=['--comment="a b"']))[0]
    assert "choose a run directory without them" in refused({**GOOD, "run_dir": "/tmp/a b"})[0]
    assert "choose a run directory without them" in refused({**GOOD, "run_dir": "/tmp/100%"})[0]
    assert "not a plain path to an interpreter" in refused({**GOOD, "python": "python3; date"})[0]
    with pytest.raises(UnsafeValue, match="roles.critic.qos"):       # the renderer refuses on its own too
        render_hetjob(hetjob_of(parse_spec(with_role(qos="a\nb"))))
    script = render_hetjob(hetjob_of(parse_spec(with_role(account="rlhf", qos="normal,high", constraint="ib&[r1|r2]",
                                                          sbatch_extra=["--reservation=rlhf-nov", "--mail-type=END"]))))
    for line in ("#SBATCH --account=rlhf", "#SBATCH --qos=normal,high", "#SBATCH --constraint=ib&[r1|r2]",
                 "#SBATCH --reservation=rlhf-nov", "#SBATCH --mail-type=END"):
        assert line in script.splitlines()


def test_a_spec_file_name_cannot_open_a_line_in_the_header(tmp_path):
    path = tmp_path / "a\nrm -rf x.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    script = render_hetjob(hetjob_of(load_spec(path)))
    assert "rm -rf x.yaml" in script.splitlines()[1] and not any(line.startswith("rm ") for line in script.splitlines())


def numeric_settings(model=TrainConfig, prefix="") -> dict[str, tuple[type, dict]]:
    """path -> (int or float, its bounds {"ge": 0, ...}) of every numeric training setting, read
    from the models' fields (bool is not one), not as the checker picks them."""
    out = {}
    for name, info in model.model_fields.items():
        inner = model_in(info.annotation)
        if inner is not None and name != "scorers":
            out.update(numeric_settings(inner, f"{prefix}{name}."))
        elif info.annotation in (int, float):
            bounds = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
            out[prefix + name] = (info.annotation, bounds)
    return out


NUMERIC = numeric_settings()
SIGN = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def test_every_numeric_setting_declares_its_range():
    assert len(NUMERIC) > 40, sorted(NUMERIC)         # the walk found the sections' settings
    undeclared = [path for path, (_, bounds) in NUMERIC.items() if not bounds]
    assert not undeclared, f"declare each one's range in its type: `{undeclared[0]}: Annotated[float, Field(ge=...)]`"


def settings_at(path: str, value) -> dict:
    *sections, name = path.split(".")
    node = {name: value}
    for section in reversed(sections):
        node = {section: node}
    return node


def own_problems(path: str, value) -> list[str]:
    """The problems of one setting set to value, in code rather than a spec (relations to others left out)."""
    try:
        TrainConfig.model_validate(settings_at(path, value))
    except ValidationError as e:
        return [problem(err, TrainConfig, "train") for err in e.errors()
                if ".".join(map(str, err["loc"])) == path]
    return []


@pytest.mark.parametrize("path", sorted(NUMERIC))
def test_every_numeric_setting_refuses_what_is_outside_its_range(path):
    kind, bounds = NUMERIC[path]
    allowed = [f"{SIGN[k]} {v:g}" for k, v in bounds.items()]
    step = (lambda b, way: b + way) if kind is int else (lambda b, way: math.nextafter(b, way * math.inf))
    for value in (math.nan, math.inf, -math.inf):
        problems = refused({**GOOD, "train": settings_at(path, value)})
        said = [p for p in problems if p.startswith(f"train.{path}: ")]
        assert said, (value, problems)
        if kind is float:
            assert said[0] == f"train.{path}: {value} is not a finite number"
        assert own_problems(path, value), value         # set in code, not read from a spec: the same
    outside = [step(bounds["ge"], -1)] if "ge" in bounds else []
    outside += [bounds["gt"]] if "gt" in bounds else []
    outside += [step(bounds["le"], 1)] if "le" in bounds else []
    outside += [bounds["lt"]] if "lt" in bounds else []
    for value in outside:
        problems = refused({**GOOD, "train": settings_at(path, kind(value))})
        said = [p for p in problems if p.startswith(f"train.{path}: {kind(value)!r} is out of range; it must be ")]
        assert said and any(a in said[0] for a in allowed), (value, problems)
    inside = [bounds[k] for k in ("ge", "le") if k in bounds]
    inside += [step(bounds["gt"], 1)] if "gt" in bounds else []
    inside += [step(bounds["lt"], -1)] if "lt" in bounds else []
    for value in inside:
        if path == "algorithm.dual_clip" and 0 < value <= 1:
            continue                                     # its off value is 0; (0, 1] is refused below
        assert own_problems(path, kind(value)) == [], value


def test_dual_clip_is_off_at_zero_or_above_one():
    assert own_problems("algorithm.dual_clip", 0.0) == own_problems("algorithm.dual_clip", 3.0) == []
    for value in (0.5, 1.0):
        assert own_problems("algorithm.dual_clip", value) == [
            f"train.algorithm.dual_clip: {value} is out of range; it must be > 1, or 0 (off)"]


def test_a_numeric_setting_declared_without_a_range_must_still_be_finite():
    class Later(OptimSettings):
        added: float = 0.5          # a setting added without bounds
    assert Later(added=-7.0).added == -7.0
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValidationError, match="finite"):
            Later(added=value)


def test_relations_that_stop_a_job_are_errors():
    short = refused({**GOOD, "signal_lead": 7200})
    assert any(p.startswith("roles.actor_rollout.time: 01:00:00 is not longer than signal_lead 7200 s") for p in short)
    two = {**GOOD, "roles": {**GOOD["roles"], "critic": {"partition": "h100", "nodes": 3}}}
    assert any("train.optim.mini_batch_size: 32 is not a multiple of the 3 ranks of role critic" in p
               for p in refused({**two, "train": {"seed": 1}}))
    vllm = {"engine": "vllm", "tensor_parallel": 2}
    assert any("rollout.tensor_parallel: 2 GPUs per vLLM engine, but role actor_rollout has 1 GPUs per node" in p
               for p in refused({**GOOD, "train": {"rollout": vllm}}))
    assert any(p.startswith("train.validation.dataset: missing") for p in refused(
        {**GOOD, "train": {"validation": {"every": 5}}}))
    # a pipeline needs generation apart from the actor: a rollout role, not in the actor's processes
    assert any("train.rollout.pipeline: one_step_off overlaps a separate rollout role" in p and "own_role: true" in p
               for p in refused({**GOOD, "train": {"rollout": {"pipeline": "one_step_off"}}}))
    apart = {**GOOD, "roles": {**GOOD["roles"], "rollout": {"same_nodes_as": "actor_rollout"}}}
    assert any("colocate puts rollout in actor_rollout's processes" in p for p in refused(
        {**apart, "train": {"rollout": {"pipeline": "one_step_off", "own_role": True},
                            "layout": {"colocate": [["actor_rollout", "rollout"]]}}}))
    assert any("train.rollout.pipeline: Input should be 'off', 'one_step_off' or 'async' (got 'two_steps_off')" in p
               for p in refused({**GOOD, "train": {"rollout": {"pipeline": "two_steps_off"}}}))
    # async gives the rollout its batches from a thread of the driver; multi-turn episodes are made on the driver's own
    assert any(p.startswith("train.rollout.pipeline: async generates on a thread") and "one_step_off" in p
               for p in refused({**apart, "train": {"rollout": {"pipeline": "async", "own_role": True},
                                                    "environment": {"cls": "hpcrl.ppo.tasks.tool_sums:SumsEnvironment"}}}))


def test_a_reward_fn_that_is_no_function_here_is_refused_before_submission(tmp_path):
    """As roles.<role>.worker is (tests/test_own_roles.py): imported by this process, the job's interpreter."""
    score = "hpcrl.ppo.tasks.copy_digits:score"
    cases = {"nopkg.rules:score": "train.reward.fn: 'nopkg.rules:score': module nopkg.rules does not import here",
             score + "s": f"train.reward.fn: '{score}s': module hpcrl.ppo.tasks.copy_digits has no scores",
             "hpcrl.ppo.tasks.copy_digits": "train.reward.fn: 'hpcrl.ppo.tasks.copy_digits': write it as "
                                            "'package.module:name'",
             "hpcrl.ppo.verifiers:PREFIXES": "train.reward.fn: 'hpcrl.ppo.verifiers:PREFIXES' is not a function "
                                             "(def score(prompt, response, **fields) -> float)"}
    for path, message in cases.items():
        problems = refused({**GOOD, "train": {"reward": {"fn": path}}})
        assert any(p.startswith(message) for p in problems), (message, problems)
    assert any("(def score(prompts, responses, **fields) -> a score per sample)" in p for p in refused(
        {**GOOD, "train": {"reward": {"fn": "hpcrl.ppo.verifiers:PREFIXES", "batched": True}}}))
    checked_hetjob(parse_spec({**GOOD, "train": {"reward": {"fn": score}}}), offline=True)     # a function: taken
    # hpcrl submit refuses it before anything is written (no Slurm needed to see that)
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump({**GOOD, "run_dir": str(tmp_path / "run"), "train": {"reward": {"fn": score + "s"}}}))
    out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(spec)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and cases[score + "s"] in out.stderr and not (tmp_path / "run").exists(), out.stderr


def test_a_run_directory_that_cannot_be_written_is_refused(tmp_path):
    from hpcrl.slurm.cluster_info import ClusterInfo

    def problems(run_dir) -> list[str]:
        spec = parse_spec({**GOOD, "run_dir": str(run_dir)})
        return problems_before_submit(spec, hetjob_of(spec), ClusterInfo({}, {}))

    (tmp_path / "file").write_text("")
    assert any("cannot be made" in p and "is not a directory" in p for p in problems(tmp_path / "file" / "run"))
    # a directory that permission bits call writable but that takes no file (root included)
    assert any("/proc refuses a new file" in p for p in problems("/proc/hpcrl-run"))
    if os.geteuid() != 0:          # root writes past permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert any("not writable by this user" in p for p in problems(locked / "run"))


def test_a_node_local_run_directory_is_said():
    assert "usually node-local" in run_dir_warnings(parse_spec({**GOOD, "run_dir": "/dev/shm/run"}))[0]
    assert run_dir_warnings(parse_spec({**GOOD, "run_dir": "/scratch/rlhf/runs/x"})) == []   # (a checkout may sit in /tmp)


# ------------------------------------------------------------------ the fuzz test
KEY = r"(?:[A-Za-z0-9_+-]+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\d+)"      # as hpcrl.ppo.config.spec_key writes one
PATH = rf"{KEY}(?:\.{KEY}|\[\d+\])*"
FIELD = re.compile(rf"^(?:top level|cannot read the spec|not valid YAML|{PATH}(?:, {PATH})*)(?::| \()")
SCALARS = (st.integers(min_value=-(10 ** 12), max_value=10 ** 12) | st.floats(allow_nan=True, allow_infinity=True)
           | st.booleans() | st.none() | st.text(max_size=12)
           | st.sampled_from(["\n", "a\nb", "x\r\n#SBATCH --partition=cpu", "-1", "1e999", "$(id)", "`id`", "';id;'",
                              "%j", "a b", "\x00", "ib&a100", "gpu:a100:2", "99:99:99", "0", "--x=y", "\t"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=6)


NAMEISH = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
TRICKY = st.sampled_from(["a\nb", "x\r\n#SBATCH --partition=cpu", "$(id)", "a b", "%j", "';id;'", "\x00", "`id`"])


def alike(value):
    """Values of the kind `value` is."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(0, 16) | st.integers(-3, 10 ** 6)
    if isinstance(value, float):
        return st.floats(0, 2) | st.floats(allow_nan=True)
    if isinstance(value, str):
        return NAMEISH | TRICKY | st.just(value + "x")
    if isinstance(value, list):
        return st.lists(NAMEISH.map(lambda n: f"--{n.replace('_', '-')}=1") | TRICKY | NAMEISH, max_size=3)
    return VALUES


def paths(node, prefix=()):
    """Every place in a parsed spec where a value sits."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))


@st.composite
def mutations(draw):
    path = draw(st.sampled_from(SHIPPED))
    spec = copy.deepcopy(PARSED[path])
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([p for p in paths(spec) if p]))
        parent = spec
        for k in where[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["set", "like", "like", "like", "delete", "add"]))
        if op == "delete":
            del parent[where[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(VALUES)
        elif op == "like":            # a value of the same kind: most of these render, and must render right
            parent[where[-1]] = draw(alike(parent[where[-1]]))
        else:
            parent[where[-1]] = draw(VALUES)
    text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    if draw(st.booleans()) and draw(st.integers(0, 9)) == 0:          # a key written twice
        text += text.splitlines()[0] + "\n"
    return path.name, text


def sbatch_header(script: str) -> list[dict[str, str | None]]:
    """The #SBATCH options of each component, read back from the script as Slurm reads them:
    directives up to the first line that is neither a comment nor blank."""
    comps, current = [], {}
    for line in script.splitlines()[1:]:
        if not line.startswith("#"):
            if line.strip():
                break
            continue
        if line == "#SBATCH hetjob":
            comps.append(current)
            current = {}
        elif line.startswith("#SBATCH "):
            option, _, value = line[len("#SBATCH "):].partition("=")
            current[option] = value if _ else None
    return comps + [current]


def expected_header(spec) -> list[dict[str, str | None]]:
    out = []
    for k, members in enumerate(spec.component_roles()):
        r = spec.roles[members[0]]
        want = {"--partition": r.partition, "--nodes": str(r.nodes), "--ntasks-per-node": "1",
                "--cpus-per-task": str(r.cpus_per_task)}
        if r.mem:
            want["--mem"] = format_mem(parse_mem_mb(r.mem))
        gres = r.gres or (f"gpu:{r.gpu_type}:{r.gpus_per_node}" if r.gpu_type else
                          f"gpu:{r.gpus_per_node}" if r.gpus_per_node else None)
        if gres:      # Slurm's count defaults to 1: "gpu" is "gpu:1", and the script says it so
            want["--gres"] = gres if gres.rsplit(":", 1)[-1].isdigit() else f"{gres}:1"
        if r.time:
            want["--time"] = format_minutes(parse_time_minutes(r.time))
        want.update({f"--{f}": getattr(r, f) for f in ("account", "qos", "constraint") if getattr(r, f)})
        if r.exclusive:
            want["--exclusive"] = None
        for flag in r.sbatch_extra:
            option, _, value = flag.partition("=")
            want[option] = value if _ else None
        if k == 0:
            want = {"--job-name": spec.name, "--output": f"{spec.run_dir}/logs/slurm-%j.out",
                    "--open-mode": "append", **({"--requeue": None, "--signal": f"B:USR1@{spec.signal_lead}"}
                                                if spec.requeue else {"--no-requeue": None}), **want}
        out.append(want)
    return out


CASES = {"tried": 0, "refused": 0, "rendered": 0}


# .ci/run (HPCRL_CI=1) tries the same 3000 cases every run of the same checkout (Hypothesis also draws constants
# from the hpcrl modules imported by then): a red CI names a case that fails again. Elsewhere they are new each
# run, and a failure prints the blob that replays it (@reproduce_failure).
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          derandomize=bool(os.environ.get("HPCRL_CI")), print_blob=True)
@given(mutations())
def mutated_spec_is_refused_by_field_or_renders_exactly(case):
    name, text = case
    CASES["tried"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(text)
        try:
            spec = load_spec(path)
            script = render_hetjob(checked_hetjob(spec, offline=True))
        except SpecError as e:
            CASES["refused"] += 1
            assert e.problems and all(FIELD.match(p) for p in e.problems), e.problems
            return
    CASES["rendered"] += 1
    assert sbatch_header(script) == expected_header(spec)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)      # a well-formed shell script


def test_any_mutation_of_a_shipped_spec_is_refused_by_field_or_renders_exactly(capsys):
    """The fuzz, then how many cases it tried (printed past pytest's capture, for CI's log): in the
    same test, so that the count is never checked without the fuzz having run, and fails where it tried
    nothing or only one kind of case."""
    CASES.update(tried=0, refused=0, rendered=0)
    mutated_spec_is_refused_by_field_or_renders_exactly()
    with capsys.disabled():
        print(f"\nfuzz: {CASES}")
    assert CASES["tried"] > 0 and CASES["refused"] > 0 and CASES["rendered"] > 0, CASES
