"""What the GPU tests run in their own processes (megatron's parallel state is per process): build
an engine on `world` GPUs, compute log-probs, take optimizer steps, gather, save the results."""
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
