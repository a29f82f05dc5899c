"""LoRA beside full fine-tuning, learning a real verifiable task: SmolLM2-135M-Instruct on 2-term chain
sums with GRPO, held-out greedy accuracy against seconds of training, one run after the other on the
same GPU. bench/real_model.py's runs (its data, held-out set, settings, clock and table); prints the
table and writes bench/lora.json.

    hpcrl data smollm2 MODEL_DIR
    hpcrl data reasoning-gym chain_sum DATA_DIR --train 4000 --test 300 --set min_terms=2 max_terms=2 min_digits=1 max_digits=2
    python bench/lora.py --model MODEL_DIR --data DATA_DIR [--minutes 10] [--runs full,lora] [--rank 32] [--lora-lr 5e-5]

full: bench/real_model.py's GRPO run (every weight trains, actor_lr 5e-6). lora: the same with
train.lora (adapters of --rank on every linear layer, alpha 32) and actor_lr --lora-lr: LoRA learns
at about ten times full fine-tuning's rate (Schulman et al., "LoRA Without Regret", 2025).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_model  # noqa: E402  (bench/real_model.py: the runs, their settings and the table)


def main() -> int:
    ap = real_model.parser(__doc__.split("\n\n")[0], "full,lora", real_model.ROOT / "bench" / "lora.json",
                           Path("/tmp/hpcrl-bench-lora"))
    ap.add_argument("--rank", type=int, default=32, help="train.lora.rank of the lora run")
    ap.add_argument("--lora-lr", type=float, default=5e-5, help="the lora run's actor_lr")
    args = ap.parse_args()
    lora = {**real_model.GRPO, "actor_lr": args.lora_lr, "lora": {"rank": args.rank, "alpha": 32.0}}
    real_model.learn(args, {"full": real_model.GRPO, "lora": lora})
    return 0


if __name__ == "__main__":
    sys.exit(main())
