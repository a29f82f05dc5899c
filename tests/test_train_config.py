"""The typed training configuration (hpcrl/ppo/config.py), offline: sections that check
themselves, the cross-section checks, the flat keys of earlier releases, the typed object handed
on unparsed, and `hpcrl schema` against the shipped specs."""
import json
import pickle
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from hpcrl.ppo.config import FLAT_KEYS, ConfigError, TrainConfig, upgrade_flat_keys
from hpcrl.jobspec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "jobs").glob("*.yaml"))


def test_every_flat_key_of_earlier_releases_names_one_field_of_a_section():
    paths = list(FLAT_KEYS.values())
    assert len(paths) == len(set(paths)) == 77         # 80 flat settings less seed, total_steps, progress
    assert "dynamic_sampling" not in FLAT_KEYS          # a setting added since exists only in its section
    for flat, path in FLAT_KEYS.items():
        section, name = path.split(".")
        assert name in type(getattr(TrainConfig(), section)).model_fields, (flat, path)
    old = {"dataset": "x.jsonl", "val_every": 5, "val_dataset": "v.jsonl", "rewards": [{"role": "reward"}],
           "train_engine": "torch", "checkpoint_io": "serial", "actor_lr": 1e-4, "colocate": [["ref", "reward"]]}
    cfg = TrainConfig.parse(old)
    assert (cfg.data.dataset, cfg.validation.every, cfg.reward.scorers[0].role, cfg.engine.backend, cfg.checkpoint.io,
            cfg.optim.actor_lr, cfg.layout.colocate) == ("x.jsonl", 5, "reward", "torch", "serial", 1e-4, [["ref", "reward"]])
    sectioned, notes = upgrade_flat_keys(old)
    assert TrainConfig.parse(sectioned) == cfg and len(notes) == len(old)
    assert "train.val_every: now train.validation.every (the flat key is read until hpcrl 0.3)" in notes


def test_a_setting_given_both_flat_and_in_its_section_is_refused():
    with pytest.raises(ConfigError) as e:
        TrainConfig.parse({"actor_lr": 1e-4, "optim": {"actor_lr": 1e-5}})
    assert e.value.problems == ["train.actor_lr: given twice, as train.actor_lr and train.optim.actor_lr; "
                                "write only the latter"]


def test_every_problem_names_its_section_and_field():
    with pytest.raises(ConfigError) as e:
        TrainConfig.parse({"rollout": {"n_samples": 0, "engine": "sglang"}, "optim": {"actor_lr": "fast"},
                           "algorithm": {"advantage": "grpo"}, "checkpoint": {"keep": 2}, "seed": 1.5})
    assert sorted(e.value.problems) == sorted([
        "train.rollout.n_samples: 0 is out of range; it must be ≥ 1",
        "train.rollout.engine: Input should be 'torch' or 'vllm' (got 'sglang')",
        "train.optim.actor_lr: Input should be a valid number (got 'fast')",
        "train.checkpoint.keep: unknown field (valid fields: save_every, save_last, keep_last, keep_every, async_save, "
        "io, snapshot_every, replay_limit)",
        "train.seed: Input should be a valid integer (got 1.5)"])
    # across sections, checked once each section is sound: one place, each problem by its field
    with pytest.raises(ConfigError) as e:
        TrainConfig.parse({"algorithm": {"advantage": "grpo"}, "data": {"batch_size": 6}, "optim": {"mini_batch_size": 4,
                                                                                                  "micro_batch_size": 4}})
    assert e.value.problems == [
        "train.rollout.n_samples: advantage grpo needs ≥ 2 responses per prompt to compare against",
        "train.optim.mini_batch_size: 4 does not divide data.batch_size × rollout.n_samples = 6"]


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_the_algorithm_menus_group_settings_need_a_group(advantage):
    with pytest.raises(ConfigError) as e:
        TrainConfig.parse({"algorithm": {"advantage": advantage, "dynamic_sampling": True, "overlong_buffer": 4},
                           "rollout": {"max_new_tokens": 3}})
    assert e.value.problems == [
        f"train.rollout.n_samples: advantage {advantage} needs ≥ 2 responses per prompt to compare against",
        "train.rollout.n_samples: algorithm.dynamic_sampling needs ≥ 2 responses per prompt (a group of one always "
        "has equal scores)",
        "train.algorithm.overlong_buffer: 4 is longer than rollout.max_new_tokens 3"]
    # REINFORCE++ compares with the batch, not a group; GSPO's small clip ranges are valid
    cfg = TrainConfig.parse({"algorithm": {"advantage": "reinforce_pp", "policy_loss": "gspo", "clip_low": 3e-4,
                                           "clip_high": 4e-4}})
    assert not cfg.algorithm.uses_critic and "critic" not in cfg.roles()


