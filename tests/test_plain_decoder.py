"""Qwen2 and Llama in plain torch (hpcrl/models/plain_decoder.py) against transformers' loaded from the
same directory (the tiny Qwen2 a run builds, untied and tied, and SmolLM2, a Llama): the same
parameter names, and the same logits, values, gradients and cached decoding on every input layout
the engines use; and the roles build their engines and tokenizers without importing transformers. On the pinned versions every comparison below is bitwise equal; the
tolerance is for the lowest versions (.ci/test-lowest), whose attention may take another kernel."""
import subprocess
import sys

import pytest
import torch
from conftest import saved_model
from transformers import AutoModel, AutoModelForCausalLM

from hpcrl.models import CharTokenizer, ValueModel, create_model_dir, load_causal_lm, plain_decoder, tiny_qwen2_config
from hpcrl.models.causal_lm import position_ids
from hpcrl.models.packing import Packed
from hpcrl.ppo.tasks import copy_digits

TOK = CharTokenizer(copy_digits.ALPHABET)
SEED = 5


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", params=["untied", "tied", "smollm2"])
def model_dir(request, tmp_path_factory):
    """The tiny model a run builds; one whose output layer is its input embedding; SmolLM2-135M-Instruct
    (a Llama: no biases, grouped-query attention, tied)."""
    if request.param == "smollm2":
        from hpcrl.models.smollm2 import fetch

        return fetch()
    path = tmp_path_factory.mktemp("plain") / "model"
    if request.param == "untied":
        return create_model_dir(path, TOK, seed=0)
    config = tiny_qwen2_config(TOK.vocab_size)
    config.tie_word_embeddings = True
    return saved_model(path, config, TOK)


