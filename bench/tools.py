"""Learning with a tool: SmolLM2-135M-Instruct on 3-term chain sums ("17 + 84 - 9 =", 3.7% greedy in its
head) with GRPO, once without an environment (plain) and once calling a calculator over up to 4 turns
(tools, hpcrl.environments:ToolEnvironment), held-out greedy accuracy against seconds of training,
one run after the other on the same GPU. bench/real_model.py's runs (its settings, held-out set,
clock and table); prints the table and writes bench/tools.json.

    hpcrl data smollm2 MODEL_DIR
    hpcrl data reasoning-gym chain_sum DATA_DIR --train 4000 --test 300 --set min_terms=3 max_terms=3 min_digits=1 max_digits=2
    python bench/tools.py --model MODEL_DIR --data DATA_DIR [--minutes 15] [--runs plain,tools] [--max-turns 4]

Held-out validation goes through the same episodes as training: the tools run is measured with its
calculator, the plain run without one; that is the comparison. The tool is described to SmolLM2 in
a system message (its chat template ignores `tools`). The env role runs beside the driver. The
calls must come from the model: env/tool_calls and env/turns in the tools run's metrics.jsonl say
whether they do (SmolLM2-135M-Instruct as it comes wrote none in 64 sampled episodes on CPU, with or
without a worked example in the system message: GRPO has no call to reinforce until one appears).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_model  # noqa: E402  (bench/real_model.py: the runs, their settings and the table)


def main() -> int:
    ap = real_model.parser(__doc__.split("\n\n")[0], "plain,tools", real_model.ROOT / "bench" / "tools.json",
                           Path("/tmp/hpcrl-bench-tools"))
    ap.add_argument("--max-turns", type=int, default=4, help="environment.max_turns of the tools run")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="environment.max_tokens of the tools run (default: --max-turns × --new-tokens)")
    ap.set_defaults(minutes="15")
    args = ap.parse_args()
    environment = {"cls": "hpcrl.environments:ToolEnvironment", "kwargs": {"tools": ["calculator"]},
                   "max_turns": args.max_turns, "max_tokens": args.max_tokens or args.max_turns * args.new_tokens}
    # the calculator's description, a system message, makes the prompt ~240 tokens (the plain run's 64)
    tools = {**real_model.GRPO, "environment": environment, "max_prompt_length": 320}
    real_model.learn(args, {"plain": real_model.GRPO, "tools": tools})
    return 0


if __name__ == "__main__":
    sys.exit(main())
