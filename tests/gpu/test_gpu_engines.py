"""GPU engines (run on the H200 machine; skipped without CUDA; the two-GPU tests need two).

    python -m pytest tests/gpu -q
"""
import gc
import itertools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
PORTS = itertools.count(29611)


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖"""
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Qwen2-shaped random model big enough to be a real test of the layouts (GQA, biases, 8 layers)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hpcrl.models import CharTokenizer

    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4099, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=1408, max_position_embeddings=512, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    CharTokenizer("".join(chr(0x10000 + i) for i in range(cfg.vocab_size - 3))).save(path)
    return path


@pytest.fixture(scope="module")
def batch():
    """8 left-padded prompts with 32-token responses and fixed advantages."""
    from hpcrl.controller.batch import Batch

    g = torch.Generator().manual_seed(3)
    prompt_mask = torch.ones(8, 48, dtype=torch.long)
    for i, pad in enumerate([0, 5, 0, 17, 2, 0, 30, 9]):
        prompt_mask[i, :pad] = 0
    prompt = torch.randint(3, 4099, (8, 48), generator=g) * prompt_mask
    responses = torch.randint(3, 4099, (8, 32), generator=g)
    response_mask = torch.ones(8, 32, dtype=torch.long)
    response_mask[2, 20:] = 0
    return Batch({"input_ids": torch.cat([prompt, responses], 1), "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                  "responses": responses, "response_mask": response_mask,
                  "advantages": torch.randn(8, 32, generator=g)})


def hf_log_probs(model_dir, batch):
    from hpcrl.models import load_causal_lm, response_log_probs

    model = load_causal_lm(model_dir).cuda()
    with torch.no_grad():
        logp, _ = response_log_probs(model, batch["input_ids"].cuda(), batch["attention_mask"].cuda(), batch["responses"].cuda())
    return logp.cpu()


def test_megatron_log_probs_equal_hf_and_checkpoints_resume(model_dir, batch, tmp_path):
    from gpu_probe import run

    [r] = run(1, "megatron", 1, model_dir, batch, tmp_path, next(PORTS))
    ref = hf_log_probs(model_dir, batch)
    m = batch["response_mask"].bool()
    assert rel(r["logp0"][m], ref[m]) < 1e-2          # bf16 megatron vs fp32 HF
    # HF -> megatron -> HF gives the HF weights back, as bf16
    from hpcrl.models import load_causal_lm

    hf = load_causal_lm(model_dir).state_dict()
    assert r["weights0"].keys() == hf.keys()
    for k in hf:
        assert torch.equal(r["weights0"][k], hf[k].bfloat16().float()), k
    # the step lowered the loss it took a step on, and resuming from the HDF5 file continues the same
    assert r["stats"][0]["pg"] != 0
    assert float(((r["logp1"] - r["logp0"]) * batch["advantages"] * m).sum()) > 0
    assert torch.allclose(r["logp_restored"], r["logp1"], atol=1e-6)
    assert r["stats_restored"]["pg"] == pytest.approx(r["stats_continued"]["pg"], rel=1e-4)
    assert r["stats_restored"]["grad_norm"] == pytest.approx(r["stats_continued"]["grad_norm"], rel=1e-3)
    # megatron's optimizer stepped with fused AdamW and foreach kernels, and its gradient norm is the torch engine's
    assert r["torch_kernels"] == {"fused_adamw": True, "foreach": True}
    [t] = run(1, "torch", 1, model_dir, batch, tmp_path / "torch", next(PORTS))
    assert r["stats"][0]["grad_norm"] == pytest.approx(t["stats"][0]["grad_norm"], rel=3e-2)
    # each compiled layer is one graph: megatron's RowParallelLinear warned inside every forward, a graph break
    assert r["graph_breaks"] == {}


def test_static_cache_rollout_log_probs_equal_the_training_forward(model_dir):
    """The CUDA-graph sampler (bf16 weights) against the torch engine's forward (bf16 autocast)."""
    from hpcrl.controller.batch import Batch
    from hpcrl.engines.base import SamplingParams
    from hpcrl.engines.rollout.static_cache import StaticCacheRollout
    from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
    from hpcrl.models import load_causal_lm, log_probs_head

    trainer = TorchTrainer(load_causal_lm(model_dir), OptimConfig(), log_probs_head(1.0, True, compile=True), "cuda", "bf16")
    engine = StaticCacheRollout(trainer.module.config, 0, [2], "cuda")
    engine.load_weights(trainer.full_weights())
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(16, 40, dtype=torch.long)
    mask[3, :11] = mask[7, :25] = 0
    prompts = torch.randint(3, 4099, (16, 40), generator=g) * mask
    out = engine.generate(prompts, mask, SamplingParams(max_new_tokens=64), seed=1)
    assert engine.decoders and next(iter(engine.decoders.values()))[0].__name__ == "replay"   # a CUDA graph ran
    batch = Batch({"input_ids": torch.cat([prompts, out["responses"]], 1),
                   "attention_mask": torch.cat([mask, out["response_mask"]], 1), "responses": out["responses"]})
    logp = trainer.infer(batch, 8)["log_probs"]
    m = out["response_mask"].bool()
    assert rel(out["rollout_log_probs"][m], logp[m]) < 2e-2
    again = engine.generate(prompts, mask, SamplingParams(max_new_tokens=64), seed=1)
    assert torch.equal(again["responses"], out["responses"])       # graph replays are deterministic


