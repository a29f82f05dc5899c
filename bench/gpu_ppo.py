"""PPO on GPUs: hpcrl's torch and megatron engines and TRL's PPOTrainer on the same
Qwen2-0.5B-shaped random model (no download), batch and GPU, in one call. Prints one table and
writes bench/gpu_ppo.json.

    python bench/gpu_ppo.py                      # one GPU: hpcrl torch, hpcrl megatron, TRL
    python bench/gpu_ppo.py --layout two-gpus    # two GPUs: actor on GPU 0 and critic on GPU 1 vs all on GPU 0
    python bench/gpu_ppo.py --layout rollout-apart --runs torch   # one GPU: a rollout role apart, sequential vs pipelined
    python bench/gpu_ppo.py --model /tmp/smollm2 --runs torch,megatron   # a real HF model folder instead

A step: 64 prompts × 256 prompt tokens, 256 sampled tokens each (no stop token: full length), then
log-probs, reference log-probs, values, a rule reward, GAE, one critic and one actor update over the
whole batch (micro-batches of 32, for TRL too; HPCRL_BENCH_MICRO changes it). Every hpcrl run is
the real trainer on a local Ray cluster in a fresh process; the first step (compile, graph capture, allocator warm-up) is left out of the figures.

With --model (a real model, e.g. SmolLM2-135M-Instruct from `hpcrl data smollm2`) the prompts are
random ids of its vocabulary and its own stop tokens end responses, so a step's responses may be
shorter: the hpcrl rows count the tokens the step had (its mean response length; generation decodes
until its longest response ends). TRL's rows count full-length responses.

tokens/s counts prompt + response tokens of the step. Each phase against its bound: generation
against reading the bf16 weights once per decode step and the KV cache so far at the measured
4.3 TB/s (gen % bound); scoring (old and reference log-probs, values) and the two updates as MFU, their
model FLOPs (model_flops) over the phase's time and the H200's measured dense bf16 rate (790 TFLOP/s).
bench/gpu_phases.py times each phase alone, eager and compiled.
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

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936, max_position_embeddings=1024, tie_word_embeddings=False)
BATCH, PROMPT, RESPONSE = 64, 256, 256
MICRO = int(os.environ.get("HPCRL_BENCH_MICRO", 32))
PEAK = 790e12          # dense bf16 FLOP/s, measured on the H200
BANDWIDTH = 4.3e12     # bytes/s, a device-to-device copy measured on the H200


def shape_of(model_dir: Path | None) -> dict:
    """SHAPE's fields from a model folder's config.json (None: SHAPE, the random model's)."""
    if model_dir is None:
        return SHAPE
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))    # configs of plain multi-head attention
    cfg.setdefault("tie_word_embeddings", False)
    missing = [k for k in SHAPE if k not in cfg]
    if missing:
        raise SystemExit(f"--model {model_dir}: its config.json has no {', '.join(missing)} (a decoder of the Llama/Qwen2 kind?)")
    return {k: cfg[k] for k in SHAPE}


