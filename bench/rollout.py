"""Rollout throughput and weight-sync time, in one run on this machine.

    bare vLLM      vllm.LLM.generate on the prompts, in a plain process (no Ray, no hpcrl)
    hpcrl vllm     ActorRollout.generate_sequences with rollout_engine: vllm, called through its
                   WorkerGroup on a local Ray (dispatch, Batch in and out, padding included)
    hpcrl torch    the same call with rollout_engine: torch
    sync           the actor's weights into its own vLLM engine (colocated, in process), and into
                   a separate rollout role's engine (object store)

Same model (a random Qwen2 of --hidden/--layers), same prompts, same per-row seeds, so both vLLM
paths generate the same tokens; tokens/s counts generated tokens. The engines' calls alternate
(this machine is noisy); median of --repeat rounds after one warm-up round.

    python bench/rollout.py [--prompts 256] [--new-tokens 32] [--repeat 5] [--json bench/rollout.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BARE = """
import json, sys, time
from pathlib import Path
from hpcrl.engines.rollout.vllm_rollout import vllm_environment
args = json.loads(sys.argv[1])
vllm_environment(Path(args["cache_dir"]))
import os; os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
llm = LLM(model=args["model_dir"], skip_tokenizer_init=True, dtype="float32", seed=args["seed"], enforce_eager=True,
          distributed_executor_backend="uni", logprobs_mode="processed_logprobs")
prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
params = [SamplingParams(temperature=args["temperature"], max_tokens=args["new_tokens"], stop_token_ids=[args["eos"]],
                         logprobs=0, seed=s, detokenize=False) for s in args["seeds"]]
for _ in sys.stdin:                       # one generate per line the bench sends
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    print("RESULT", json.dumps({"seconds": took, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
"""


class BareEngine:
    """vLLM in a plain process of its own, generating when told, so its calls can alternate with
    hpcrl's under the same load (this machine is shared and noisy)."""

    def __init__(self, args: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", BARE, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def __call__(self) -> tuple[float, int]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = ""
        while not line.startswith("RESULT "):     # vLLM logs on stdout too
            line = self.proc.stdout.readline()
            if not line:
                sys.exit(f"bare vLLM exited with {self.proc.wait()}")
        out = json.loads(line.removeprefix("RESULT "))
        return out["seconds"], out["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def timed_generate(group, prompts) -> tuple[float, int]:
    t0 = time.perf_counter()
    gen = group.generate_sequences(prompts)
    return time.perf_counter() - t0, int(gen["response_mask"].sum())


def median_call(fn, repeat: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "rollout.json")
    args = ap.parse_args()

    import ray

    from hpcrl.controller import ResourcePool, WorkerGroup
    from hpcrl.engines.rollout.vllm_rollout import row_seed
    from hpcrl.models import CharTokenizer, load_causal_lm
    from hpcrl.ppo.config import TrainConfig
    from hpcrl.ppo.data import PromptDataset
    from hpcrl.ppo.loop import prepare_inputs
    from hpcrl.ppo.roles import ActorRollout, Rollout
    from hpcrl.ppo.roles.rollout import step_seed
    from hpcrl.raycluster.session import start_local

    run = Path(tempfile.mkdtemp(prefix="hpcrl-bench-rollout-"))
    cfg = TrainConfig(rollout_engine="vllm", batch_size=args.prompts, max_new_tokens=args.new_tokens,
                    hidden_size=args.hidden, layers=args.layers, heads=args.hidden // 64, cache_dir=str(run / "cache"),
                    task_digits=6)
    model_dir, prompts_path = prepare_inputs(cfg, run)
    tok = CharTokenizer.load(model_dir)
    prompts = PromptDataset(prompts_path, tok, cfg.data.batch_size, cfg.seed).next_batch()
    prompts.meta["step"] = 1
    rows = [ids[m.bool()].tolist() for ids, m in zip(prompts["prompt_ids"], prompts["prompt_mask"])]
    seed = step_seed(cfg.seed, 1, 0)     # what Generates uses for step 1, rank 0
    bare_args = {"model_dir": str(model_dir), "cache_dir": cfg.rollout.cache_dir, "seed": cfg.seed, "prompts": rows,
                 "seeds": [row_seed(seed, i) for i in range(len(rows))], "temperature": cfg.rollout.temperature,
                 "new_tokens": cfg.rollout.max_new_tokens, "eos": tok.eos_id}
    bare = BareEngine(bare_args)

    # throughput: the role alone on the node, with every CPU, as the bare engine has; each hpcrl
    # call follows a bare one, and each engine is compared with the bare calls of its own rounds
    start_local(["actor_rollout"], run_dir=run)
    results, bare_rounds = {}, {}
    try:
        for engine in ("vllm", "torch"):
            conf = cfg.model_copy(deep=True)
            conf.rollout.engine = engine
            group = WorkerGroup(ResourcePool.for_role("actor_rollout"), ActorRollout, (str(model_dir), conf))
            ours, theirs = [], []
            for i in range(args.repeat + 1):       # the first round warms up
                b, (t, n) = bare(), timed_generate(group, prompts)
                if i:
                    theirs.append(b)
                    ours.append(t)
            results[f"hpcrl {engine}"] = (statistics.median(ours), n)
            bare_rounds[engine] = (statistics.median(t for t, _ in theirs), theirs[0][1])
            group.shutdown()
    finally:
        bare.close()
        ray.shutdown()
    results = {"bare vllm": bare_rounds["vllm"], **results}
    # weight sync: into the actor's own engine, and into a separate rollout role's
    start_local(["actor_rollout", "rollout"], run_dir=run)
    try:
        conf = cfg
        actor = WorkerGroup(ResourcePool.for_role("actor_rollout"), ActorRollout, (str(model_dir), conf))
        rollout = WorkerGroup(ResourcePool.for_role("rollout"), Rollout, (str(model_dir), conf))
        sync_local = median_call(actor.sync_rollout_weights, args.repeat)
        dtype = rollout.sampling_dtype()
        sync_remote = median_call(lambda: rollout.load_weights(actor.export_weights.future(dtype), 1), args.repeat)
    finally:
        ray.shutdown()

    params = sum(p.numel() for p in load_causal_lm(model_dir).parameters())
    print(f"\n{args.prompts} prompts x up to {args.new_tokens} new tokens, Qwen2 {params / 1e6:.1f}M params "
          f"(hidden {args.hidden}, {args.layers} layers), float32, {os.cpu_count()} CPUs; median of {args.repeat}")
    print(f"{'engine':<14}{'seconds':>10}{'tokens':>9}{'tokens/s':>11}{'vs bare':>9}")
    table = {}
    for name, (t, n) in results.items():
        bare_t, bare_n = bare_rounds["torch" if name == "hpcrl torch" else "vllm"]
        vs_bare = (n / t) / (bare_n / bare_t)
        table[name] = {"seconds": t, "tokens": n, "tokens_per_s": n / t, "vs_bare": vs_bare}
        print(f"{name:<14}{t:>10.3f}{n:>9}{n / t:>11.0f}{vs_bare:>9.2f}")
    print(f"\nweight sync per step: colocated (in process) {sync_local * 1e3:.1f} ms, "
          f"separate rollout role (object store) {sync_remote * 1e3:.1f} ms")
    result = {"params": params, "prompts": args.prompts, "new_tokens": args.new_tokens, "engines": table,
              "sync_ms": {"colocated": sync_local * 1e3, "separate_role": sync_remote * 1e3}}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