def test_static_cache_rollout_compiles_once_more_for_any_number_of_shapes(model_dir):
    """A multi-turn rollout samples a new (rows, context width) at every turn: the compiled model step
    serves them all after at most two compiles more than the first (each compile takes seconds to
    minutes), and its log-probs stay the HF forward's."""
    from torch._dynamo.utils import counters

    from hpcrl.controller.batch import Batch
    from hpcrl.engines.base import SamplingParams
    from hpcrl.engines.rollout.static_cache import StaticCacheRollout
    from hpcrl.models import load_causal_lm

    model = load_causal_lm(model_dir)
    engine = StaticCacheRollout(model.config, 0, [2], "cuda")
    engine.load_weights(model.state_dict())
    g = torch.Generator().manual_seed(6)
    shapes = [(16, 40), (16, 100), (11, 140), (7, 230), (13, 70), (16, 40)]
    graphs = []
    for rows, width in shapes:
        prompts = torch.randint(3, 4099, (rows, width), generator=g)
        out = engine.generate(prompts, torch.ones_like(prompts), SamplingParams(max_new_tokens=48), seed=1)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] - graphs[0] <= 2, (shapes, graphs)
    batch = Batch({"input_ids": torch.cat([prompts, out["responses"]], 1),
                   "attention_mask": torch.cat([torch.ones_like(prompts), out["response_mask"]], 1),
                   "responses": out["responses"]})
    m = out["response_mask"].bool()
    assert rel(out["rollout_log_probs"][m], hf_log_probs(model_dir, batch)[m]) < 2e-2


def test_device_weights_reach_a_rollout_engine_in_another_process_on_the_gpu(model_dir, tmp_path, monkeypatch):
    """The actor's weights through CUDA IPC into a StaticCacheRollout in another process on the same
    GPU, both with the workers' allocator (expandable segments): bitwise the producer's bf16 cast;
    the buffer stays allocated while the reader holds it, the next export takes a fresh one, and
    both are freed once the reader let go."""
    from gpu_probe import share_weights
    from transformers import AutoConfig

    from hpcrl.engines.rollout.static_cache import StaticCacheRollout

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")     # as WorkerHost sets it
    producer, reader = share_weights(model_dir, tmp_path)
    assert reader["shares_gpu"]
    expected = StaticCacheRollout(AutoConfig.from_pretrained(model_dir), 0, [2], "cpu", torch.bfloat16)
    for sent, got in zip(producer["bf16"], reader["states"], strict=True):
        expected.load_weights(sent)
        want = list(expected._tensors(expected.w))
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(*reader["states"]))     # the second load changed them
    assert producer["held"] >= producer["bytes"] and producer["fresh"]
    assert producer["left"] < 2**20


