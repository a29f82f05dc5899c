"""Engine pieces that run without a GPU: the static-cache sampler against HF's forward, the
HF ⇄ megatron weight layouts for every tensor/pipeline split (the GPU tests in tests/gpu/ check
that megatron computes with them what HF does), megatron's attention and optimizer kernels against
references, the chunked output layer of response_log_probs against the model's own logits, and
where torch.compile's caches go."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.static_cache import StaticCacheRollout
from hpcrl.engines.train.megatron_layout import to_hf, to_megatron
from hpcrl.models import ValueModel, causal_lm, position_ids, response_log_probs, tiny_qwen2_config
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



def test_a_static_cache_engine_that_releases_its_memory_samples_as_one_that_keeps_it():
    """rollout.release_memory: after sleep() the weights, cache and graphs are gone; the next generate
    takes the trainer's weights again (here: the model's state dict) and draws what the kept engine draws."""
    torch.manual_seed(0)
    cfg = qwen2()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    kept = StaticCacheRollout(cfg, pad_id=0, eos_ids=[2], device="cpu", check_every=4)
    kept.load_weights(model.state_dict())
    released = StaticCacheRollout(cfg, pad_id=0, eos_ids=[2], device="cpu", check_every=4, reload=model.state_dict)
    released.load_weights(model.state_dict())
    ids = torch.randint(3, cfg.vocab_size, (5, 7))
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=9, temperature=0.7)
    for seed in (3, 4):
        want = kept.generate(ids, mask, params, seed)
        got = released.generate(ids, mask, params, seed)
        released.sleep()
        assert released.w is None and not released.decoders
        assert all(torch.equal(want[k], got[k]) for k in want), seed

def test_sample_token_draws_from_the_filtered_distribution():
    """The exponential race (argmax p/E) against the distribution itself, computed in numpy:
    frequencies of 200,000 draws from 6 tokens at temperature 0.8, with and without top-k, and each
    draw's log-probability."""
    import numpy as np

    from hpcrl.engines.rollout.torch_rollout import draw_noise, sample_token

    z = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    logits = torch.tensor(z, dtype=torch.float32).repeat(200_000, 1)
    generator = torch.Generator().manual_seed(1)
    for top_k in (0, 3):
        params = SamplingParams(temperature=0.8, top_k=top_k)
        keep = z >= np.sort(z)[-top_k] if top_k else np.ones_like(z, dtype=bool)
        p = np.where(keep, np.exp(z / 0.8), 0.0)
        p /= p.sum()
        tok, logp = sample_token(logits, params, draw_noise(logits.shape, params, generator))
        freq = np.bincount(tok.numpy(), minlength=6) / len(tok)
        assert np.abs(freq - p).max() < 0.005, (top_k, freq, p)      # 5 standard deviations at most
        assert np.allclose(logp.numpy(), np.log(p[tok.numpy()]), atol=1e-5)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_equals_the_full_logits_with_gradients(tied, monkeypatch):
    """response_log_probs's output layer in chunks of 7 of the 3 × 9 response positions against
    log_softmax and entropy of the model's own logits: values and parameter gradients of a loss of
    both, in fp32 and under bf16 autocast, and of the log-probs alone."""
    from hpcrl.algo import entropy_from_logits

    torch.manual_seed(4)
    cfg = tiny_qwen2_config(vocab_size=1000, hidden_size=64, heads=2, kv_heads=1, intermediate_size=96)
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg)
    prompt_mask = torch.ones(3, 6, dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[2, :5] = 0                 # left padding
    response_mask = torch.ones(3, 9, dtype=torch.long)
    response_mask[0, 4:] = response_mask[2, 7:] = 0             # right padding
    responses = torch.randint(3, 1000, (3, 9)) * response_mask
    ids = torch.cat([torch.randint(3, 1000, (3, 6)) * prompt_mask, responses], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    weights, t = torch.randn(3, 9) * response_mask, 0.7
    params = list(model.parameters())

    def reference():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
        z = logits[:, -10:-1].float() / t
        return torch.log_softmax(z, -1).gather(-1, responses[..., None]).squeeze(-1), entropy_from_logits(z)

    chunks, chunk_log_softmax = [], causal_lm._chunk_log_softmax
    monkeypatch.setattr(causal_lm, "_chunk_log_softmax",
                        lambda h, *a: chunks.append(len(h)) or chunk_log_softmax(h, *a))
    for bf16, tol in [(False, 1e-5), (True, 2e-2)]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logp, ent = response_log_probs(model, ids, mask, responses, t, with_entropy=True, chunk_tokens=7)
            grads = torch.autograd.grad((logp * weights).sum() + 0.3 * (ent * response_mask).sum(), params)
            want_logp, want_ent = reference()
            want = torch.autograd.grad((want_logp * weights).sum() + 0.3 * (want_ent * response_mask).sum(), params)
        assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (3, 9)
        torch.testing.assert_close(logp, want_logp, atol=tol, rtol=tol)
        torch.testing.assert_close(ent, want_ent, atol=tol, rtol=tol)
        for p, g, w in zip(params, grads, want, strict=True):
            assert rel(g, w) < tol, (bf16, [n for n, q in model.named_parameters() if q is p])
    assert chunks == [7, 7, 7, 6] * 4      # forward and backward, fp32 and bf16: several chunks each

    logp, ent = response_log_probs(model, ids, mask, responses, t, chunk_tokens=7)
    grads = torch.autograd.grad((logp * weights).sum(), params)
    want = torch.autograd.grad((reference()[0] * weights).sum(), params)
    assert ent is None
    for g, w in zip(grads, want, strict=True):
        assert rel(g, w) < 1e-5


def test_chunked_head_of_bf16_weights_sums_its_weight_gradient_in_fp32():
    """head_log_probs on bf16 hidden states and weight (megatron-core's parameters), 256 positions
    in 32 chunks: log-probs, entropy and both gradients against fp64 full logits of the same inputs,
    within one bf16 rounding (the weight gradient's 32 chunk products summed in fp32, cast once)."""
    torch.manual_seed(5)
    h = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(500, 64) / 8).to(torch.bfloat16).requires_grad_()
    y, g, e, t = torch.randint(0, 500, (256,)), torch.randn(256), torch.randn(256), 0.7
    logp, ent = causal_lm.head_log_probs(h, w, y, t, with_entropy=True, chunk_tokens=8)
    grad_h, grad_w = torch.autograd.grad((logp * g).sum() + (ent * e).sum(), [h, w])
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.T / t, -1)
    want_logp, want_ent = lp.gather(1, y[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)
    want_h, want_w = torch.autograd.grad((want_logp * g).sum() + (want_ent * e).sum(), [h64, w64])
    assert grad_w.dtype == grad_h.dtype == torch.bfloat16 and logp.dtype == ent.dtype == torch.float32
    for got, want in [(logp, want_logp), (ent, want_ent), (grad_h, want_h), (grad_w, want_w)]:
        assert rel(got.double(), want) < 5e-3, rel(got.double(), want)   # bf16 sums: 7e-3 for the weight


def test_megatron_sdpa_attention_equals_masked_softmax_attention():
    """megatron_layer's SDPA path against attention written out in fp64 (scores, megatron's mask
    as -inf, softmax, values), in megatron's [s, b, heads, d] layout with 4 query heads on 2 KV heads:
    left-padded rows (a pad query sees itself) and, without padding, the causal kernel (mask None)."""
    from hpcrl.engines.train.megatron_layer import attention_mask, sdpa_attention

    torch.manual_seed(6)
    s, b, d, scale = 7, 3, 16, 0.3
    q, k, v = torch.randn(s, b, 4, d), torch.randn(s, b, 2, d), torch.randn(s, b, 2, d)
    rows = torch.ones(b, s, dtype=torch.long)
    rows[1, :2] = rows[2, :5] = 0

    def reference(masked):
        qh, kh, vh = (x.double().permute(1, 2, 0, 3) for x in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
        scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(masked, float("-inf"))
        return (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(s, b, -1)

    masked = attention_mask(rows)
    assert masked.shape == (b, 1, s, s) and not masked[2, 0, 1, 1] and masked[2, 0, 1, 0]   # a pad query: itself only
    assert rel(sdpa_attention(q, k, v, masked, scale).double(), reference(masked)) < 1e-6
    assert attention_mask(torch.ones(b, s)) is None
    causal = ~torch.ones(s, s, dtype=torch.bool).tril()
    assert rel(sdpa_attention(q, k, v, None, scale).double(), reference(causal)) < 1e-6


def test_megatron_multi_tensor_fallbacks_compute_what_numpy_does():
    """The foreach kernels that stand in for megatron's multi-tensor fallbacks: the l2 norm of a list
    of tensors as one vector (of bf16 ones in fp32), a copy into bf16 (fp32 main weights into the
    model's), a scaled copy, an in-place scale (clipping: the same list twice), and lists that
    share only some tensors."""
    import numpy as np

    from hpcrl.engines.train.megatron_optimizer import foreach_l2_norm, foreach_scale

    torch.manual_seed(7)
    src = [torch.randn(5, 3), torch.randn(11), torch.randn(2, 2, 2)]
    flat = np.concatenate([t.numpy().ravel() for t in src]).astype(np.float64)
    norm, per_tensor = foreach_l2_norm(2048, None, [src], False)
    assert per_tensor is None and norm.shape == (1,) and abs(float(norm) - np.linalg.norm(flat)) < 1e-5
    dst = [torch.zeros_like(t, dtype=torch.bfloat16) for t in src]
    foreach_scale(2048, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dst, src))
    dst = [torch.zeros_like(t) for t in src]
    foreach_scale(2048, None, [src, dst], 0.25)
    assert np.allclose(np.concatenate([d.numpy().ravel() for d in dst]), 0.25 * flat, atol=1e-7)
    grads = [t.clone() for t in src]
    foreach_scale(2048, None, [grads, grads], 0.5)
    assert np.allclose(np.concatenate([g.numpy().ravel() for g in grads]), 0.5 * flat, atol=1e-7)
    halves = [src[0].clone(), torch.zeros(11)]       # partly the same tensors: the first pair scales in place
    foreach_scale(2048, None, [[halves[0], src[1]], halves], 2.0)
    assert torch.allclose(halves[0], 2 * src[0]) and torch.allclose(halves[1], 2 * src[1])
    bf16 = [t.to(torch.bfloat16) for t in src]
    assert abs(float(foreach_l2_norm(2048, None, [bf16], False)[0]) - np.linalg.norm(
        np.concatenate([t.float().numpy().ravel() for t in bf16]))) < 1e-4


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


def test_torch_compile_caches_go_to_the_users_cache_or_the_specs_unless_the_site_set_its_own(tmp_path, monkeypatch):
    """A requeued job and the user's next run find the kernels compiled before: Inductor's cache, as
    torch itself resolves it, is under $XDG_CACHE_HOME/hpcrl by default, or where the spec says, or the
    run's cache folder where the user's cannot be written; a TORCHINDUCTOR_CACHE_DIR already set is kept."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from hpcrl.engines.compile_cache import use_compile_cache

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    use_compile_cache("")
    assert cache_dir() == str(tmp_path / "home-cache" / "hpcrl" / "torch-compile" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home-cache" / "hpcrl" / "torch-compile" / "triton")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var)
    use_compile_cache(tmp_path / "spec")      # train.engine.compile_cache
    assert cache_dir() == str(tmp_path / "spec" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "site"))
    use_compile_cache(tmp_path / "other")
    assert cache_dir() == str(tmp_path / "site")
    # a home that cannot be written (a container's read-only one; here a file where a folder must be):
    # the run's cache folder
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    use_compile_cache("", tmp_path / "run" / "cache")
    assert cache_dir() == str(tmp_path / "run" / "cache" / "inductor")


PROFILED = """
import sys, torch
from hpcrl.engines.compile_cache import use_compile_cache
use_compile_cache(sys.argv[1], job=sys.argv[2])      # before Dynamo's import, as a role calls it
from torch._dynamo.utils import counters
f = torch.compile(lambda x, w: torch.relu(x @ w).sum(-1), backend="eager")
for rows in (3, 5, 7):
    f(torch.randn(rows, 8), torch.ones(8, 8))
print(counters["stats"]["unique_graphs"], torch.compiler.config.job_id)
"""


@pytest.mark.parametrize("own_id", [None, "site-job-7"], ids=["hpcrl's", "TORCH_COMPILE_JOB_ID"])
def test_a_jobs_next_process_traces_symbolic_sizes_at_once(tmp_path, own_id):
    """A requeued start (a new process of the same job, `job` its run's cache folder) finds in the
    compile cache which sizes changed in the start before: Dynamo traces one graph with symbolic sizes,
    not a static one first and another at the second shape. A job id the site set is kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCH_DYNAMO_"))}
    if own_id:
        env["TORCH_COMPILE_JOB_ID"] = own_id

    def start(job: Path) -> tuple[int, str]:
        out = subprocess.run([sys.executable, "-c", PROFILED, str(tmp_path / "cache"), str(job)], env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        return int(out[0]), out[1]

    first, named = start(tmp_path / "run" / "cache")
    assert first == 2 and named == (own_id or named) and named.startswith(own_id or "hpcrl-")
    assert start(tmp_path / "run" / "cache") == (1, named)                  # the requeued start
    assert start(tmp_path / "other-run" / "cache")[0] == (1 if own_id else 2)   # another job: its own profile