def test_updated_changes_a_section_keeping_its_other_fields_and_checks_the_result():
    cfg = TrainConfig(optim={"actor_lr": 1e-4, "ppo_epochs": 3})
    new = cfg.updated(optim={"actor_lr": 5e-5}, total_steps=9)
    assert (new.optim.actor_lr, new.optim.ppo_epochs, new.total_steps) == (5e-5, 3, 9)
    assert cfg.optim.actor_lr == 1e-4                                    # a copy
    with pytest.raises(ValueError, match="micro_batch_size: 32 is larger than mini_batch_size 16"):
        cfg.updated(optim={"mini_batch_size": 16})


def test_the_spec_holds_the_typed_settings_parsed_once_and_the_roles_get_them_as_they_are(tmp_path, monkeypatch):
    spec = load_spec(ROOT / "jobs" / "tiny-cpu.yaml")
    assert isinstance(spec.train, TrainConfig) and spec.train.optim.actor_lr == 3e-4
    # what travels to the roles (through Ray: a pickle) is the typed object, equal on arrival
    assert pickle.loads(pickle.dumps(spec.train)) == spec.train
    # nothing on the way builds it again from a mapping
    calls = []
    monkeypatch.setattr(TrainConfig, "parse", classmethod(lambda cls, *a, **k: calls.append(a)))
    from hpcrl.jobspec.checks import problems_before_submit
    from hpcrl.launch.submit import hetjob_of

    problems_before_submit(spec, hetjob_of(spec), None)
    assert calls == []
    # RUN_DIR/spec.yaml, which the driver reads back, holds the sections
    assert set(spec.as_data()["train"]) == {"seed", "total_steps", "data", "rollout", "algorithm", "optim"}


def test_relative_paths_are_taken_from_where_the_spec_is_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text())
    spec["train"]["data"]["dataset"] = "data/train.jsonl"
    spec["train"]["model"] = {"critic_init": "actor", "path": "~/models/m"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path, overrides=["train.validation.dataset=data/test.jsonl"])
    assert loaded.train.data.dataset == str(tmp_path / "data" / "train.jsonl")
    assert loaded.train.validation.dataset == str(tmp_path / "data" / "test.jsonl")
    assert loaded.train.model.path == str(Path("~/models/m").expanduser())
    assert loaded.train.model.critic_init == "actor"                          # a word, not a path


def test_the_schema_validates_every_shipped_spec_and_refuses_a_wrong_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hpcrl", "schema", "-o", str(tmp_path / "s.json")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    schema = json.loads((tmp_path / "s.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in SHIPPED:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, (path.name, errors)
    bad = yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text())
    bad["train"]["optim"]["actor_lr"] = -1
    bad["train"]["actor_lr"] = 1e-4                   # a flat key: the editor says to move it
    bad["roles"]["critic"]["nodes"] = "two"
    def leaves(errors):      # train may be null too: its errors are the context of an anyOf
        for e in errors:
            yield from leaves(e.context) if e.context else [(".".join(map(str, e.absolute_path)), e.validator)]
    found = set(leaves(validator.iter_errors(bad)))
    assert {("roles.critic.nodes", "type"), ("train", "additionalProperties"),
            ("train.optim.actor_lr", "exclusiveMinimum")} <= found, found
    # the docstrings are the descriptions an editor shows
    optim = schema["$defs"]["OptimSettings"]["properties"]["actor_lr"]
    assert optim["description"] == "actor AdamW learning rate" and optim["exclusiveMinimum"] == 0
