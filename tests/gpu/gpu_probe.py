"""What the GPU tests run in their own processes (megatron's parallel state is per process): build
an engine on `world` GPUs, compute log-probs, take optimizer steps, gather, save the results; pass
weights from one process to another on the same GPU (DeviceWeights)."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.engines.train.torch_trainer import OptimConfig


def pg_loss(out, mb, total_tokens, total_seqs):
    """A policy-gradient loss on fixed advantages: what PPO's first step on a batch reduces to."""
    mask = mb["response_mask"]
    loss = -(out["log_probs"] * mb["advantages"] * mask).sum() / total_tokens
    return loss, {"pg": float(loss.detach())}


def probe(rank: int, world: int, engine: str, tp: int, model_dir: str, batch_file: str, out_dir: str, port: int,
          steps: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    batch = pickle.loads(Path(batch_file).read_bytes())
    shard = batch.chunk(world)[rank]          # what DP_COMPUTE hands each rank
    cfg = OptimConfig(lr=1e-4, micro_batch_size=4, grad_clip=1e9)
    if engine == "megatron":
        from hpcrl.engines.train.megatron import MegatronEngine

        eng = MegatronEngine(model_dir, "log_probs", cfg, tensor_parallel=tp)
    else:
        from hpcrl.engines.train.torch_trainer import TorchTrainer
        from hpcrl.models import load_causal_lm, log_probs_head

        eng = TorchTrainer(load_causal_lm(model_dir), cfg, log_probs_head(1.0, True), f"cuda:{rank}", "bf16")
    result = {"weights0": {k: v.float().cpu() for k, v in eng.full_weights().items()},
              "logp0": eng.infer(shard, 4)["log_probs"]}
    result["stats"] = [eng.train_step(shard, pg_loss) for _ in range(steps)]
    result["logp1"] = eng.infer(shard, 4)["log_probs"]
    if engine == "megatron":      # checkpoint state through hpcrl's HDF5 file, into a fresh engine
        from hpcrl.checkpoint.format import read_role_file, write_role_file
        from hpcrl.engines.train.megatron import MegatronEngine

        state = eng.state_dict()
        path = Path(out_dir) / "megatron.h5"
        if rank == 0:
            write_role_file(path, {"role": state}, {"step": 1})
        dist.barrier()
        fresh = MegatronEngine(model_dir, "log_probs", cfg, tensor_parallel=tp)
        fresh.load_state_dict(read_role_file(path)[0]["role"])
        result["logp_restored"] = fresh.infer(shard, 4)["log_probs"]
        result["stats_restored"] = fresh.train_step(shard, pg_loss)
        result["stats_continued"] = eng.train_step(shard, pg_loss)
        from torch._dynamo.utils import counters

        result["graph_breaks"] = dict(counters["graph_break"])     # of the compiled layers and LM head
        from megatron.core.optimizer import clip_grads

        from hpcrl.engines.train.megatron_optimizer import foreach_l2_norm, foreach_scale

        result["torch_kernels"] = {      # what megatron's optimizer ran on (no Transformer Engine or apex here)
            "fused_adamw": all(g["fused"] for o in eng._optimizers() for g in o.optimizer.param_groups),
            "foreach": clip_grads.l2_norm_impl is foreach_l2_norm and clip_grads.multi_tensor_scale_impl is foreach_scale}
    if rank == 0:
        result["weights1"] = {k: v.float().cpu() for k, v in eng.full_weights().items()}
    else:
        eng.full_weights()        # a collective
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def run(world: int, engine: str, tp: int, model_dir, batch, out_dir: Path, port: int) -> list[dict]:
    """probe() on `world` GPUs; each rank's result."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "batch.pkl").write_bytes(pickle.dumps(batch))
    mp.spawn(probe, args=(world, engine, tp, str(model_dir), str(out_dir / "batch.pkl"), str(out_dir), port), nprocs=world)
    return [pickle.loads((out_dir / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def export_probe(model_dir: str, out_dir: str, inbox, outbox) -> None:
    """The actor's side of DeviceWeights: two versions of its weights (fp32 on the GPU, as a trainer
    holds them) exported in bf16 to a reader on the same GPU, the second while the reader still
    holds the first; what this process has allocated then, and once the reader let go of both."""
    from hpcrl.controller.device_weights import DeviceWeights
    from hpcrl.models import load_causal_lm

    torch.manual_seed(1)
    hf = load_causal_lm(model_dir).cuda().state_dict()
    versions = [{k: v + 0.01 * i * torch.randn_like(v) for k, v in hf.items()} for i in (1, 2)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    first = DeviceWeights.export(versions[0], torch.bfloat16, "cuda:0", readers=1)
    outbox.put(first)
    assert inbox.get(timeout=120) == "holding"
    torch.cuda.ipc_collect()
    held = torch.cuda.memory_allocated() - base
    second = DeviceWeights.export(versions[1], torch.bfloat16, "cuda:0", readers=1)
    outbox.put(second)
    assert inbox.get(timeout=120) == "released"
    torch.cuda.ipc_collect()
    where = [w.handles[0][1][7:10] for w in (first, second)]    # rebuild_cuda_tensor's allocation handle, size, offset
    result = {"bf16": [{k: v.bfloat16().cpu() for k, v in w.items()} for w in versions], "held": held,
              "left": torch.cuda.memory_allocated() - base, "fresh": where[0] != where[1],
              "bytes": sum(v.numel() * 2 for v in versions[0].values())}
    (Path(out_dir) / "producer.pkl").write_bytes(pickle.dumps(result))


def read_probe(model_dir: str, out_dir: str, inbox, outbox) -> None:
    """The rollout's side: a StaticCacheRollout (started from the model's own weights, as the
    Rollout role's) loads both exports; it holds the first until the second has come."""
    from transformers import AutoConfig

    from hpcrl.controller.device_weights import Placement, shares_gpu
    from hpcrl.engines.rollout.static_cache import StaticCacheRollout
    from hpcrl.models import load_causal_lm

    device = torch.device("cuda:0")
    engine = StaticCacheRollout(AutoConfig.from_pretrained(model_dir), 0, [2], device)
    engine.load_weights(load_causal_lm(model_dir).state_dict())
    first, later = inbox.get(timeout=120), []

    def hold(named):
        engine.load_weights(named)
        outbox.put("holding")
        later.append(inbox.get(timeout=120))

    first.load(hold, 0, device)
    states = [[t.cpu() for t in engine._tensors(engine.w)]]
    later[0].load(engine.load_weights, 0, device)
    states.append([t.cpu() for t in engine._tensors(engine.w)])
    outbox.put("released")
    result = {"states": states, "shares_gpu": shares_gpu(first.producer, [Placement.of(device)])}
    (Path(out_dir) / "reader.pkl").write_bytes(pickle.dumps(result))


def share_weights(model_dir, out_dir: Path) -> tuple[dict, dict]:
    """export_probe and read_probe, two processes on GPU 0; their results."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_reader, to_producer = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=export_probe, args=(str(model_dir), str(out_dir), to_producer, to_reader)),
             ctx.Process(target=read_probe, args=(str(model_dir), str(out_dir), to_reader, to_producer))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a probe process failed (its traceback is above)"
    return pickle.loads((out_dir / "producer.pkl").read_bytes()), pickle.loads((out_dir / "reader.pkl").read_bytes())