def make_inputs(work: Path, model: Path | None = None) -> tuple[Path, Path]:
    """The model folder (None: a random Qwen2-0.5B-shaped model with a tokenizer of one character per
    id, written once) and 64 prompts of random ids of its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hpcrl.models import CharTokenizer

    model_dir, prompts = model or work / "model", work / f"prompts-{model.name if model else 'random'}.jsonl"
    if model and not (model / "config.json").exists():
        raise SystemExit(f"--model {model}: no config.json there (an HF model folder, e.g. from `hpcrl data smollm2 DIR`)")
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        random_model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0))
        random_model.save_pretrained(model_dir)
        CharTokenizer("".join(chr(0x10000 + i) for i in range(SHAPE["vocab_size"] - 3))).save(model_dir)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(3, shape_of(model_dir)["vocab_size"], (BATCH, PROMPT), generator=g)
    prompts.write_text("".join(json.dumps({"prompt_ids": r.tolist()}) + "\n" for r in rows))
    return model_dir, prompts


def hpcrl_config(engine: str, model_dir: Path, prompts: Path, steps: int, colocate: list[list[str]]):
    """engine: the train engine, or TRAIN+ROLLOUT ("torch+vllm": vLLM samples, at 0.3 of the GPU)."""
    from hpcrl.ppo.config import TrainConfig

    train_engine, _, rollout_engine = engine.partition("+")
    return TrainConfig(model_dir=str(model_dir), dataset=str(prompts), total_steps=steps, batch_size=BATCH,
                       max_new_tokens=RESPONSE, mini_batch_size=BATCH, micro_batch_size=MICRO, ppo_epochs=1,
                       warmup_steps=0, actor_lr=1e-6, critic_lr=1e-6, train_engine=train_engine, colocate=colocate,
                       save_last=False, progress=False, reward_fn="hpcrl.ppo.tasks.copy_digits:score",   # a cheap rule
                       **({"rollout_engine": rollout_engine, "rollout_gpu_memory": 0.3} if rollout_engine else {}))


# the hpcrl runs of each --layout: the layouts they run in, and how the table names them
RUNS_OF_LAYOUT = {"one-gpu": {"one-gpu": ""},
                  "two-gpus": {"one-gpu": "all roles on GPU 0", "two-gpus": "actor GPU 0 / critic GPU 1"},
                  "rollout-apart": {"rollout-apart": "rollout apart, sequential",
                                    "rollout-apart-pipelined": "rollout apart, pipelined"}}


def run_dir(work: Path, engine: str, layout: str, model: Path | None) -> Path:
    return work / f"hpcrl-{engine}-{layout}{'-' + model.name if model else ''}"


def run_hpcrl(engine: str, work: Path, steps: int, layout: str, model: Path | None) -> list[dict]:
    """The trainer in a fresh process on a fresh local Ray (per layout); its metrics records."""
    run = run_dir(work, engine, layout, model)
    subprocess.run(["rm", "-rf", str(run)], check=True)
    cmd = [sys.executable, __file__, "--one", engine, "--layout", layout, "--steps", str(steps), "--work", str(work),
           *(["--model", str(model)] if model else [])]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def one_hpcrl(engine: str, work: Path, steps: int, layout: str, model: Path | None) -> None:
    import contextlib

    import ray

    from hpcrl.ppo.loop import train
    from hpcrl.raycluster.session import start_local
    from local_nodes import local_nodes

    model_dir, prompts = make_inputs(work, model)
    run = run_dir(work, engine, layout, model)
    roles = ["actor_rollout", "critic", "ref", "reward"]
    if layout == "one-gpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        cfg = hpcrl_config(engine, model_dir, prompts, steps, [roles])
        start_local(roles, run_dir=run)
        nodes = contextlib.nullcontext()
    else:   # two Ray nodes as two hetjob components would give
        if layout == "two-gpus":      # the critic alone on GPU 1
            layout_nodes = [(["actor_rollout", "ref", "reward"], "0", 8), (["critic"], "1", 8)]
        else:                         # the rollout role alone; both nodes are GPU 0, which the two processes share
            layout_nodes = [(["rollout"], "0", 8), (roles, "0", 8)]
        cfg = hpcrl_config(engine, model_dir, prompts, steps, [layout_nodes[0][0] if layout == "two-gpus" else roles])
        if layout != "two-gpus":
            cfg = cfg.updated(rollout_role=True, pipeline="one_step_off" if layout.endswith("pipelined") else "off")
        nodes = local_nodes(layout_nodes, dict(os.environ), run / "logs" / "ray")
    with nodes as address:
        if address:
            ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False)
        try:
            train(cfg, run)
        finally:
            ray.shutdown()


def run_trl(work: Path, steps: int) -> list[dict]:
    """TRL's PPOTrainer (bf16 weights, its own generate) on the same model, prompts and batch."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    model_dir, prompts = make_inputs(work)
    ids = [json.loads(line)["prompt_ids"] for line in prompts.read_text().splitlines()]
    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="t0", eos_token="t2")
    load = dict(dtype=torch.bfloat16, local_files_only=True)
    policy, ref = (AutoModelForCausalLM.from_pretrained(model_dir, **load) for _ in range(2))
    value, reward = (AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, **load) for _ in range(2))
    data = Dataset.from_dict({"input_ids": ids * steps})
    args = PPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=MICRO,
                     gradient_accumulation_steps=BATCH // MICRO, num_mini_batches=1, num_ppo_epochs=1,
                     total_episodes=BATCH * steps, response_length=RESPONSE, local_rollout_forward_batch_size=BATCH,
                     learning_rate=1e-6, bf16=True, report_to=[], num_sample_generations=0, save_strategy="no",
                     logging_steps=1, seed=1, temperature=1.0, stop_token=None, missing_eos_penalty=None)
    rollout_s: list[float] = []
    generation = trl_ppo.batch_generation

    def timed_generation(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = generation(*a, **k)
        torch.cuda.synchronize()
        rollout_s.append(time.perf_counter() - t)
        return out
    trl_ppo.batch_generation = timed_generation
    stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=data, eval_dataset=data, value_model=value, callbacks=[Stamp()])
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train()
    ends = [start, *stamps]
    return [{"timing/generate": rollout_s[i], "timing/step": ends[i + 1] - ends[i],
             "throughput/tokens_per_s": BATCH * (PROMPT + RESPONSE) / (ends[i + 1] - ends[i])} for i in range(len(stamps))]