@two_gpus
def test_megatron_tp2_equals_tp1(model_dir, batch, tmp_path):
    from gpu_probe import run

    [one] = run(1, "megatron", 1, model_dir, batch, tmp_path / "tp1", next(PORTS))
    two = run(2, "megatron", 2, model_dir, batch, tmp_path / "tp2", next(PORTS))
    m = batch["response_mask"].bool()
    logp0 = torch.cat([r["logp0"] for r in two])      # each rank returns its own rows
    logp1 = torch.cat([r["logp1"] for r in two])
    assert rel(logp0[m], one["logp0"][m]) < 1e-2
    for k in one["weights0"]:                           # HF ⇄ megatron under TP=2 is exact
        assert torch.equal(two[0]["weights0"][k], one["weights0"][k]), k
    moved = (one["logp1"] - one["logp0"])[m]
    assert float((logp1 - one["logp1"])[m].norm()) < 0.25 * float(moved.norm())   # the same step
    assert two[0]["stats"][0]["grad_norm"] == pytest.approx(one["stats"][0]["grad_norm"], rel=2e-2)
    assert two[0]["stats"][0]["pg"] == pytest.approx(one["stats"][0]["pg"], rel=2e-2)
    assert torch.allclose(two[0]["logp_restored"], two[0]["logp1"], atol=1e-6)


@two_gpus
def test_fsdp2_step_equals_one_gpu(model_dir, batch, tmp_path):
    from gpu_probe import run

    [one] = run(1, "torch", 1, model_dir, batch, tmp_path / "one", next(PORTS))
    two = run(2, "torch", 1, model_dir, batch, tmp_path / "fsdp", next(PORTS))
    m = batch["response_mask"].bool()
    logp1 = torch.cat([r["logp1"] for r in two])
    moved = (one["logp1"] - one["logp0"])[m]
    assert float((logp1 - one["logp1"])[m].norm()) < 0.25 * float(moved.norm())
    assert two[0]["stats"][0]["grad_norm"] == pytest.approx(one["stats"][0]["grad_norm"], rel=2e-2)
    assert two[0]["weights1"].keys() == one["weights1"].keys()     # gathered whole from the shards


def fresh_steps(model_dir, batch, checkpointing=False, offload="none", compile=True) -> dict:
    """Two steps of a fresh bf16 actor engine on the GPU (one micro-batch of the 8 samples): the first
    step's gradients, and the second step's peak memory above what was allocated before it ("step")
    and before the engine was made ("engine"). The engine is collected before it returns."""
    from gpu_probe import pg_loss

    from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
    from hpcrl.models import load_causal_lm, log_probs_head

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = TorchTrainer(load_causal_lm(model_dir, device="cuda"), OptimConfig(lr=1e-4, micro_batch_size=8, grad_clip=1e9),
                          log_probs_head(1.0, True, compile), "cuda", "bf16", compile, checkpointing=checkpointing,
                          offload=offload)
    params, grads, optimizer_step = list(engine.module.parameters()), [], engine.optimizer_step

    def step():      # the gradients the optimizer steps on, then its step
        grads.append([p.grad.detach().clone() for p in params])
        optimizer_step()
    engine.optimizer_step = step
    engine.train_step(batch, pg_loss)
    engine.optimizer_step = optimizer_step
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(batch, pg_loss)
    peak = torch.cuda.max_memory_allocated()
    out = {"grads": grads[0], "step": peak - held, "engine": peak - before, "params": sum(p.numel() for p in params)}
    del engine, params, optimizer_step
    gc.collect()        # the optimizer's hooks (offload) make cycles
    torch.cuda.empty_cache()
    return out


def test_checkpointed_compiled_layers_give_the_plain_gradients_in_less_memory(model_dir, batch):
    """Each compiled decoder layer inside transformers' non-reentrant checkpoint (and autocast without
    its cache): no graph break, the first step's gradients are the plain compiled step's within bf16
    noise, and the second step's peak memory above what the engine holds between steps is lower."""
    from torch._dynamo.utils import counters

    runs = {}
    for checkpointing in (False, True):
        counters.clear()
        runs[checkpointing] = fresh_steps(model_dir, batch, checkpointing)
        assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] > 0, (checkpointing, counters)
    for got, want in zip(runs[True]["grads"], runs[False]["grads"], strict=True):
        assert rel(got, want) < 2e-2
    assert runs[True]["step"] < 0.8 * runs[False]["step"], (runs[True]["step"], runs[False]["step"])


