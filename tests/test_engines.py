"""Engine pieces that run without a GPU: the static-cache sampler against HF's forward, and the
HF ⇄ megatron weight layouts for every tensor/pipeline split (the GPU tests in tests/gpu/ check
that megatron computes with them what HF does)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.static_cache import StaticCacheRollout
from hpcrl.engines.train.megatron_layout import to_hf, to_megatron
from hpcrl.models import ValueModel, response_log_probs
from hpcrl.models.shape import Shape


def qwen2(vocab=61, tied=False):
    return Qwen2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def test_static_cache_sampler_log_probs_equal_a_full_forward():
    torch.manual_seed(0)
    cfg = qwen2()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    engine = StaticCacheRollout(cfg, pad_id=0, eos_ids=[2], device="cpu", check_every=4)
    engine.load_weights(model.state_dict())
    ids = torch.randint(3, cfg.vocab_size, (5, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :6] = 0          # left padding of different widths
    ids[mask == 0] = 0
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=9, temperature=0.7, top_k=20), seed=3)
    full = torch.cat([ids, out["responses"]], 1)
    logp, _ = response_log_probs(model, full, torch.cat([mask, out["response_mask"]], 1), out["responses"], 0.7)
    # top-k renormalises: compare where the sampled token's full-softmax probability is the sampler's
    # own distribution, i.e. with top_k off
    out1 = engine.generate(ids, mask, SamplingParams(max_new_tokens=9), seed=3)
    full1 = torch.cat([ids, out1["responses"]], 1)
    logp1, _ = response_log_probs(model, full1, torch.cat([mask, out1["response_mask"]], 1), out1["responses"])
    torch.testing.assert_close(out1["rollout_log_probs"], logp1 * out1["response_mask"], atol=2e-5, rtol=1e-5)
    assert bool((out["rollout_log_probs"] >= logp * out["response_mask"] - 1e-5).all())  # top-k only adds mass
    again = engine.generate(ids, mask, SamplingParams(max_new_tokens=9), seed=3)
    assert torch.equal(again["responses"], out1["responses"])
    # new weights are taken in place
    model2 = AutoModelForCausalLM.from_config(cfg).eval()
    engine.load_weights(model2.state_dict())
    out2 = engine.generate(ids, mask, SamplingParams(max_new_tokens=9), seed=3)
    full2 = torch.cat([ids, out2["responses"]], 1)
    logp2, _ = response_log_probs(model2, full2, torch.cat([mask, out2["response_mask"]], 1), out2["responses"])
    torch.testing.assert_close(out2["rollout_log_probs"], logp2 * out2["response_mask"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tp,pp,tied", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, False)])
def test_megatron_layout_round_trips(tp, pp, tied):
    torch.manual_seed(1)
    cfg = qwen2(vocab=61, tied=tied)          # 61: padded to 62 for TP=2
    hf = AutoModelForCausalLM.from_config(cfg).state_dict()
    s = Shape.of(cfg)
    shards = [[to_megatron(hf, s, tp, t, pp, p) for t in range(tp)] for p in range(pp)]
    # megatron's shapes on each rank, by hand
    qkv = shards[0][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16 // tp, 64)
    assert shards[0][0]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96 // tp, 64)
    assert shards[0][0]["embedding.word_embeddings.weight"].shape == (-(-61 // tp) * tp // tp, 64)
    assert sum(k.startswith("decoder.layers.") and k.endswith("input_layernorm.weight") for k in shards[-1][0]) == 4 // pp
    # rank t's fused qkv holds KV group t's query heads first, then its k, then its v
    q = hf["model.layers.0.self_attn.q_proj.weight"].view(2, 2 * 16, 64)
    k = hf["model.layers.0.self_attn.k_proj.weight"].view(2, 16, 64)
    assert torch.equal(qkv[:32], q[0, :32] if tp == 2 else q[0])
    assert torch.equal(qkv[32:48], k[0])
    back = to_hf(shards, s)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_megatron_layout_of_the_value_model(tmp_path):
    torch.manual_seed(2)
    cfg = qwen2()
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    hf = ValueModel(tmp_path).state_dict()
    s = Shape.of(cfg)
    shards = [[to_megatron(hf, s, 2, t, 1, 0, value_head=True) for t in range(2)]]
    assert shards[0][1]["output_layer.weight"].shape == (1, 64)
    back = to_hf(shards, s, value_head=True)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_layouts_that_do_not_divide_are_refused():
    s = Shape.of(qwen2())
    with pytest.raises(ValueError, match="tensor_parallel: 4 must divide the KV heads"):
        s.check(4, 1)
    with pytest.raises(ValueError, match="pipeline_parallel: 3 must divide"):
        s.check(1, 3)
