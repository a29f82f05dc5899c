"""The memory plan (hpcrl/jobspec/memory.py): its counts against the models transformers and peft
build, its parts against what the real engines allocate on CPU, its arithmetic by hand, and what
`hpcrl validate` and `hpcrl plan` say of specs that do and do not fit."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from hpcrl.cli import main
from hpcrl.jobspec import load_spec
from hpcrl.jobspec.checks import memory_plan
from hpcrl.jobspec.gpus import gpu_memory
from hpcrl.jobspec.memory import GIB, CONSTANTS
from hpcrl.models.size import NAMED_SHAPES, ModelSize, model_fields, tiny_qwen2_fields

SIZES = {**{name: NAMED_SHAPES[name] for name in NAMED_SHAPES},
         "tiny": tiny_qwen2_fields(14), "tiny-tied-llama": {**tiny_qwen2_fields(50), "model_type": "llama",
                                                            "tie_word_embeddings": True}}


@pytest.mark.parametrize("name", SIZES)
def test_counted_parameters_are_those_of_the_model_transformers_builds(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SIZES[name])
    size = ModelSize.of(fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert size.params == sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    assert [n for n, *_ in size.linears] == [n for n, m in model.named_modules()
                                              if isinstance(m, torch.nn.Linear) and m is not head]


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["mlp.down_proj"]])
def test_lora_parameters_are_those_peft_trains(targets):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(NAMED_SHAPES["qwen2.5-0.5b"], num_hidden_layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    inject_adapter_in_model(LoraConfig(r=8, target_modules=targets), model)
    trained = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert ModelSize.of(dict(NAMED_SHAPES["qwen2.5-0.5b"], num_hidden_layers=2)).lora_params(8, targets) == trained


def test_the_parameter_counts_are_the_published_sizes():
    """../shared/notes/model-shapes.md: 0.494, 1.544, 3.086, 7.616, 8.030 billion."""
    published = {"qwen2.5-0.5b": 0.494, "qwen2.5-1.5b": 1.544, "qwen2.5-3b": 3.086, "qwen2.5-7b": 7.616,
                 "llama-3.1-8b": 8.030}
    for name, billions in published.items():
        assert round(ModelSize.of(NAMED_SHAPES[name]).params / 1e9, 3) == billions, name


ONE_GPU = {"actor_rollout": {"partition": "h100", "gpus_per_node": 1, "gpu_type": "h100"},
           "critic": {"same_nodes_as": "actor_rollout"}, "ref": {"same_nodes_as": "actor_rollout"},
           "reward": {"same_nodes_as": "actor_rollout"}}
"""PPO on one GPU: the three models in one process (each process holds a GPU of its own), the rule reward beside"""
COLOCATED = {"layout": {"colocate": [["actor_rollout", "critic", "ref"]]}}


def spec(tmp_path, train: dict, roles: dict | None = None, name="plan") -> dict:
    return {"name": name, "run_dir": str(tmp_path / "run"), "roles": roles or ONE_GPU,
            "train": {**(COLOCATED if roles is None else {}), **train}}


def written(tmp_path, data: dict) -> str:
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def model_folder(tmp_path, shape: str):
    """A model folder holding only the config.json of a named shape: all the plan reads."""
    folder = tmp_path / shape
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(NAMED_SHAPES[shape]))
    return folder


PPO = {"data": {"batch_size": 16, "max_prompt_length": 256}, "rollout": {"max_new_tokens": 256, "n_samples": 4},
       "optim": {"micro_batch_size": 8, "mini_batch_size": 64}, "algorithm": {"advantage": "gae", "kl_coef": 0.001}}


def test_full_fine_tuning_holds_sixteen_bytes_a_parameter_by_hand(tmp_path):
    """weights fp32 4 B, gradients 4 B, AdamW's moments 8 B; the reference in bf16, 2 B; a critic's
    backbone and value head; each process's peak its largest phase × the allocator's slack + context."""
    plan = memory_plan(load_spec(written(tmp_path, spec(tmp_path, {**PPO, "model": {"path": str(model_folder(
        tmp_path, "qwen2.5-1.5b"))}}))))
    (gpu,) = plan.gpus
    process, standby = gpu.processes
    actor, critic, ref = ({p.name: p.bytes for p in process.parts if p.role == r} for r in ("actor_rollout", "critic", "ref"))
    assert actor["weights"] == 4 * 1_543_714_304 and actor["gradients"] == 4 * 1_543_714_304
    assert actor["optimizer"] == 8 * 1_543_714_304
    backbone_and_head = 1_543_714_304 + 1536 + 1     # tied: no output layer of its own to drop
    assert critic["optimizer"] == 8 * backbone_and_head
    assert ref["weights (bf16)"] == 2 * 1_543_714_304
    # calls run one after the other: the actor's update holds every model and its own gradients and
    # activations, not the critic's
    resident = sum(p.bytes for p in process.parts if len(p.phases) == 4)
    update = {r: sum(p.bytes for p in process.parts if p.role == r and p.phases == ("update",)) for r in ("actor_rollout", "critic")}
    assert process.phase_bytes("update") == pytest.approx(resident + max(update.values()))
    assert process.peak == pytest.approx(max(process.phase_bytes(ph) for ph in ("generate", "score", "update", "sync"))
                                         * CONSTANTS.allocator + CONSTANTS.context)
    # its standby process (layout.standby auto, on a GPU): a context and one layer rehearsed, weights and
    # gradients fp32: q, k, v with biases, o, the MLP's three, two norms
    layer = 1536 * 1536 + 1536 + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert standby.parts[0].bytes == 8 * layer
    assert standby.peak == pytest.approx(8 * layer * CONSTANTS.allocator + CONSTANTS.context)
    assert gpu.peak == pytest.approx(process.peak + standby.peak)


def test_lora_and_offload_keep_what_they_say_on_the_gpu(tmp_path):
    folder = str(model_folder(tmp_path, "qwen2.5-7b"))
    grpo = {**PPO, "model": {"path": folder}, "algorithm": {"advantage": "grpo", "kl_coef": 0.001},
            "lora": {"rank": 16}}
    roles = {"actor_rollout": {"partition": "h100", "gpus_per_node": 1, "gpu_type": "h100"}, "reward": {"partition": "cpu"}}
    plan = memory_plan(load_spec(written(tmp_path, spec(tmp_path, grpo, roles))))
    actor, standby = plan.gpus[0].processes   # no ref process: the reference is the LoRA base in the actor
    adapters = ModelSize.of(NAMED_SHAPES["qwen2.5-7b"]).lora_params(16, "all-linear")
    parts = {p.name: p.bytes for p in actor.parts}
    assert parts["weights"] == 4 * adapters + 2 * (7_615_616_512 - adapters)
    assert parts["optimizer"] == 8 * adapters and parts["gradients"] == 4 * adapters
    full = {**grpo, "lora": {"rank": 0}, "engine": {"offload": "optimizer"}, "algorithm": {"advantage": "grpo", "kl_coef": 0.0}}
    parts = {p.name: p for p in memory_plan(load_spec(written(tmp_path, spec(tmp_path, full, roles, "o")))).gpus[0]
             .processes[0].parts}
    assert parts["optimizer (streamed chunks)"].bytes == 6 * CONSTANTS.offload_chunk     # 3 chunks' 2 moments
    assert parts["optimizer (streamed chunks)"].phases == ("update",)


def test_the_rollout_parts_are_what_the_static_cache_engine_allocates(tmp_path):
    """On CPU in bf16: the engine's own weights (its output layer apart, tied or not) and its KV cache
    after a generation of the planned rows and lengths."""
    from transformers import AutoConfig

    from hpcrl.engines.base import SamplingParams
    from hpcrl.engines.rollout.static_cache import StaticCacheRollout
    from hpcrl.jobspec.memory import Gpus, plan_memory
    from hpcrl.models import load_causal_lm
    from hpcrl.models.causal_lm import create_model_dir
    from hpcrl.models.tokenizer import CharTokenizer
    from hpcrl.ppo.config import TrainConfig

    tok = CharTokenizer("0123456789=")
    model_dir = create_model_dir(tmp_path / "tiny", tok, seed=1)
    cfg = TrainConfig.parse({"data": {"batch_size": 3, "max_prompt_length": 7}, "rollout": {"max_new_tokens": 40,
                                                                                           "n_samples": 2},
                             "optim": {"mini_batch_size": 6, "micro_batch_size": 6}, "algorithm": {"kl_coef": 0.0}})
    size = ModelSize.of(model_fields(model_dir))
    plan = plan_memory(cfg, [Gpus("roles.actor_rollout", ("actor_rollout",), 1, 1, 80 * GIB, "test")], size)
    parts = {p.name: p.bytes for p in plan.gpus[0].processes[0].parts}
    engine = StaticCacheRollout(AutoConfig.from_pretrained(model_dir), tok.pad_id, tok.stop_ids, "cpu",
                                dtype=torch.bfloat16)
    engine.load_weights(load_causal_lm(model_dir).state_dict())
    assert parts["rollout weights (bf16)"] == sum(t.nbytes for t in engine._tensors(engine.w))
    prompts = torch.randint(3, 13, (6, 7))
    engine.generate(prompts, torch.ones_like(prompts), SamplingParams(40, temperature=1.0), seed=1)
    (_, buf), = engine.decoders.values()
    assert parts["KV cache"] == sum(k.nbytes + v.nbytes for k, v in buf["cache"])


def test_validate_refuses_7b_full_fine_tuning_ppo_on_one_80gb_gpu_naming_what_would_fit(tmp_path, capsys):
    data = spec(tmp_path, {**PPO, "model": {"path": str(model_folder(tmp_path, "qwen2.5-7b"))}})
    path = written(tmp_path, data)
    assert main(["validate", path, "--offline"]) == 2
    err = capsys.readouterr().err
    assert "roles.actor_rollout: does not fit its GPUs" in err and "Would fit: " in err, err
    assert "Or a partition whose GPUs hold" in err, err
    fits = err.split("Would fit: ")[1].split(". Lower")[0].split(". Or a partition")[0].split("; ")
    for fix in fits:        # each change offered, made, passes
        overrides, _, planned = fix.partition(" → ")
        assert main(["validate", path, "--offline", *overrides.split()]) == 0, fix
        out = capsys.readouterr().out
        assert "GPU memory planned" in out and f"{float(planned.split()[0]):.1f}" in out, (fix, out)


def test_plan_gives_every_part_by_phase_and_json(tmp_path, capsys):
    data = spec(tmp_path, {**PPO, "optim": {"micro_batch_size": 2, "mini_batch_size": 64}})
    path = written(tmp_path, data)
    assert main(["plan", path, "--shape", "qwen2.5-1.5b"]) == 0
    out = capsys.readouterr().out
    assert "model: 1.544 B parameters" in out and "critic: optimizer" in out and "actor_rollout: KV cache" in out, out
    assert main(["plan", path, "--shape", "qwen2.5-1.5b", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    (gpu,) = got["gpus"]
    assert [p["roles"] for p in gpu["processes"]] == [["actor_rollout", "critic", "ref"], ["actor_rollout+critic+ref standby"]]
    assert main(["plan", path, "--shape", "qwen2.5-7b"]) == 2      # does not fit: the fixes go to stderr
    assert "Would fit" in capsys.readouterr().err


def test_roles_sharing_gpus_must_share_processes(tmp_path, capsys):
    """Each process holds a GPU of its own: GPU roles of one component must be colocated (the rule
    reward holds none: it runs beside them); GPU roles on components of their own are processes of
    their own, and the plan adds up each GPU's."""
    data = spec(tmp_path, PPO, roles=ONE_GPU)
    assert main(["validate", written(tmp_path, data), "--offline"]) == 2
    assert "roles ['actor_rollout', 'critic', 'ref'] share this component's GPUs" in capsys.readouterr().err
    apart = {"actor_rollout": {"partition": "h100", "gpus_per_node": 1, "gpu_type": "h100"},
             "critic": {"partition": "h100", "gpus_per_node": 1, "gpu_type": "h100"},
             "ref": {"partition": "a100", "gpus_per_node": 1, "gpu_type": "a100", "gpu_mem": "80G"},
             "reward": {"same_nodes_as": "ref"}}
    plan = memory_plan(load_spec(written(tmp_path, spec(tmp_path, PPO, roles=apart, name="apart"))), shape="qwen2.5-0.5b")
    assert [[p.roles for p in g.processes] for g in plan.gpus] == [[(r,), (f"{r} standby",)] for r in ("actor_rollout", "critic", "ref")]
    assert plan.gpus[2].gpus.memory == 80 * 2**30


