"""What lets a big model's update fit on one GPU (train.engine), on a real tiny Qwen2 with real peft
(CPU, fp32 unless said): activation checkpointing per decoder layer (the same gradients and
weights, bitwise, for the actor and the critic), AdamW's moments in host memory stepped chunk by
chunk (hpcrl/engines/train/offload.py: the resident optimizer's updates, bitwise, through clipping,
warm-up and a state-dict round trip), frozen weights stored in bf16 (a LoRA base, a reference), and
the settings' way from the config to the engine. The GPU halves are in tests/gpu/test_gpu_engines.py."""
import pytest
import torch
from test_checkpoint import same
from test_packing import pg_loss, varied_batch, vf_loss

from hpcrl.checkpoint.format import read_role_file, write_role_file
from hpcrl.engines.train import offload, torch_trainer
from hpcrl.engines.train.offload import HostOptimizerState
from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
from hpcrl.models import CharTokenizer, ValueModel, create_model_dir, load_causal_lm, log_probs_head, values_head
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import make_train_engine
from hpcrl.ppo.tasks import copy_digits

TOK = CharTokenizer(copy_digits.ALPHABET)
SEED = 11     # the value head's initialisation, the batches' and the adapters' draws


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_model_dir(tmp_path_factory.mktemp("fit") / "model", TOK, seed=0)


def engine(model_dir, head: str, optim: OptimConfig | None, **kwargs) -> TorchTrainer:
    """A CPU engine of the actor's log-probs (and entropy) or the critic's values; the value head
    drawn from SEED, so that two engines start from the same weights."""
    torch.manual_seed(SEED)
    if head == "values":
        return TorchTrainer(ValueModel(model_dir), optim, values_head, compile=False, **kwargs)
    return TorchTrainer(load_causal_lm(model_dir), optim, log_probs_head(1.0, with_entropy=True), compile=False, **kwargs)


def gradients(engine: TorchTrainer) -> list[list[torch.Tensor]]:
    """Each optimizer step's gradients, in the order of the parameters, as the step sees them."""
    steps = []
    engine.optimizer.register_step_pre_hook(
        lambda *_: steps.append([p.grad.clone() for p in engine.module.parameters() if p.requires_grad]))
    return steps


@pytest.mark.parametrize("head", ["log_probs", "values"])
def test_a_checkpointed_step_has_the_same_gradients_and_weights(model_dir, head):
    """Two steps on batches of three micro-batches each, with and without checkpointing: the same
    gradients and updated weights bit for bit, and each decoder layer ran twice per micro-batch
    with it (the forward, and its recompute in the backward), once without; infer never recomputes."""
    optim = OptimConfig(lr=1e-3, micro_batch_size=4)
    loss = vf_loss if head == "values" else pg_loss
    engines, grads, calls = {}, {}, {}
    for checkpointing in (False, True):
        e = engines[checkpointing] = engine(model_dir, head, optim, checkpointing=checkpointing)
        grads[checkpointing], calls[checkpointing] = gradients(e), []
        layer = next(m for m in e.module.modules() if type(m).__name__.endswith("DecoderLayer"))
        layer.register_forward_pre_hook(lambda *_, n=calls[checkpointing]: n.append(1))
        for step in range(2):
            e.train_step(varied_batch(seed=SEED + step), loss)
    assert len(calls[False]) == 6 and len(calls[True]) == 12, (SEED, len(calls[False]), len(calls[True]))
    assert len(grads[True]) == 2 and same(grads[True], grads[False]), f"seed {SEED}: the gradients differ"
    assert same(engines[True].state_dict(), engines[False].state_dict()), f"seed {SEED}: the weights differ"
    engines[True].infer(varied_batch(seed=SEED), 4)
    assert len(calls[True]) == 15


def test_offloaded_steps_equal_the_resident_ones_bitwise(model_dir, monkeypatch, tmp_path):
    """Four steps of a resident and an offloaded actor (clipped gradients, three steps of warm-up,
    chunks of 64 KiB of parameters: several per step), then a fresh offloaded engine loads the
    offloaded one's checkpoint file and all three take two more: equal weights, moments, steps and
    stats throughout; the moments stay in the host buffer between steps."""
    monkeypatch.setattr(offload, "CHUNK_BYTES", 64 * 2**10)
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=3, grad_clip=0.05, micro_batch_size=5)
    resident, offloaded = engine(model_dir, "log_probs", optim), engine(model_dir, "log_probs", optim, offload="optimizer")
    host = offloaded.optimizer_step.__self__
    assert isinstance(host, HostOptimizerState) and len(host.chunks) >= 3
    chunks = []
    offloaded.optimizer.register_step_post_hook(lambda *_: chunks.append(1))

    def on_host(e: TorchTrainer) -> bool:
        buffer = e.optimizer_step.__self__.host.untyped_storage().data_ptr()
        moments = [v for s in e.optimizer.state.values() for k, v in s.items() if k != "step"]
        return len(moments) == 2 * len(host.params) and all(v.untyped_storage().data_ptr() == buffer for v in moments)

    def step_all(engines, step):
        batch = varied_batch(seed=SEED + step)
        stats = [e.train_step(batch, pg_loss) for e in engines]
        for e, s in zip(engines[1:], stats[1:]):
            assert s == stats[0], (SEED, step, s, stats[0])
            assert same(e.state_dict(), engines[0].state_dict()), f"seed {SEED}, step {step}: the states differ"
            assert on_host(e)
        return stats[0]

    stats = [step_all([resident, offloaded], step) for step in range(4)]
    assert len(chunks) == 4 * len(host.chunks)
    assert all(s["grad_norm"] > optim.grad_clip for s in stats), stats        # clipped
    assert stats[0]["lr"] < stats[1]["lr"] == optim.lr      # warming up (each the next step's)
    write_role_file(tmp_path / "actor.h5", {"role": offloaded.state_dict()}, {"step": 4})
    fresh = engine(model_dir, "log_probs", optim, offload="optimizer")
    fresh.load_state_dict(read_role_file(tmp_path / "actor.h5")[0]["role"])
    assert on_host(fresh) and same(fresh.state_dict(), resident.state_dict())
    for step in (4, 5):
        step_all([resident, offloaded, fresh], step)