def model_flops(forward_only: bool, lm_head: bool, shape: dict = SHAPE, response: float = RESPONSE) -> float:
    """Model FLOPs of one pass over the step's batch of `response` tokens per answer: 2 · parameters ·
    tokens forward (3× that with the backward), attention 4 · layers · width · sequence per token
    forward, the LM head on the response positions only (lm_head False: the critic's 1-wide head,
    left out)."""
    h, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn
    seq, tokens = PROMPT + response, BATCH * (PROMPT + response)
    fwd = 2 * layers * per_layer * tokens + 4 * layers * h * seq * tokens
    if lm_head:
        fwd += 2 * h * shape["vocab_size"] * BATCH * response
    return fwd if forward_only else 3 * fwd


def decode_bytes(shape: dict = SHAPE, steps: int = RESPONSE, batch: int = BATCH, prompt: int = PROMPT) -> float:
    """Bytes one generation of `steps` decode steps for `batch` rows of `prompt` tokens must read: the
    bf16 weights once per step, and the KV cache of the tokens so far."""
    h, layers, ffn, v = (shape[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    weights = 2 * (layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + v * h)
    cache_per_token = 2 * layers * 2 * kv * batch            # k and v, bf16, every row
    return steps * weights + cache_per_token * sum(prompt + t for t in range(steps))


def summarise(name: str, records: list[dict], shape: dict = SHAPE) -> dict:
    timed = records[1:] or records     # the first step compiles and captures
    med = lambda k: statistics.median(r[k] for r in timed) if all(k in r and r[k] is not None for r in timed) else None  # noqa: E731
    row = {"run": name, "steps_timed": len(timed), "step_s": med("timing/step"), "tokens_per_s": med("throughput/tokens_per_s"),
           "generate_s": med("timing/generate"), "response_mean": med("response_length/mean") or RESPONSE}
    for phase in ("score", "update_critic", "update_actor", "sync_weights"):
        row[f"{phase}_s"] = med(f"timing/{phase}")
    row["log_prob_diff"] = med("rollout/log_prob_diff")     # the sampler's log-probs against the trainer's
    response, longest = row["response_mean"], int(med("response_length/max") or RESPONSE)
    if row["generate_s"]:
        row["rollout_tokens_per_s"] = BATCH * response / row["generate_s"]
        row["generate_of_bound"] = decode_bytes(shape, longest) / BANDWIDTH / row["generate_s"]
    kept = ("step", "response_length/mean", "rollout/log_prob_diff")
    row["per_step"] = [{k: v for k, v in r.items() if k.startswith("timing/") or k in kept} for r in records]
    if row["update_actor_s"]:
        score = 2 * model_flops(True, True, shape, response) + model_flops(True, False, shape, response)  # old, ref, values
        update = model_flops(False, True, shape, response) + model_flops(False, False, shape, response)    # actor, critic
        row["update_mfu"] = update / (row["update_actor_s"] + row["update_critic_s"]) / PEAK
        row["score_mfu"] = score / row["score_s"] / PEAK
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="PPO steps per run (the first is not timed; the seeded "
                    "sampler's first early stop, in step 2, compiles the layers' padded kind)")
    ap.add_argument("--runs", default="torch,megatron,trl", help="comma list of torch, megatron, trl; "
                    "torch+vllm: the torch engine trains, vLLM samples")
    ap.add_argument("--layout", default="one-gpu", choices=["one-gpu", "two-gpus", "rollout-apart", "rollout-apart-pipelined"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcrl-gpu-bench"))
    ap.add_argument("--model", type=Path, help="a real HF model folder instead of the random Qwen2-0.5B-shaped one")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu_ppo.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.model = args.model and args.model.resolve()     # the runs' processes start in the repository root
    if args.one:
        one_hpcrl(args.one, args.work, args.steps, args.layout, args.model)
        return 0
    if args.model and "trl" in args.runs.split(","):
        ap.error("--model: TRL runs on the random model only (its tokenizer here is one word per id)")
    shape, of = shape_of(args.model), f", {args.model.name}" if args.model else ""
    rows, failed = [], []
    for run in args.runs.split(","):
        t = time.perf_counter()
        if run == "trl":
            rows.append(summarise("TRL PPOTrainer", run_trl(args.work, args.steps)))
        for layout, name in ({} if run == "trl" else RUNS_OF_LAYOUT.get(args.layout, RUNS_OF_LAYOUT["one-gpu"])).items():
            try:
                records = run_hpcrl(run, args.work, args.steps, layout, args.model)
            except subprocess.CalledProcessError as e:     # the other runs still count; its log says why
                print(f"{run} ({layout}) failed: {e}", flush=True)
                failed.append(f"hpcrl {run} ({layout}): {e}")
                continue
            rows.append(summarise(f"hpcrl {run}{', ' + name if name else ''}{of}", records, shape))
        print(f"{run}: {time.perf_counter() - t:.0f} s", flush=True)
    import torch

    device = torch.cuda.get_device_name(0)
    args.out.write_text(json.dumps({"device": device, "layout": args.layout, "model": str(args.model or "random"),
                                    "shape": shape, "batch": BATCH, "prompt": PROMPT, "response": RESPONSE,
                                    "micro_batch": MICRO, "rows": rows, "failed": failed}, indent=1))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)   # noqa: E731
    print(f"\n{device}; batch {BATCH} prompts × {PROMPT} prompt + {RESPONSE} response tokens, micro-batch {MICRO}; "
          "median of the steps after the first")
    print(f"{'run':40} {'step s':>7} {'tok/s':>8} {'resp':>5} {'gen s':>6} {'gen tok/s':>9} {'% bound':>7} {'score s':>7} "
          f"{'MFU':>6} {'crit s':>6} {'actor s':>7} {'upd MFU':>7} {'sync s':>6}")
    for r in rows:
        print(f"{r['run']:40} {fmt(r['step_s'], '7.2f')} {fmt(r['tokens_per_s'], '8.0f')} {r['response_mean']:5.0f} "
              f"{fmt(r['generate_s'], '6.2f')} "
              f"{fmt(r.get('rollout_tokens_per_s'), '9.0f')} {fmt(r.get('generate_of_bound'), '7.1%')} "
              f"{fmt(r['score_s'], '7.2f')} {fmt(r.get('score_mfu'), '6.1%')} {fmt(r['update_critic_s'], '6.2f')} "
              f"{fmt(r['update_actor_s'], '7.2f')} {fmt(r.get('update_mfu'), '7.1%')} {fmt(r['sync_weights_s'], '6.2f')}")
    for f in failed:
        print(f"failed: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