@pytest.mark.parametrize("gpu_type, gib", [("h100", 79.6), ("H200", 140.4), ("a100_80gb", 74.5), ("a100-40g", 37.3),
                                           ("a100", 40.0), ("l40s", 45.0), ("a10g", 22.5), ("v100_32gb", 29.8)])
def test_gpu_types_name_their_memory(gpu_type, gib):
    assert gpu_memory(gpu_type)[0] / GIB == pytest.approx(gib, abs=0.1)


def test_a_gpu_of_unknown_memory_is_planned_not_judged_and_gpu_mem_sets_it(tmp_path):
    roles = {"actor_rollout": {"partition": "h100", "gpus_per_node": 1, "gpu_type": "mygpu"}, "reward": {"partition": "cpu"}}
    grpo = {**PPO, "algorithm": {"advantage": "grpo", "kl_coef": 0.0}}
    plan = memory_plan(load_spec(written(tmp_path, spec(tmp_path, grpo, roles))), shape="qwen2.5-7b")
    assert plan.gpus[0].fits is None and plan.fits and "not a GPU type hpcrl knows" in plan.gpus[0].gpus.source
    roles["actor_rollout"]["gpu_mem"] = "24G"
    plan = memory_plan(load_spec(written(tmp_path, spec(tmp_path, grpo, roles, "m"))), shape="qwen2.5-7b")
    assert plan.gpus[0].gpus.memory == 24 * 2**30 and plan.gpus[0].fits is False


