"""vLLM on the GPU (the H200 machine, with bench/gpu_wheels.sh's vLLM; skipped without CUDA or vLLM):
after an in-place weight update its greedy generations are HF generate's with the same weights, its
log-probs are the trainer's, and sleeping frees the GPU memory a colocated trainer needs.

    python -m pytest tests/gpu/test_vllm_gpu.py -q
"""
import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
vllm = pytest.importorskip("vllm")
VOCAB, PROMPT, NEW = 4099, 24, 32


def random_weights(seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=1408, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The engine started from model A's folder, model B's weights, and the prompts."""
    from hpcrl.engines.rollout.vllm_rollout import VLLMRollout

    work = tmp_path_factory.mktemp("vllm")
    random_weights(0).save_pretrained(work / "a")
    engine = VLLMRollout(work / "a", pad_id=0, eos_ids=[], cache_dir=work / "cache", dtype="bfloat16",
                         max_model_len=PROMPT + NEW, gpu_memory_utilization=0.15, seed=0)
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(8, PROMPT, dtype=torch.long)
    for i, pad in enumerate([0, 3, 0, 9, 1, 0, 12, 4]):
        mask[i, :pad] = 0
    ids = torch.randint(3, VOCAB, (8, PROMPT), generator=g) * mask
    return engine, random_weights(1), ids, mask


def hf_logits(model, prefix: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prefix], device="cuda")).logits[0, -1].float()


def test_greedy_after_update_is_hf_generate(setup):
    """vLLM (bf16 kernels) against HF (fp32 on the same bf16 weights): each row's tokens agree until a
    near-tie, a step where HF's two best logits are within bf16's noise of each other."""
    from hpcrl.engines.base import SamplingParams

    engine, b, ids, mask = setup
    engine.load_weights({k: v.cuda() for k, v in b.state_dict().items()})
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, temperature=0.0), seed=0)
    hf, before = b.float().cuda().eval(), random_weights(0).float().cuda().eval()
    changed = sum(int(out["responses"][i, 0]) != int(hf_logits(before, ids[i][mask[i].bool()].tolist()).argmax())
                  for i in range(len(ids)))
    assert changed >= 6, f"only {changed} of 8 first tokens differ from the old weights' greedy ones"
    agreed = 0
    for i in range(len(ids)):
        prompt = ids[i][mask[i].bool()].tolist()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, pad_token_id=0)[0, len(prompt):].tolist()
        got = out["responses"][i].tolist()
        k = next((j for j, (x, y) in enumerate(zip(got, ref)) if x != y), NEW)
        agreed += k
        if k < NEW:       # the first difference must be a near-tie under HF's own logits
            logits = hf_logits(hf, prompt + ref[:k])
            assert logits[ref[k]] - logits[got[k]] < 0.05 * logits.abs().max(), (i, k, got[k], ref[k])
    # random weights have many near-ties; on the H100, 174 of 256 tokens came before each row's first
    assert agreed >= 0.5 * len(ids) * NEW, agreed


def test_log_probs_are_the_trainers(setup):
    """Sampled at T=1: vLLM's log-probs of its tokens against HF's recomputed ones (fp32): what the
    rollout/log_prob_diff metric reports during training."""
    from hpcrl.engines.base import SamplingParams
    from hpcrl.models import response_log_probs

    engine, b, ids, mask = setup
    engine.load_weights({k: v.cuda() for k, v in b.state_dict().items()})
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, temperature=1.0), seed=3)
    hf = b.float().cuda().eval()
    full = torch.cat([ids, out["responses"]], 1).cuda()
    attention = torch.cat([mask, out["response_mask"]], 1).cuda()
    with torch.no_grad():
        ref, _ = response_log_probs(hf, full, attention, out["responses"].cuda())
    m = out["response_mask"].bool()
    diff = (out["rollout_log_probs"][m] - ref.cpu()[m]).abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.5, (float(diff.mean()), float(diff.max()))


def test_sleep_frees_memory_and_wakes_with_new_weights(setup):
    from hpcrl.engines.base import SamplingParams

    engine, b, ids, mask = setup
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    engine.load_weights({k: v.cuda() for k, v in b.state_dict().items()})
    before = engine.generate(ids, mask, greedy, seed=0)["responses"]
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert freed > 1 << 30, f"sleeping freed {freed / 2**30:.2f} GiB"      # the KV cache (most of 0.15 of the GPU)
    engine.load_weights({k: v.cuda() for k, v in b.state_dict().items()})     # wakes up, then loads
    assert torch.equal(engine.generate(ids, mask, greedy, seed=0)["responses"], before)
