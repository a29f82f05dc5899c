"""LoRA adapters (train.lora: hpcrl/engines/train/lora.py) with real peft on a real tiny Qwen2 (CPU):
the merged weights the rollout gets against peft's own merge_and_unload, sampling through the adapted
module, GRPO steps that move only the adapters, a bitwise resume, and `hpcrl export` as a peft
adapter folder and merged, from a real local PPO run whose critic trains adapters too."""
import numpy as np
import pytest
import torch
from conftest import run_local
from test_checkpoint import same

from hpcrl.algo import FixedKLController
from hpcrl.checkpoint.format import read_role_file
from hpcrl.cli import main
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.controller import local_worker
from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.torch_rollout import TorchRollout
from hpcrl.engines.train.lora import load_adapter_state, lora_config
from hpcrl.models import CharTokenizer, load_causal_lm
from hpcrl.ppo.config import ConfigError, TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.loop import compute_advantages, prepare_inputs
from hpcrl.ppo.roles import ActorRollout, RuleReward
from hpcrl.ppo.roles.common import make_train_engine
from hpcrl.ppo.tasks import copy_digits as copy_task

peft = pytest.importorskip("peft")

TOK = CharTokenizer(copy_task.ALPHABET)
N = 4
CFG = TrainConfig().updated(batch_size=8, n_samples=N, mini_batch_size=32, micro_batch_size=16, ppo_epochs=1,
                            warmup_steps=0, actor_lr=1e-2, entropy_coef=0.0, kl_coef=0.0,
                            algorithm={"advantage": "grpo"}, lora={"rank": 4, "alpha": 8.0})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return prepare_inputs(CFG, tmp_path_factory.mktemp("lora"))


def adapted_engine(model_dir, seed=3):
    """The actor's LoRA engine with B drawn at random (B = 0 at the start would merge to the base)."""
    engine = make_train_engine(CFG, str(model_dir), "log_probs", torch.device("cpu"), CFG.optim.actor_lr)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return engine


def test_the_rollout_gets_peft_merge_and_unload_by_the_plain_model_names(inputs):
    model_dir, _ = inputs
    engine = adapted_engine(model_dir)
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert [p for g in engine.optimizer.param_groups for p in g["params"]] == \
        [p for p in engine.module.parameters() if p.requires_grad]
    merged = engine.full_weights()
    base = load_causal_lm(model_dir).state_dict()
    assert merged.keys() == base.keys()
    reference = peft.get_peft_model(load_causal_lm(model_dir), lora_config(CFG.lora))
    reference.base_model.model.load_state_dict(engine.module.state_dict())
    want = reference.merge_and_unload().state_dict()
    assert all(torch.equal(merged[k], want[k]) for k in want)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_sampling_through_the_adapted_module_samples_the_merged_model(inputs):
    """CPU: TorchRollout samples with the training module itself, adapters included; a plain model
    that loaded the merged weights (a separate rollout) draws the same tokens, the base does not."""
    model_dir, prompts = inputs
    engine = adapted_engine(model_dir)
    merged = load_causal_lm(model_dir)
    merged.load_state_dict(engine.full_weights())
    batch = PromptDataset(prompts, TOK, 16, 1).next_batch()
    params = SamplingParams(CFG.rollout.max_new_tokens, 1.0, 1.0, 0)

    def sample(model):
        return TorchRollout(model, TOK.pad_id, TOK.stop_ids).generate(batch["prompt_ids"], batch["prompt_mask"], params, 5)
    adapted, plain, base = sample(engine.module), sample(merged), sample(load_causal_lm(model_dir))
    assert torch.equal(adapted["responses"], plain["responses"])
    torch.testing.assert_close(adapted["rollout_log_probs"], plain["rollout_log_probs"], atol=1e-5, rtol=1e-5)
    assert (adapted["rollout_log_probs"] - base["rollout_log_probs"]).abs().max() > 1e-3



def test_the_reference_is_the_actors_base_with_its_adapters_off(inputs):
    """With LoRA and a KL term there is no ref role: the actor's compute_log_prob gives log π_ref too,
    its module with the adapters switched off, which is what a separate reference of the base
    computes (bitwise on CPU); the adapters are on again after it."""
    from hpcrl.ppo.roles import Reference

    model_dir, prompts = inputs
    cfg = CFG.updated(algorithm={"kl_coef": 0.01})
    assert cfg.reference_in_actor and "ref" not in cfg.roles() and "ref" in CFG.updated(lora={"rank": 0}, algorithm={
        "kl_coef": 0.01}).roles()
    actor = local_worker(ActorRollout, str(model_dir), cfg, role="actor_rollout")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in actor.engine.module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    batch = PromptDataset(prompts, TOK, 8, 1).next_batch()
    batch.meta["step"] = 1
    batch = actor.generate_sequences(batch)
    scored = actor.compute_log_prob(batch)
    want = local_worker(Reference, str(model_dir), cfg, role="ref").compute_ref_log_prob(batch)["ref_log_probs"]
    assert torch.equal(scored["ref_log_probs"], want)
    assert (scored["old_log_probs"] - want).abs().max() > 1e-3      # the adapted policy differs from the base
    assert torch.equal(actor.compute_log_prob(batch)["old_log_probs"], scored["old_log_probs"])

def grpo_batch(actor, reward, prompts, step):
    """One GRPO step's batch: N responses per prompt, scored by the copy task's rule."""
    data = PromptDataset(prompts, TOK, CFG.data.batch_size, CFG.seed + step)
    p = data.next_batch().repeat(N)
    p["group"] = np.repeat(np.arange(CFG.data.batch_size), N)
    p.meta["step"] = step
    batch = actor.generate_sequences(p)
    batch = batch.union(actor.compute_log_prob(batch)).union(reward.compute_scores(batch))
    compute_advantages(batch, CFG, FixedKLController(0.0))
    return batch


