"""Sequence packing (optim.pack) on real tiny HF models (Qwen2 and Llama shapes, CPU, fp32): the packed
forward computes what the padded one computes (log-probs, entropy, values), one train step moves the
weights as the padded step does, the token budget counts real tokens, and a short PPO run with
packing trains as one without."""
import pytest
import torch
from conftest import saved_model
from transformers import LlamaConfig

from hpcrl.controller.batch import Batch
from hpcrl.engines.micro_batches import micro_batches
from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
from hpcrl.models import (
    CharTokenizer,
    ValueModel,
    causal_lm,
    create_model_dir,
    load_causal_lm,
    log_probs_head,
    values_head,
)
from hpcrl.models.packing import PACKED
from hpcrl.ppo.config import ConfigError, TrainConfig
from hpcrl.ppo.tasks import copy_digits

TOK = CharTokenizer(copy_digits.ALPHABET)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "qwen2":
        return create_model_dir(path, TOK, seed=0)
    return saved_model(path, LlamaConfig(vocab_size=TOK.vocab_size, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
                                         max_position_embeddings=64), TOK)


def varied_batch(b=10, p=9, r=12, seed=0) -> Batch:
    """[left-padded prompt | right-padded response] rows of varied lengths; the responses are
    multi-turn-like: a span inside some is attended to (attention_mask) but not trained on (response_mask)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len, resp_len = torch.randint(1, p + 1, (b,), generator=g), torch.randint(1, r + 1, (b,), generator=g)
    pm = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    am = (torch.arange(r)[None] < resp_len[:, None]).long()
    rm = am.clone()
    rm[::3, 2:4] = 0                      # an observation inside the response
    prompts = torch.randint(3, TOK.vocab_size, (b, p), generator=g) * pm
    responses = torch.randint(3, TOK.vocab_size, (b, r), generator=g) * am
    return Batch({"prompt_ids": prompts, "prompt_mask": pm, "responses": responses, "response_mask": rm,
                  "input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pm, am], 1),
                  "advantages": torch.randn(b, r, generator=g) * rm, "returns": torch.randn(b, r, generator=g) * rm})


def engines(model_dir, head: str, optim: OptimConfig | None):
    """The same weights in a padded and a packed engine."""
    def one(pack):
        module = ValueModel(model_dir) if head == "values" else load_causal_lm(model_dir)
        if head == "values":
            torch.nn.init.normal_(module.head.weight, generator=torch.Generator().manual_seed(1))
        forward = values_head if head == "values" else log_probs_head(1.0, with_entropy=True)
        return TorchTrainer(module, optim, forward, compile=False, pack=pack)
    return one(False), one(True)


@pytest.mark.parametrize("head", ["log_probs", "full_logits", "values"])
def test_packed_forward_equals_the_padded_one(model_dir, head, monkeypatch):
    if head == "full_logits":       # the path of models whose logits are not a plain linear head
        monkeypatch.setattr(causal_lm, "PLAIN_HEAD_MODEL_TYPES", frozenset())
    batch = varied_batch()
    padded, packed = engines(model_dir, "values" if head == "values" else "log_probs", None)
    want = padded.infer(batch, micro_batch_size=4)
    got = packed.infer(batch, micro_batch_size=4, micro_batch_tokens=40)
    mask = batch["attention_mask"][:, batch["prompt_mask"].shape[1]:]
    for key in want.tensors:
        assert got[key].shape == want[key].shape
        torch.testing.assert_close(got[key] * mask, want[key] * mask, atol=1e-5, rtol=1e-5)


def pg_loss(out, mb, total_tokens, total_seqs):
    m = mb["response_mask"]
    loss = (-(out["log_probs"] * mb["advantages"]) * m).sum() / total_tokens - 0.01 * (out["entropy"] * m).sum() / total_tokens
    return loss, {"pg": float(loss.detach())}


def vf_loss(out, mb, total_tokens, total_seqs):
    m = mb["response_mask"]
    loss = ((out["values"] - mb["returns"]) ** 2 * m).sum() / total_tokens
    return loss, {"vf": float(loss.detach())}


@pytest.mark.parametrize("head", ["log_probs", "values"])
def test_a_packed_train_step_has_the_padded_ones_gradients(model_dir, head):
    """Gradients accumulated over micro-batches grouped differently (padded: rows × widest row ≤ 48
    tokens; packed: Σ real lengths ≤ 48), read from AdamW's first moment after one step (0.1 × the
    gradient; the step itself, ≈ lr·sign(g), would magnify the noise of near-zero gradients)."""
    batch = varied_batch(seed=1)
    optim = OptimConfig(lr=1e-3, micro_batch_size=10, micro_batch_tokens=48, grad_clip=1e9)
    padded, packed = engines(model_dir, head, optim)
    loss = vf_loss if head == "values" else pg_loss
    want, got = padded.train_step(batch, loss), packed.train_step(batch, loss)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    named = list(padded.module.named_parameters())
    for (name, a), b in zip(named, packed.module.parameters()):
        g_want, g_got = padded.optimizer.state[a]["exp_avg"], packed.optimizer.state[b]["exp_avg"]
        scale = float(g_want.abs().max())
        torch.testing.assert_close(g_got, g_want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(float(padded.optimizer.state[a]["exp_avg"].abs().sum()) > 0 for _, a in named) > 10


def test_the_budget_counts_real_tokens_and_a_longer_sequence_goes_alone():
    batch = varied_batch(b=16, seed=2)
    prompts = batch["prompt_mask"].sum(1)
    lengths = (prompts + batch["attention_mask"][:, batch["prompt_mask"].shape[1]:].sum(1)).tolist()
    budget = 12
    micro = micro_batches(batch, size=16, tokens=budget, pack=True)
    assert sum(len(mb) for mb in micro) == 16 and all(mb.meta[PACKED] for mb in micro)
    start = 0
    for mb in micro:
        real = lengths[start:start + len(mb)]
        assert sum(real) <= budget or len(mb) == 1, real
        if start + len(mb) < 16:      # greedy: the next row would not have fit
            assert sum(real) + lengths[start + len(mb)] > budget
        start += len(mb)
    assert any(n > budget for n in lengths) and any(len(mb) > 1 for mb in micro)
    assert not any(PACKED in mb.meta for mb in micro_batches(batch, size=16, tokens=budget))


def test_packing_on_the_megatron_engine_is_refused():
    with pytest.raises(ConfigError, match=r"train\.optim\.pack: needs engine\.backend: torch"):
        TrainConfig.parse({"optim": {"pack": True}, "engine": {"backend": "megatron"}})


def test_a_short_ppo_run_packed_trains_as_the_padded_one(tmp_path):
    """The loop's metrics over 3 steps of the tiny task (actor, critic, reference all packed) are the
    padded run's to float precision."""
    import ray

    from hpcrl.ppo.loop import train
    from hpcrl.raycluster.session import start_local

    cfg = TrainConfig(total_steps=3, progress=False, optim={"micro_batch_size": 8})
    runs = {}
    for pack in (False, True):
        run = tmp_path / f"pack_{pack}"
        start_local(["actor_rollout", "critic", "ref", "reward"], run_dir=run, num_cpus=2)
        try:
            runs[pack], _ = train(cfg.updated(optim={"pack": pack}), run)
        finally:
            ray.shutdown()
    assert len(runs[True]) == len(runs[False]) == 3
    for off, on in zip(runs[False], runs[True]):
        keys = [k for k in off if isinstance(off[k], float) and not k.startswith(("timing/", "throughput/", "time"))]
        assert "actor/pg_loss" in keys and "critic/vf_loss" in keys
        for k in keys:
            assert on[k] == pytest.approx(off[k], rel=1e-3, abs=1e-5), k