def test_a_lora_base_in_bf16_trains_its_adapters_in_fp32(model_dir):
    """precision bf16 on CPU, as on a GPU: the actor's LoRA base is stored in bf16 and its adapters
    in fp32 (RoPE's buffers stay fp32); a step moves the adapters alone; the merged weights (bf16, as
    the base) load into a plain model and compute what the engine does; the state (the adapters)
    round-trips."""
    pytest.importorskip("peft")
    cfg = TrainConfig().updated(lora={"rank": 4, "alpha": 8.0}, engine={"precision": "bf16"}, micro_batch_size=5,
                                warmup_steps=0)
    torch.manual_seed(SEED)
    actor = make_train_engine(cfg, str(model_dir), "log_probs", torch.device("cpu"), 1e-2)
    params = dict(actor.module.named_parameters())
    assert all(p.dtype == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, p in params.items())
    assert all(b.dtype == torch.float32 for b in actor.module.buffers())
    frozen = {n: p.detach().clone() for n, p in params.items() if ".lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in params.items() if ".lora_" in n}
    stats = actor.train_step(varied_batch(seed=SEED), pg_loss)
    assert torch.isfinite(torch.tensor(stats["loss"])), (SEED, stats)
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert all(not torch.equal(params[n], v) for n, v in adapters.items() if ".lora_B." in n)

    merged = actor.full_weights()
    plain = load_causal_lm(model_dir)
    plain.load_state_dict(merged)
    assert all(v.dtype == torch.bfloat16 for v in merged.values())
    batch = varied_batch(seed=SEED + 1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = log_probs_head(1.0, False)(plain, batch)["log_probs"]
    got = actor.infer(batch, 4)["log_probs"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=0.05, rtol=0.05)

    state = actor.state_dict()
    assert state["model"] and all(".lora_" in k and v.dtype == torch.float32 for k, v in state["model"].items())
    fresh = make_train_engine(cfg, str(model_dir), "log_probs", torch.device("cpu"), 1e-2)
    fresh.load_state_dict(state)
    assert same(fresh.state_dict(), actor.state_dict()) and same(fresh.full_weights(), merged)


def test_a_bf16_reference_is_loaded_in_bf16_as_its_engine_stores_it(model_dir):
    """The reference of a bf16 engine, loaded in bf16 by make_train_engine, holds the parameters the
    engine's own cast of the fp32 model gives, and its buffers in fp32."""
    cfg = TrainConfig().updated(engine={"precision": "bf16"})
    reference = make_train_engine(cfg, str(model_dir), "log_probs", torch.device("cpu"), None)
    cast = TorchTrainer(load_causal_lm(model_dir), None, log_probs_head(1.0, False), precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in reference.module.parameters())
    assert all(b.dtype == torch.float32 for b in reference.module.buffers())
    assert same(reference.state_dict(), cast.state_dict())
    batch = varied_batch(seed=SEED)
    assert same(reference.infer(batch, 4)["log_probs"], cast.infer(batch, 4)["log_probs"])


def test_the_settings_reach_the_engines_and_offload_under_fsdp2_is_refused(model_dir, monkeypatch):
    """train.engine's activation_checkpointing and offload reach the actor's and the critic's torch
    engines through make_train_engine (the reference takes neither); offload where FSDP2 would shard
    the engine is refused by the setting's name."""
    cfg = TrainConfig().updated(engine={"activation_checkpointing": True, "offload": "optimizer"})
    for head in ("log_probs", "values"):
        e = make_train_engine(cfg, str(model_dir), head, torch.device("cpu"), 1e-3)
        layers = [m for m in e.module.modules() if type(m).__name__.endswith("DecoderLayer")]
        assert e.checkpointing and layers and all(m.gradient_checkpointing for m in layers)
        assert isinstance(e.optimizer_step.__self__, HostOptimizerState)
    reference = make_train_engine(cfg, str(model_dir), "log_probs", torch.device("cpu"), None)
    assert not reference.checkpointing and not any(getattr(m, "gradient_checkpointing", False)
                                                   for m in reference.module.modules())
    # two ranks on GPUs shard with FSDP2: refused before anything reaches a GPU
    module = load_causal_lm(model_dir)
    monkeypatch.setattr(torch_trainer.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_trainer.dist, "get_world_size", lambda *_: 2)
    with pytest.raises(ValueError, match="train.engine.offload: optimizer needs one GPU per process group"):
        TorchTrainer(module, OptimConfig(), log_probs_head(1.0, False), "cuda", offload="optimizer")