def test_grpo_steps_move_only_the_adapters_and_resume_bitwise(inputs, tmp_path):
    model_dir, prompts = inputs
    actor = local_worker(ActorRollout, str(model_dir), CFG)
    reward = local_worker(RuleReward, str(model_dir), CFG.reward_function())
    first = grpo_batch(actor, reward, prompts, 1)
    for step in (1, 2, 3):
        actor.update_actor(grpo_batch(actor, reward, prompts, step))
    base = load_causal_lm(model_dir).state_dict()
    now = actor.engine.module.state_dict()
    frozen = {k: v for k, v in now.items() if ".lora_" not in k}
    assert len(frozen) == len(base)
    assert all(torch.equal(v, base[k.replace(".base_layer.", ".")]) for k, v in frozen.items()), "a base weight moved"
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in now.items() if ".lora_B." in k)
    moved = (actor.compute_log_prob(first)["old_log_probs"] - first["old_log_probs"]) * first["response_mask"]
    assert moved.abs().max() > 1e-3, "the policy did not move"

    state = actor.checkpoint_state()     # the adapters, their AdamW moments and the scheduler: no base
    assert state["model"].keys() == {k for k in now if ".lora_" in k}
    assert len(state["optimizer"]["state"]) == len(state["model"])
    actor.save_checkpoint(str(tmp_path / "actor.h5"), step=3)
    fresh = local_worker(ActorRollout, str(model_dir), CFG)
    assert not same(fresh.checkpoint_state()["model"], state["model"])
    fresh.load_checkpoint(str(tmp_path / "actor.h5"))
    assert same(fresh.checkpoint_state(), actor.checkpoint_state())
    last = grpo_batch(actor, reward, prompts, 4)
    again = grpo_batch(fresh, reward, prompts, 4)     # samples with the resumed adapters alike
    assert all(same(last[k], again[k]) for k in ("responses", "old_log_probs", "advantages"))
    actor.update_actor(last), fresh.update_actor(last)     # one more step on both: still bitwise equal
    assert same(fresh.checkpoint_state(), actor.checkpoint_state())
    assert same(fresh.engine.full_weights(), actor.engine.full_weights())


def test_lora_with_megatron_or_no_layer_to_adapt_is_refused(inputs):
    with pytest.raises(ConfigError, match=r"train.lora.rank: LoRA adapters need engine.backend: torch"):
        TrainConfig.parse({"lora": {"rank": 8}, "engine": {"backend": "megatron"}})
    with pytest.raises(ConfigError, match=r"train.lora.target_modules: 'q_proj' is neither"):
        TrainConfig.parse({"lora": {"rank": 8, "target_modules": "q_proj"}})
    cfg = CFG.updated(lora={"target_modules": ["qkv"]})
    with pytest.raises(ValueError, match=r"train.lora.target_modules: .*qkv"):
        make_train_engine(cfg, str(inputs[0]), "log_probs", torch.device("cpu"), 1e-3)


def test_a_ppo_run_exports_its_adapter_for_peft_and_merged(tmp_path):
    """A real local PPO run (critic with adapters too; a rollout role apart, which loads the actor's
    merged weights by name after every update), then `hpcrl export`: the adapter folder that
    peft loads onto the base computes what the trained actor does; --merged is a plain HF model
    of the same outputs; the critic exports merged as a token classifier of the trained values."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = TrainConfig(total_steps=2, progress=False).updated(batch_size=8, mini_batch_size=8, micro_batch_size=8,
                                                             warmup_steps=0, lora={"rank": 4, "alpha": 8.0},
                                                             rollout={"own_role": True})
    records = run_local(tmp_path / "run", cfg)
    # step 2 samples with step 1's merged weights and the actor recomputes them with its adapters
    assert records[-1]["rollout/log_prob_diff"] < 1e-5, records[-1]
    store = CheckpointStore(tmp_path / "run")
    _, manifest = store.latest_good()
    files = {role: store.root / entry["path"] for role, entry in manifest["roles"].items()}
    model_dir = tmp_path / "run" / "model"
    critic_state = read_role_file(files["critic"])[0]["role"]["model"]
    assert critic_state.keys() - {"head.weight", "head.bias"} and all(
        ".lora_" in k for k in critic_state.keys() - {"head.weight", "head.bias"})

    def export(out, *flags):     # the command line's own parsing and wiring, in this process
        assert main(["export", str(tmp_path / "run"), str(tmp_path / out), *flags]) == 0
        return tmp_path / out
    adapter, merged = export("adapter"), export("merged", "--merged")
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}

    actor = local_worker(ActorRollout, str(model_dir), cfg)
    actor.load_checkpoint(str(files["actor_rollout"]))
    ids = torch.tensor([TOK.encode("12=34"), TOK.encode("56=78")])
    with torch.no_grad():
        trained = actor.engine.module(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(load_causal_lm(model_dir), adapter).eval()
        assert torch.equal(loaded(input_ids=ids).logits, trained)
        plain = AutoModelForCausalLM.from_pretrained(merged).eval()
        torch.testing.assert_close(plain(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(load_causal_lm(model_dir)(input_ids=ids).logits, trained, atol=1e-4)

        critic = export("critic", "--role", "critic")
        values = AutoModelForTokenClassification.from_pretrained(critic).eval()(input_ids=ids).logits[..., 0]
        engine = make_train_engine(cfg, str(model_dir), "values", torch.device("cpu"), 1e-3)
        load_adapter_state(engine.module, critic_state)
        want = engine.module(ids, torch.ones_like(ids))
        torch.testing.assert_close(values, want, atol=1e-5, rtol=1e-5)