def test_streamed_adamw_on_the_gpu_equals_the_resident_fused_one_bitwise():
    """HostOptimizerState over fused AdamW, in chunks of 1 MiB of parameters (one parameter larger
    than a chunk), against the same optimizer resident: equal parameters and moments bit for bit over
    three steps of changing learning rate, the moments in pinned host memory between steps; then a
    fresh one loads the streamed one's state (the moments never all on the GPU) and both go on alike."""
    import copy

    from hpcrl.engines.train.offload import HostOptimizerState

    g = torch.Generator().manual_seed(9)
    shapes = [(512, 1024), (3000,), (1024, 700), (64, 64), (2048, 512), (7,)]
    start = [torch.randn(s, generator=g) for s in shapes]

    def adamw(values):
        params = [torch.nn.Parameter(v.cuda()) for v in values]
        return params, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)

    def step(runs, lr):
        grads = [torch.randn(s, generator=g).cuda() for s in shapes]
        for params, optimizer, stepper in runs:
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            optimizer.param_groups[0]["lr"] = lr
            stepper()

    def moments(optimizer):
        return [[s[k].cpu() for k in ("exp_avg", "exp_avg_sq", "step")] for s in optimizer.state.values()]

    def equal(runs):
        (params, optimizer, _), *others = runs
        for p_other, o_other, _ in others:
            assert all(torch.equal(a, b) for a, b in zip(params, p_other))
            assert all(torch.equal(a, b) for x, y in zip(moments(optimizer), moments(o_other)) for a, b in zip(x, y))
            assert all(o_other.state[p]["exp_avg"].is_pinned() and o_other.state[p]["exp_avg_sq"].device.type == "cpu"
                       for p in p_other)

    resident = adamw(start)
    params, optimizer = adamw(start)
    streamed = HostOptimizerState(optimizer, chunk_bytes=2**20)
    assert len(streamed.chunks) >= 4
    runs = [(*resident, resident[1].step), (params, optimizer, streamed.step)]
    for lr in (1e-3, 5e-3, 1e-2):
        step(runs, lr)
        torch.cuda.synchronize()
        equal(runs)
    state = copy.deepcopy(optimizer.state_dict())
    fresh_params, fresh = adamw([p.detach().cpu() for p in params])
    fresh_streamed = HostOptimizerState(fresh, chunk_bytes=2**20)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fresh.load_state_dict(state)
    assert torch.cuda.max_memory_allocated() - held < 2**20      # no moment came to the GPU
    runs.append((fresh_params, fresh, fresh_streamed.step))
    for lr in (1e-2, 1e-2):
        step(runs, lr)
        torch.cuda.synchronize()
        equal(runs)


def test_an_offloaded_step_needs_less_memory_by_the_moments(model_dir, batch, monkeypatch):
    """The second step's peak GPU memory of a resident and of an offloaded engine (chunks of 1 MiB of
    parameters), each above what was allocated before the engine was made: the offloaded one's is
    lower by most of the moments' 8 bytes a parameter."""
    from hpcrl.engines.train import offload

    monkeypatch.setattr(offload, "CHUNK_BYTES", 2**20)
    resident, offloaded = (fresh_steps(model_dir, batch, offload=mode, compile=False) for mode in ("none", "optimizer"))
    assert resident["engine"] - offloaded["engine"] > 0.75 * 8 * resident["params"], (resident["engine"],
                                                                                       offloaded["engine"])


def test_models_load_straight_onto_the_gpu(model_dir):
    """load_causal_lm and ValueModel with a GPU device: every parameter there, equal to the host's
    (the value head is drawn on the host either way)."""
    from hpcrl.models import ValueModel, load_causal_lm

    host, gpu = load_causal_lm(model_dir).state_dict(), load_causal_lm(model_dir, device="cuda").state_dict()
    assert host.keys() == gpu.keys() and all(v.is_cuda and torch.equal(v.cpu(), host[k]) for k, v in gpu.items())
    torch.manual_seed(3)
    host = ValueModel(model_dir).state_dict()
    torch.manual_seed(3)
    gpu = ValueModel(model_dir, torch.device("cuda", 0)).state_dict()
    assert host.keys() == gpu.keys() and all(v.is_cuda and torch.equal(v.cpu(), host[k]) for k, v in gpu.items())


