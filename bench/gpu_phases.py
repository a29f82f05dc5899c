"""Each phase of a PPO step on one GPU against its bound, eager and compiled side by side, in one
process (no Ray): the same Qwen2-0.5B-shaped model and batch as bench/gpu_ppo.py. Prints a roofline
table and writes bench/gpu_phases.json.

    python bench/gpu_phases.py

Phases, each timed over the whole batch (64 prompts × 256 prompt + 256 response tokens):
  generate   the static-cache rollout sampling 256 tokens per prompt (bf16 weights, CUDA graphs)
  log-probs  one frozen forward of the policy's response log-probs (the old and the reference
             log-probs are two of these)
  values     one frozen forward of the critic
  actor      one actor update (forward + backward of the log-probs, AdamW)
  critic     one critic update

Bounds (bench/gpu_ppo.py's model_flops and decode_bytes). Forward and update phases are FLOP bound:
model FLOPs over the H200's measured dense bf16 rate, 790 TFLOP/s. Generation is bandwidth bound:
per decode step the bf16 weights and the KV cache of the tokens so far are read once, at the
measured 4.3 TB/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_ppo import (BANDWIDTH, BATCH, MICRO, PEAK, PROMPT, RESPONSE, decode_bytes, make_inputs,  # noqa: E402
                     model_flops)


def timed(fn, repeats: int) -> float:
    import torch

    fn()                               # compiles, captures, warms the allocator
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcrl-gpu-bench"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu_phases.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import AutoConfig

    from hpcrl.controller.batch import Batch
    from hpcrl.engines.base import SamplingParams
    from hpcrl.engines.rollout.static_cache import StaticCacheRollout
    from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
    from hpcrl.models import ValueModel, load_causal_lm, log_probs_head
    from hpcrl.models.critic import values_head

    model_dir, prompts = make_inputs(args.work)
    ids = torch.tensor([json.loads(line)["prompt_ids"] for line in prompts.read_text().splitlines()])
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=RESPONSE)
    rows = []

    def row(phase, compiled, seconds, bound_s, unit, amount):
        rows.append({"phase": phase, "compiled": compiled, "s": seconds, "bound_s": bound_s, "of_bound": bound_s / seconds,
                     unit: amount / seconds})

    for compiled in (False, True):
        engine = StaticCacheRollout(AutoConfig.from_pretrained(model_dir), 0, [2], "cuda", compile=compiled)
        engine.load_weights(load_causal_lm(model_dir).state_dict())
        out = {}
        s = timed(lambda: out.update(engine.generate(ids, mask, params, seed=1)), args.repeats)
        row("generate", compiled, s, decode_bytes() / BANDWIDTH, "sampled_tok_s", BATCH * RESPONSE)
        responses = out["responses"]

    batch = Batch({"input_ids": torch.cat([ids, responses], 1), "attention_mask": torch.ones(BATCH, PROMPT + RESPONSE,
                   dtype=torch.long), "responses": responses, "prompt_ids": ids, "prompt_mask": mask,
                   "response_mask": torch.ones_like(responses), "advantages": torch.randn(responses.shape),
                   "returns": torch.randn(responses.shape)})

    def pg_loss(out, mb, tokens, _seqs):      # the shape of PPO's losses: per-token terms over the batch's tokens
        return -(out["log_probs"] * mb["advantages"]).sum() / tokens - 1e-3 * (out["entropy"]).sum() / tokens, {}

    def value_loss(out, mb, tokens, _seqs):
        return ((out["values"] - mb["returns"]) ** 2).sum() / tokens, {}

    check = {}
    optim = OptimConfig(lr=1e-7, micro_batch_size=MICRO)
    policy, critic = (lambda: load_causal_lm(model_dir)), (lambda: ValueModel(model_dir))
    phases = [   # name, its engine (compiled or not), one run of it, its model FLOPs
        ("log-probs", lambda c: TorchTrainer(policy(), None, log_probs_head(1.0, False, c), "cuda", compile=c),
         lambda e, c: check.__setitem__(c, e.infer(batch, MICRO)["log_probs"]), model_flops(True, True)),
        ("values", lambda c: TorchTrainer(critic(), None, values_head, "cuda", compile=c),
         lambda e, c: e.infer(batch, MICRO), model_flops(True, False)),
        ("actor update", lambda c: TorchTrainer(policy(), optim, log_probs_head(1.0, True, c), "cuda", compile=c),
         lambda e, c: e.train_step(batch, pg_loss), model_flops(False, True)),
        ("critic update", lambda c: TorchTrainer(critic(), optim, values_head, "cuda", compile=c),
         lambda e, c: e.train_step(batch, value_loss), model_flops(False, False))]
    for compiled in (False, True):
        for name, make, run, flops in phases:
            engine = make(compiled)
            s = timed(lambda: run(engine, compiled), args.repeats)
            row(name, compiled, s, flops / PEAK, "tflops", flops / 1e12)
        print(f"compiled={compiled}: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    a, b = check[False], check[True]
    agreement = float((a - b).norm() / b.norm())
    mean_abs = float((a - b).abs().mean())

    device = torch.cuda.get_device_name(0)
    args.out.write_text(json.dumps({"device": device, "batch": BATCH, "prompt": PROMPT, "response": RESPONSE,
                                    "micro_batch": MICRO, "peak_flops": PEAK, "bandwidth": BANDWIDTH, "rows": rows,
                                    "log_probs_compiled_vs_eager_rel": agreement}, indent=1))
    print(f"\n{device}; {BATCH} × ({PROMPT} + {RESPONSE}) tokens, micro-batch {MICRO}; median of {args.repeats}")
    print(f"log-probs compiled vs eager: relative difference {agreement:.2e}, mean |Δ| {mean_abs:.2e}")
    from torch._dynamo.utils import counters
    print("dynamo:", dict(counters["stats"]), "graph breaks:", sum(counters["graph_break"].values()))
    print(f"{'phase':14} {'compiled':>8} {'s':>7} {'bound s':>8} {'of bound':>8}  achieved")
    for r in rows:
        achieved = (f"{r['sampled_tok_s']:,.0f} sampled tok/s" if "sampled_tok_s" in r
                    else f"{r['tflops']:,.0f} TFLOP/s")
        print(f"{r['phase']:14} {str(r['compiled']):>8} {r['s']:7.3f} {r['bound_s']:8.3f} {r['of_bound']:8.1%}  {achieved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
