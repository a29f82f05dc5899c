"""Rollout engines side by side on one GPU: vLLM, the static-cache engine and HF generate on the same
prompts, sampling at temperature 1; sampled tokens/s, the share of the bandwidth bound, and the time a
weight update takes by path. Prints a table and writes bench/gpu_rollout.json.

    python bench/gpu_rollout.py [--shapes step,long] [--engines vllm,static,hf,vllm-proc] [--repeats 3]

Shapes (random weights, bf16; no stop token, so every engine decodes every row to its length):
  step   bench/gpu_ppo.py's: a Qwen2-0.5B shape, 64 prompts × 256 tokens + 256 new
  long   SmolLM2-135M's shape, 256 prompts × 64 tokens + 1024 new (HF generate: 128 new, its rate
         would take minutes at 1024)
Engines, each in a process of its own, one after the other:
  vllm       hpcrl's VLLMRollout (vLLM's offline engine in the process, CUDA graphs, prefix cache), timed
             with a seed per row (hpcrl's default) and, on the same engine, with one seed per call
  vllm-proc  the same with vLLM's engine core in a process of its own (vLLM's default outside hpcrl:
             scheduling and output processing overlap the GPU's work; weights travel as a buffer)
  static     hpcrl's StaticCacheRollout (compiled model step, CUDA-graph replays of 32 steps)
  hf         transformers' generate, as a TRL-style trainer calls it
Bound: per decode step the bf16 weights and the KV cache so far are read once (bench/gpu_ppo.py's
decode_bytes) at this GPU's device-to-device copy rate, measured at the start (4.3 TB/s on the H200);
the time of a generate call includes the prompt's prefill.
Profile (step shape, static and in-process vLLM): one more call under torch.profiler: how much of its
wall time the GPU ran kernels, and which kernels took that time.
Weight sync (the step shape's weights, bf16, on the GPU): `load_weights` into each engine in its
process, and the collective group's path between two processes (hpcrl.controller.weight_transport
with gloo, through host memory: what a rollout role on another node gets where NCCL is not available;
NCCL needs a GPU per member, so it is measured on two GPUs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_phases import timed  # noqa: E402
from gpu_ppo import SHAPE, decode_bytes  # noqa: E402

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
SHAPES = {"step": {"arch": "qwen2", "shape": SHAPE, "batch": 64, "prompt": 256, "new": 256},
          "long": {"arch": "llama", "shape": SMOLLM2, "batch": 256, "prompt": 64, "new": 1024, "hf_new": 128}}


def model_dir(work: Path, name: str) -> Path:
    """A random model of the shape, written once, with no stop token in its config."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path = work / f"model-{name}"
    if not (path / "config.json").exists():
        spec = SHAPES[name]
        config = (Qwen2Config if spec["arch"] == "qwen2" else LlamaConfig)(**spec["shape"], bos_token_id=None,
                                                                             eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


def prompts(name: str):
    import torch

    spec = SHAPES[name]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, spec["shape"]["vocab_size"], (spec["batch"], spec["prompt"]), generator=g)
    return ids, torch.ones_like(ids)


def copy_bandwidth() -> float:
    """Bytes read and written per second by a 4 GiB device-to-device copy on this GPU."""
    import torch

    a = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    seconds = timed(lambda: b.copy_(a), 5)
    return 2 * a.numel() / seconds