def test_an_unreadable_model_is_a_note_not_a_refusal(tmp_path, capsys):
    data = spec(tmp_path, {**PPO, "model": {"path": str(tmp_path / "not-here")}})
    plan = memory_plan(load_spec(written(tmp_path, data)))
    assert plan.fits and not plan.gpus and "hpcrl plan SPEC --shape" in plan.notes[0]


def test_validating_a_gpu_spec_plans_it_without_torch_or_transformers(tmp_path):
    """The plan is arithmetic: `hpcrl validate` on a login node must not pay for importing torch (a
    second and more) to make it."""
    import subprocess
    import sys

    path = written(tmp_path, spec(tmp_path, PPO))
    code = ("import sys; from hpcrl.cli import main; rc = main(['validate', sys.argv[1], '--offline', "
            "'train.lora.rank=16']); print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 []", out


def test_the_roles_planned_on_gpus_are_those_whose_workers_hold_one():
    """hpcrl.jobspec.checks.gpu_roles (which must import no worker) against the workers' uses_gpus."""
    from hpcrl.jobspec.checks import gpu_roles
    from hpcrl.ppo.config import TrainConfig
    from hpcrl.ppo.loop import worker_classes

    for cfg in (TrainConfig.parse({"rollout": {"own_role": True}, "environment": {"cls": "hpcrl.environments:ToolEnvironment"}}),
                TrainConfig.parse({"reward": {"model_dir": "somewhere"}})):
        assert gpu_roles(cfg) == [r for r, cls in worker_classes(cfg).items() if cls.uses_gpus], cfg.roles()