def recompute_probe(rank: int, model_dir: str, batch, out: str, port: int) -> None:
    """Two megatron steps of the same batch without and with full recompute (its own process:
    megatron's parallel state is per process): the stats, the second step's peak memory above what
    the engine holds between steps, and the log-probs after."""
    import os
    import pickle

    import torch.distributed as dist
    from gpu_probe import pg_loss

    from hpcrl.engines.train.megatron import MegatronEngine
    from hpcrl.engines.train.torch_trainer import OptimConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    result = {}
    for checkpointing in (False, True):
        engine = MegatronEngine(model_dir, "log_probs", OptimConfig(lr=1e-4, micro_batch_size=4, grad_clip=1e9),
                                checkpointing=checkpointing)
        stats = [engine.train_step(batch, pg_loss)]      # the first makes Adam's moments
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        stats.append(engine.train_step(batch, pg_loss))
        result[checkpointing] = {"stats": stats, "peak": torch.cuda.max_memory_allocated() - held,
                                 "logp": engine.infer(batch, 4)["log_probs"]}
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    with open(out, "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def test_megatron_full_recompute_takes_the_same_steps_in_less_memory(model_dir, batch, tmp_path):
    """megatron's full recompute of each layer (train.engine.activation_checkpointing): the same
    losses, gradient norms and updated log-probs as without it, within bf16 noise, and a lower peak
    above what the engine holds between steps."""
    import pickle

    import torch.multiprocessing as mp

    mp.spawn(recompute_probe, args=(str(model_dir), batch, str(tmp_path / "out.pkl"), next(PORTS)), nprocs=1)
    r = pickle.loads((tmp_path / "out.pkl").read_bytes())
    plain, recomputed = r[False], r[True]
    for got, want in zip(recomputed["stats"], plain["stats"]):
        assert got["pg"] == pytest.approx(want["pg"], rel=1e-3)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-2)
    m = batch["response_mask"].bool()
    assert rel(recomputed["logp"][m], plain["logp"][m]) < 1e-2
    assert recomputed["peak"] < 0.8 * plain["peak"], (recomputed["peak"], plain["peak"])


def test_compiling_ahead_changes_nothing_and_leaves_the_first_steps_nothing_to_compile(model_dir, batch):
    """TorchTrainer.compile_ahead on the made-up batches of a run of these sizes (made_up_batches): the
    weights, AdamW's state and the schedule stay as they were, no gradient is left; then the real
    forward without gradients and the real update, at sizes neither made-up batch had, compile no graph."""
    from torch._dynamo.utils import counters

    from hpcrl.controller.batch import Batch
    from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
    from hpcrl.models import load_causal_lm, log_probs_head
    from hpcrl.ppo.config import TrainConfig
    from hpcrl.ppo.roles.common import made_up_batches

    cfg = TrainConfig.parse({"data": {"max_prompt_length": 48}, "rollout": {"max_new_tokens": 32},
                             "optim": {"mini_batch_size": 8, "micro_batch_size": 4}})
    trainer = TorchTrainer(load_causal_lm(model_dir), OptimConfig(lr=1e-4, micro_batch_size=4, grad_clip=1e9),
                           log_probs_head(1.0, True, compile=True), "cuda", "bf16")
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    for made in made_up_batches(cfg):
        trainer.compile_ahead(made, 4, trained=("log_probs",))
    assert all(torch.equal(v, before[k]) for k, v in trainer.module.state_dict().items())
    assert all(p.grad is None for p in trainer.module.parameters())
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0

    real = Batch({k: v[:, :48 + 24] if k in ("input_ids", "attention_mask") else v[:, :24] if v.dim() == 2 and k != "prompt_mask"
                  else v for k, v in batch.tensors.items()})        # 24 response tokens: a size not made up
    counters.clear()
    trainer.infer(real, 4)
    loss = lambda out, mb, tokens, seqs: (-(out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / tokens, {})  # noqa: E731
    trainer.train_step(real, loss)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
