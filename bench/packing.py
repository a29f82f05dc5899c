"""Sequence packing (train.optim.pack) against padded micro-batches, side by side in one run: the torch
engine's actor scoring (log-probs and entropy of a batch, no gradients) and one actor update (forward,
backward, AdamW step), on a Qwen2-0.5B-shaped random model (bench/gpu_ppo.py's SHAPE, no download) on
one GPU, bf16 autocast, the engine's compiled layers. Prints a table and writes bench/packing.json.

    python bench/packing.py                          # one GPU, the engine's sdpa attention
    python bench/packing.py --attn flash_attention_2 # the varlen kernel (flash-attn installed)
    python bench/packing.py --cpu-smoke --out /tmp/packing.json   # a tiny model on CPU: that it runs

A batch: 64 samples, prompts 32..256 tokens and responses 32..512 tokens, both lognormal (medians 96
and 128: most responses short, a few long, as sampled ones are), seeded. Modes, each one engine over
the same weights and batch:

    padded           micro-batches of 16 rows, [left-padded prompt | right-padded response]
    padded+budget    at most --tokens tokens a micro-batch (rows × widest row), common padding trimmed
    packed           at most --tokens real tokens a micro-batch, packed into one row (no padding)

Each figure is the median of --repeats timed runs after --warmup untimed ones (compile, allocator).
"computed" counts the token positions the forwards ran on (padding included); tokens/s counts real
tokens. max |Δ log p| is the packed scores against padded's over the real response tokens (bf16 on a GPU: not 0).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_ppo import SHAPE

from hpcrl.controller.batch import Batch
from hpcrl.engines.micro_batches import micro_batches
from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer
from hpcrl.models import log_probs_head, tiny_qwen2_config

MODES = {"padded": {"pack": False, "budget": False}, "padded+budget": {"pack": False, "budget": True},
         "packed": {"pack": True, "budget": True}}


def lognormal_lengths(g: torch.Generator, n: int, median: float, lo: int, hi: int) -> torch.Tensor:
    return (torch.randn(n, generator=g) * 0.8 + torch.tensor(median).log()).exp().round().clamp(lo, hi).long()


def make_batch(n: int, vocab: int, prompts: tuple[int, int, int], responses: tuple[int, int, int], seed: int = 0) -> Batch:
    """n rows of lognormal prompt and response lengths ((median, lo, hi) each), random ids."""
    g = torch.Generator().manual_seed(seed)
    p_len, r_len = lognormal_lengths(g, n, *prompts), lognormal_lengths(g, n, *responses)
    p, r = int(p_len.max()), int(r_len.max())
    pm = (torch.arange(p)[None] >= p - p_len[:, None]).long()
    rm = (torch.arange(r)[None] < r_len[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (n, p), generator=g) * pm
    response_ids = torch.randint(3, vocab, (n, r), generator=g) * rm
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": pm, "responses": response_ids, "response_mask": rm,
                  "input_ids": torch.cat([prompt_ids, response_ids], 1), "attention_mask": torch.cat([pm, rm], 1),
                  "advantages": torch.randn(n, r, generator=g) * rm})


def pg_loss(out, mb, total_tokens, total_seqs):
    m = mb["response_mask"]
    loss = -((out["log_probs"] * mb["advantages"] + 0.01 * out["entropy"]) * m).sum() / total_tokens
    return loss, {}


def timed(fn, device: torch.device, warmup: int, repeats: int) -> tuple[float, object]:
    out = None
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny Qwen2 on CPU, short sequences: that the bench runs")
    ap.add_argument("--attn", default="sdpa", help="the model's attn_implementation (sdpa, flash_attention_2, flex_attention)")
    ap.add_argument("--tokens", type=int, help="the token budget of a micro-batch (default 16384; smoke 256)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="eager decoder layers (the engine compiles them on a GPU)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "packing.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    if args.cpu_smoke:
        device, config = torch.device("cpu"), tiny_qwen2_config(vocab_size=64)
        n, prompts, responses, tokens = 16, (8, 2, 24), (12, 4, 48), args.tokens or 256
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU here: run with --cpu-smoke for the tiny CPU version")
        device, config = torch.device("cuda"), Qwen2Config(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        n, prompts, responses, tokens = 64, (96, 32, 256), (128, 32, 512), args.tokens or 16384
    config.max_position_embeddings = max(config.max_position_embeddings, prompts[2] + responses[2])
    batch = make_batch(n, config.vocab_size, prompts, responses)
    real = int(batch["attention_mask"].sum())
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    results, scores = {}, {}
    for name, mode in MODES.items():
        module = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
        module.load_state_dict(weights)
        budget = tokens if mode["budget"] else 0
        optim = OptimConfig(lr=1e-6, micro_batch_size=n if mode["budget"] else 16, micro_batch_tokens=budget)
        engine = TorchTrainer(module, optim, log_probs_head(1.0, with_entropy=True), device,
                              compile=not args.no_compile, pack=mode["pack"])
        micro = micro_batches(batch, optim.micro_batch_size, budget, pack=mode["pack"])
        computed = real if mode["pack"] else sum(mb["input_ids"].numel() for mb in micro)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        score_s, out = timed(partial(engine.infer, batch, optim.micro_batch_size, budget), device, args.warmup,
                             args.repeats)
        scores[name] = out["log_probs"]
        # each update moves the weights a little (lr 1e-6): the same work every time
        update_s, _ = timed(partial(engine.train_step, batch, pg_loss), device, args.warmup, args.repeats)
        results[name] = {"micro_batches": len(micro), "computed_tokens": computed, "score_s": score_s,
                         "update_s": update_s, "score_tokens_per_s": real / score_s, "update_tokens_per_s": real / update_s,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
        del engine, module
        if device.type == "cuda":
            torch.cuda.empty_cache()
    mask = batch["response_mask"].bool()
    drift = float((scores["packed"] - scores["padded"])[mask].abs().max())
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU (smoke: tiny Qwen2, {torch.get_num_threads()} threads)"
    print(f"\n{n} samples, {real} real tokens (prompts {prompts[1]}..{prompts[2]}, responses {responses[1]}..{responses[2]}, "
          f"lognormal), budget {tokens} tokens, attention {args.attn}, on {where}; median of {args.repeats}")
    print(f"{'mode':<15}{'micro':>6}{'computed':>10}{'score s':>10}{'update s':>10}{'score tok/s':>13}{'update tok/s':>14}{'peak GiB':>10}")
    for name, r in results.items():
        peak = f"{r['peak_gib']:>10.1f}" if r["peak_gib"] is not None else f"{'-':>10}"
        print(f"{name:<15}{r['micro_batches']:>6}{r['computed_tokens']:>10}{r['score_s']:>10.4f}{r['update_s']:>10.4f}"
              f"{r['score_tokens_per_s']:>13.0f}{r['update_tokens_per_s']:>14.0f}{peak}")
    speedup = results["padded+budget"]["update_s"] / results["packed"]["update_s"]
    print(f"packed update {speedup:.2f}× padded+budget's; max |Δ log p| packed vs padded: {drift:.2e}")
    args.out.write_text(json.dumps({"device": where, "attn": args.attn, "samples": n, "real_tokens": real,
                                    "budget": tokens, "prompts": prompts, "responses": responses,
                                    "repeats": args.repeats, "compile": not args.no_compile,
                                    "max_abs_log_prob_diff": drift, "modes": results}, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