def kernel_profile(fn, top: int = 8) -> dict:
    """Where one call of `fn` (warm: compiled and captured) spends its GPU time: the share of the wall
    time the GPU was running kernels (low: the GPU waits on the host or on launches) and the kernels
    taking most of it (CUPTI sees the kernels inside CUDA-graph replays too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    own = lambda e: e.self_device_time_total  # noqa: E731
    events = [e for e in prof.key_averages() if own(e) > 0]
    busy = sum(own(e) for e in events) / 1e6
    events.sort(key=own, reverse=True)
    return {"wall_s": wall, "kernels_s": busy, "gpu_busy": busy / wall, "kernel_launches": sum(e.count for e in events),
            "top": [{"kernel": e.key[:90], "share": own(e) / 1e6 / busy, "count": e.count} for e in events[:top]]}


def one_engine(engine: str, name: str, work: Path, repeats: int, bandwidth: float) -> list[dict]:
    """This process: one engine on one shape; its rate (vllm: per variant) and (step shape) its
    weight-sync time."""
    import torch

    from hpcrl.engines.base import SamplingParams
    from hpcrl.models import load_causal_lm

    spec, path = SHAPES[name], model_dir(work, name)
    ids, mask = prompts(name)
    new = spec.get("hf_new", spec["new"]) if engine == "hf" else spec["new"]
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    t0 = time.perf_counter()
    weights = {k: v.cuda() for k, v in load_causal_lm(path).to(torch.bfloat16).state_dict().items()}
    variants = {"": None}
    if engine.startswith("vllm"):
        from hpcrl.engines.rollout.vllm_rollout import VLLMRollout

        eng = VLLMRollout(path, pad_id=0, eos_ids=[], cache_dir=work / "vllm-cache", dtype="bfloat16",
                          max_model_len=spec["prompt"] + new, gpu_memory_utilization=0.6, in_process=engine == "vllm")
        generate = lambda: eng.generate(ids, mask, params, seed=1)["response_mask"].sum()  # noqa: E731
        load = eng.load_weights
        if engine == "vllm":
            variants = {"seed per row": True, "seed per call": False}
    elif engine == "static":
        from transformers import AutoConfig

        from hpcrl.engines.rollout.static_cache import StaticCacheRollout

        eng = StaticCacheRollout(AutoConfig.from_pretrained(path), 0, [], "cuda")
        eng.load_weights(weights)
        generate = lambda: eng.generate(ids, mask, params, seed=1)["response_mask"].sum()  # noqa: E731
        load = eng.load_weights
    else:
        model = load_causal_lm(path).to(torch.bfloat16).cuda().eval()

        def generate():
            with torch.no_grad():
                out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=1.0,
                                     top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            return torch.tensor((out.shape[1] - ids.shape[1]) * ids.shape[0])

        load = lambda w: model.load_state_dict(w, strict=False)  # noqa: E731
    ready = time.perf_counter() - t0
    bound = decode_bytes(spec["shape"], new, spec["batch"], spec["prompt"]) / bandwidth
    rows = []
    for variant, seed_rows in variants.items():
        if seed_rows is not None:
            eng.seed_rows = seed_rows
        out = {}
        seconds = timed(lambda: out.update(tokens=generate()), repeats)
        tokens = int(out["tokens"])
        rows.append({"engine": f"{engine}, {variant}" if variant else engine, "shape": name, "rows": spec["batch"],
                     "prompt": spec["prompt"], "new_tokens": new, "ready_s": round(ready, 1), "generate_s": seconds,
                     "sampled_tok_s": tokens / seconds, "bound_s": bound, "of_bound": bound / seconds})
        if name == "step" and engine in ("static", "vllm"):     # kernels in this process (not vllm-proc's)
            try:
                rows[-1]["profile"] = kernel_profile(generate)     # warm: timed() ran it
            except Exception as e:  # noqa: BLE001  the rate stands without its profile
                rows[-1]["profile"] = {"error": repr(e)[:300]}
    if name == "step":
        rows[0]["load_weights_s"] = timed(lambda: load(weights), repeats)
    return rows


def group_sync(work: Path, repeats: int) -> dict:
    """The step shape's weights from one process to another by the collective group (gloo): seconds
    per transfer at the receiver, the weights on its GPU."""
    from hpcrl.controller.weight_transport import Rendezvous

    store = Rendezvous("127.0.0.1")
    ticket = store.ticket(["actor rank 0", "rollout rank 0"], "gloo", 120.0)
    args = json.dumps({"ticket": [list(ticket.address), ticket.formation, list(ticket.members), ticket.backend,
                                  ticket.timeout_s], "model": str(model_dir(work, "step")), "repeats": repeats})
    procs = [subprocess.Popen([sys.executable, __file__, "--group-member", str(rank), args], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT) for rank in (0, 1)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"group sync members exited {[p.returncode for p in procs]}")
    return json.loads(outs[1].strip().splitlines()[-1])


def group_member(rank: int, args: dict) -> None:
    import torch

    from hpcrl.controller.weight_transport import Ticket, WeightGroup
    from hpcrl.models import load_causal_lm

    address, formation, members, backend, timeout = args["ticket"]
    group = WeightGroup.join(Ticket(tuple(address), formation, tuple(members), backend, timeout), rank, "cuda")
    if rank == 0:
        weights = {k: v.cuda() for k, v in load_causal_lm(args["model"]).to(torch.bfloat16).state_dict().items()}
        for _ in range(args["repeats"] + 1):
            group.send(weights)
        return
    times = []
    for _ in range(args["repeats"] + 1):
        t = time.perf_counter()
        got = {k: v.cuda() for k, v in group.receive().items()}
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    size = sum(v.numel() * v.element_size() for v in got.values())
    print(json.dumps({"path": "collective group (gloo, via host memory)", "seconds": statistics.median(times[1:]),
                      "bytes": size}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="step,long")
    ap.add_argument("--engines", default="vllm,static,hf,vllm-proc")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcrl-gpu-rollout"))
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "gpu_rollout.json")
    ap.add_argument("--one", nargs=3, metavar=("ENGINE", "SHAPE", "BANDWIDTH"), help=argparse.SUPPRESS)
    ap.add_argument("--group-member", nargs=2, metavar=("RANK", "ARGS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.group_member:
        group_member(int(args.group_member[0]), json.loads(args.group_member[1]))
        return 0
    if args.one:
        engine, name, bandwidth = args.one
        print("ROW", json.dumps(one_engine(engine, name, args.work, args.repeats, float(bandwidth))), flush=True)
        return 0
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    import torch

    bandwidth, device = copy_bandwidth(), torch.cuda.get_device_name(0)
    torch.cuda.empty_cache()
    print(f"{device}: device-to-device copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows, syncs = [], []

    def save(partial: bool) -> None:      # after every engine: a call cut short keeps what it measured
        args.json.write_text(json.dumps({"device": device, "copy_bandwidth": bandwidth, "partial": partial, "rows": rows,
                                         "weight_sync": syncs}, indent=1))
    try:          # first: seconds, where the engines take minutes and a call may cut them short
        syncs.append(group_sync(args.work, args.repeats))
    except (RuntimeError, ValueError, IndexError) as e:     # a member's exit, or no line of result
        print(f"group sync: {e}", flush=True)
        syncs.append({"path": "collective group (gloo, via host memory)", "error": str(e)})
    save(partial=True)
    for name in args.shapes.split(","):
        for engine in args.engines.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", engine, name, str(bandwidth), "--work", str(args.work),
                                   "--repeats", str(args.repeats)], capture_output=True, text=True, env=env, cwd=ROOT)
            found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            if proc.returncode or not found:
                print(f"{engine} on {name}: exited {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
                rows.append({"engine": engine, "shape": name, "error": proc.stderr[-2000:]})
                continue
            for r in json.loads(found[0]):
                rows.append(r)
                print(f"{r['engine']:24} {name:5} {r['sampled_tok_s']:>10.0f} tok/s {r['of_bound']:>7.1%} of bound "
                      f"(ready in {r['ready_s']} s)", flush=True)
                if "top" in r.get("profile", {}):
                    pr = r["profile"]
                    print(f"  GPU busy {pr['gpu_busy']:.0%} of {pr['wall_s']:.3f} s, {pr['kernel_launches']} kernels; "
                          + "; ".join(f"{k['share']:.0%} {k['kernel'][:50]} ×{k['count']}" for k in pr["top"][:5]), flush=True)
                if "load_weights_s" in r:
                    where = "its own process, as one buffer" if engine == "vllm-proc" else "same process, on the GPU"
                    syncs.append({"path": f"load_weights into {engine} ({where})", "seconds": r["load_weights_s"]})
            save(partial=True)
    print(f"\n{'shape':6} {'engine':24} {'rows':>5} {'new':>5} {'s':>8} {'tok/s':>9} {'of bound':>9}")
    for r in rows:
        if "error" not in r:
            print(f"{r['shape']:6} {r['engine']:24} {r['rows']:>5} {r['new_tokens']:>5} {r['generate_s']:>8.3f} "
                  f"{r['sampled_tok_s']:>9.0f} {r['of_bound']:>9.1%}")
    print(f"\n{'weight sync (step shape, bf16)':58} {'s':>7}")
    for s in syncs:
        print(f"{s['path']:58} {s.get('seconds', float('nan')):>7.3f}")
    save(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