def rows(seed: int = SEED):
    """Three left-padded rows of different lengths, their mask and positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TOK.vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids, mask, position_ids(mask)


def both(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    plain = load_causal_lm(model_dir, plain=True)
    assert isinstance(plain, plain_decoder.DecoderForCausalLM)
    return hf, plain


def test_the_plain_model_has_transformers_names_and_logits(model_dir):
    hf, plain = both(model_dir)
    assert plain.state_dict().keys() == hf.state_dict().keys()
    for name, value in hf.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    ids, mask, pos = rows()
    real = mask.bool()
    for keep in (0, 4):
        a = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
        b = plain(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
        same(b[real[:, -a.shape[1]:]], a[real[:, -a.shape[1]:]])
    # packed: the same rows as one, positions restarting at each (no mask), a tensor of positions kept
    pk = Packed.of(ids, mask)
    keep = torch.tensor([0, 5, 6, 13, 20])
    a = hf(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, logits_to_keep=keep).logits
    b = plain(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, logits_to_keep=keep).logits
    same(b, a)
    # which is not the rows run unpacked as one sequence: the sequences were kept apart
    whole = plain(input_ids=pk.input_ids, use_cache=False).logits[:, keep]
    assert not torch.allclose(whole, b, atol=1e-3)


def test_cached_decoding_gives_the_logits_transformers_gives(model_dir):
    hf, plain = both(model_dir)
    ids, mask, pos = rows()
    a = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    b = plain(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    g = torch.Generator().manual_seed(SEED + 1)
    for _ in range(3):
        tok = torch.randint(3, TOK.vocab_size, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        pos = pos[:, -1:] + 1
        a = hf(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=a.past_key_values, use_cache=True)
        b = plain(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=b.past_key_values, use_cache=True)
        same(b.logits, a.logits)
    assert b.past_key_values.get_seq_length() == mask.shape[1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_are_transformers_with_and_without_checkpointing(model_dir, checkpointing):
    hf, plain = both(model_dir)
    if checkpointing:
        for m in (hf, plain):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, pos = rows()
    for m in (hf, plain):
        m.train()
        logits = m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        torch.log_softmax(logits[mask.bool()], -1)[:, 4].mean().backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in plain.named_parameters():
        same(p.grad, grads[name])


def test_the_critic_backbone_gives_transformers_hidden_states(model_dir):
    torch.manual_seed(SEED)
    plain = ValueModel(model_dir, plain=True)
    torch.manual_seed(SEED)
    hf = ValueModel(model_dir)
    assert isinstance(plain.backbone, plain_decoder.DecoderModel) and not isinstance(hf.backbone, plain_decoder.DecoderModel)
    assert plain.state_dict().keys() == hf.state_dict().keys()
    same(plain.head.weight, hf.head.weight)
    ids, mask, _ = rows()
    same(plain(ids, mask)[mask.bool()], hf(ids, mask)[mask.bool()])
    same(plain(ids, mask, packed=True), hf(ids, mask, packed=True))
    reference = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    same(plain.backbone(ids, mask, position_ids(mask)).last_hidden_state[mask.bool()],
         reference(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state[mask.bool()])


def test_what_the_plain_module_does_not_implement_loads_through_transformers(tmp_path, model_dir):
    """The same model with its weights in shards, or with RoPE scaling, is transformers' to load."""
    assert plain_decoder.loads(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    hf.save_pretrained(tmp_path / "shards", max_shard_size="100MB" if hf.num_parameters() > 1e8 else "40KB")
    hf.config.rope_parameters = {**(hf.config.rope_parameters or {}), "rope_type": "linear", "factor": 2.0}
    hf.save_pretrained(tmp_path / "scaled")
    for other in ("shards", "scaled"):
        assert not plain_decoder.loads(tmp_path / other), other
        assert not isinstance(load_causal_lm(tmp_path / other, plain=True), plain_decoder.DecoderForCausalLM), other


def test_the_plain_config_gives_the_static_cache_engine_the_shape_transformers_config_gives(model_dir):
    """What a GPU rollout reads of config.json without transformers (its StaticCacheRollout's sizes)."""
    from transformers import AutoConfig

    from hpcrl.models.shape import Shape, rope_theta

    plain, hf = plain_decoder.read_config(model_dir), AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert Shape.of(plain) == Shape.of(hf) and rope_theta(plain) == rope_theta(hf)
    assert (plain.model_type, plain.rms_norm_eps, plain.max_position_embeddings) == \
        (hf.model_type, hf.rms_norm_eps, hf.max_position_embeddings)


def test_the_roles_build_their_engines_without_transformers(model_dir):
    """The actor (with its sampler), the critic, the reference and the rollout (with its tokenizer),
    in a fresh process (this one has imported transformers): none imports it. A LoRA actor does (peft
    adapts transformers' classes)."""
    code = f"""
import sys, torch
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import make_train_engine
from hpcrl.ppo.roles.rollout import make_rollout_engine
cfg, cpu, d = TrainConfig(), torch.device("cpu"), {str(model_dir)!r}
actor = make_train_engine(cfg, d, "log_probs", cpu, 1e-3)
make_rollout_engine(cfg, d, 0, cpu, actor), make_train_engine(cfg, d, "values", cpu, 1e-3)
make_train_engine(cfg, d, "log_probs", cpu, None), make_rollout_engine(cfg, d, 0, cpu)
print("transformers" in sys.modules)
cfg.lora.rank = 4
make_train_engine(cfg, d, "log_probs", cpu, 1e-3)
print("transformers" in sys.modules)
"""
    pytest.importorskip("peft")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("shards", [False, True], ids=["one-file", "sharded"])
def test_saved_weights_are_what_transformers_loads_from_one_file_or_shards(tmp_path, shards):
    """What a GPU rollout engine reads without building the model (models.saved_weights): every
    parameter transformers loads from the folder, by the same name, bitwise."""
    from hpcrl.models import saved_weights

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_qwen2_config(TOK.vocab_size)).save_pretrained(
        tmp_path, **({"max_shard_size": "40KB"} if shards else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == shards
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).state_dict()
    weights = saved_weights(tmp_path)
    assert weights.keys() == loaded.keys()
    assert all(torch.equal(weights[k], loaded[k]) for k in loaded)
    assert saved_weights(tmp_path / "nothing") is None
