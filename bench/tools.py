"""Learning with a tool: SmolLM2-135M-Instruct on 3-term chain sums ("17 + 84 - 9 =", 3.7% greedy in its
head) with GRPO, once without an environment (plain) and once calling a calculator over up to 4 turns
(tools, hpcrl.environments:ToolEnvironment), and the same calculator as an agent of your own written
against the openai package (agent, jobs/chain_sum_agent.py through the endpoint: issue 59), held-out greedy
accuracy against seconds of training, one run after the other on the same GPU. bench/real_model.py's runs (its settings, held-out set,
clock and table); prints the table and writes bench/tools.json.

    hpcrl data smollm2 MODEL_DIR
    hpcrl data reasoning-gym chain_sum DATA_DIR --train 4000 --test 300 --set min_terms=3 max_terms=3 min_digits=1 max_digits=2
    python bench/tools.py --model MODEL_DIR --data DATA_DIR [--minutes 15] [--runs plain,tools,agent] [--max-turns 4]
    python bench/tools.py --model MODEL_DIR --data DATA_DIR --warmup-only --cpu --warmup-steps 40 --warmup-batch 8
                                                           # the warm-up alone and its check, on CPU

Held-out validation goes through the same episodes as training: the tools run is measured with its
calculator, the plain run without one; that is the comparison. The tool is described to SmolLM2 in
a system message (its chat template ignores `tools`). The env role runs beside the driver.

Warm-up (a supervised cold start, as ReTool's and verl's multi-turn recipes start RL from an SFT'd
model): SmolLM2-135M-Instruct as it comes never calls the tool (none in 64 sampled episodes on CPU,
with or without a worked example in the system message), so GRPO has no call to reinforce. Before the
tools run, --warmup-steps steps of supervised fine-tuning on demonstrations made from the TRAINING
problems, rendered token for token as the tools run's episodes are (the driver's prompt with the tool
in the system message; a turn that calls the calculator on the question's expression; the tool's
answer as ToolEnvironment gives it and the template renders it after that turn; a turn "The answer
is N." with N copied from the tool's answer), loss on the assistant's turns only. It teaches the call
format and copying the tool's result, nothing about arithmetic: no demonstration holds an answer the
model did not get from the tool. The tools run starts from the warmed model (WORK/warmup-model); the
plain run keeps the original model. --warmup-check held-out problems are then played greedily through
the same rendering, before and after the warm-up (off the clock): the fraction of first turns that are
a well-formed calculator call, and of final answers that are right. All of it lands in the JSON's
"warmup" (steps, seconds). --warmup-steps 0: the tools run starts from the original model.
On CPU (2 cores, shared; 40 steps of 8, lr 3e-5: 767 s, the loss 0.81 to 0.0000 by step 39; on a GPU
the default 60 steps of 16 take seconds), 30 held-out problems: well-formed first-turn calls 0/30
before, 30/30 after; right final answers 2/30 before (no call, its own arithmetic), 30/30 after.
env/tool_calls and env/turns in the tools run's metrics.jsonl say whether the calls go on during RL.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_model  # noqa: E402  (bench/real_model.py: the runs, their settings and the table)
from hpcrl.environments import ToolEnvironment, Turn  # noqa: E402  (the checkout's: real_model put it on the path)
from hpcrl.models.tokenizer import load_tokenizer  # noqa: E402
from hpcrl.ppo.data import prompt_ids, read_rows  # noqa: E402
from hpcrl.ppo.verifiers import last_number  # noqa: E402

TOOLS = ["calculator"]


def question(row: dict) -> str:
    """The problem's expression: "4 + 3 + 3" of "... arithmetic problem: 4 + 3 + 3 =" (the last user message)."""
    text = next(m["content"] for m in reversed(list(row["prompt"])) if m["role"] == "user")
    return text.rsplit(":", 1)[-1].strip().removesuffix("=").strip()


def calculator_call(expression: str) -> str:
    """A Hermes tool call of the calculator, as the system message's format describes it."""
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


async def tool_turn(row: dict, text: str, tools: list) -> Turn:
    """ToolEnvironment's answer to one turn of the model, as the env role gives it in an episode."""
    env = ToolEnvironment(tools=tools)
    await env.start(row)
    try:
        return await env.step(text)
    finally:
        await env.close()


def demonstration(row: dict, tok, tools: list) -> tuple[list[int], list[int]] | None:
    """One worked tools episode as token ids and their loss mask (1: the assistant's tokens): the
    prompt as the driver renders it (hpcrl.ppo.data.prompt_ids, the tools in the system message),
    a turn that calls the calculator on the question's expression, the tool's answer as
    ToolEnvironment gives it and the template renders it after the turn's stop token
    (encode_followup, as hpcrl/ppo/episodes.py appends it), then a turn that states that answer.
    None where the calculator's result is not the row's ground truth."""
    call = calculator_call(question(row))
    turn = asyncio.run(tool_turn(row, call, tools))
    result = turn.observation[0]["content"] if turn.observation else ""
    if last_number(result, row["reward_model"]["ground_truth"]) != 1.0:
        return None
    stop = tok.stop_ids[:1]
    prompt = prompt_ids(row, tok, ToolEnvironment.tool_schemas(tools))
    first = tok.tok(call, add_special_tokens=False)["input_ids"] + stop
    seen = tok.encode_followup(turn.observation)
    final = tok.tok(f"The answer is {result}.", add_special_tokens=False)["input_ids"] + stop
    return prompt + first + seen + final, [0] * len(prompt) + [1] * len(first) + [0] * len(seen) + [1] * len(final)


def demonstrations_loss(model, picked: list[tuple[list[int], list[int]]], pad_id: int, device):
    """Mean cross-entropy over the masked tokens of `picked`. The tokens every demonstration starts
    with (the system message with the tool, ~230 of ~300) go through the model once, their keys and
    values then shared by the batch's rows (gradients flow back through them): the same loss and
    gradients as the whole rows, at a third of the compute."""
    import torch
    from transformers import DynamicCache

    shared = min(len(ids) for ids, _ in picked) - 1
    shared = next((k for k in range(shared) if len({ids[k] for ids, _ in picked}) > 1), shared)
    cache = DynamicCache()
    model(input_ids=torch.tensor([picked[0][0][:shared]], device=device), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(len(picked))
    width = max(len(ids) for ids, _ in picked) - shared
    ids = torch.full((len(picked), width), pad_id, dtype=torch.long)
    labels = torch.full((len(picked), width), -100, dtype=torch.long)
    attention = torch.zeros((len(picked), shared + width), dtype=torch.long)
    for k, (seq, mask) in enumerate(picked):
        rest = torch.tensor(seq[shared:])
        ids[k, :len(rest)], attention[k, :len(seq)] = rest, 1
        labels[k, :len(rest)] = torch.where(torch.tensor(mask[shared:]).bool(), rest, -100)
    # the shared tokens are never the assistant's (mask 0), so no label is lost at the seam
    return model(input_ids=ids.to(device), attention_mask=attention.to(device), past_key_values=cache,
                 labels=labels.to(device), use_cache=True).loss


def warm_up(args, out: Path) -> dict:
    """Supervised cold start: --warmup-steps AdamW steps of --warmup-batch demonstrations (drawn
    from the first --warmup-examples training problems, shuffled), cross-entropy on the assistant's
    tokens only; fp32 weights, bf16 autocast on a GPU. Saves the model and the tokenizer's files
    to `out`. Returns its seconds and steps (the training loop's seconds: loading, the
    demonstrations and saving not counted; wall_s counts them)."""
    import torch
    from transformers import AutoModelForCausalLM

    t_wall = time.perf_counter()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    tok = load_tokenizer(args.model)
    rows = read_rows(args.data / "train.parquet")
    random.Random(args.seed).shuffle(rows)
    demos = [d for d in (demonstration(r, tok, TOOLS) for r in rows[:args.warmup_examples]) if d]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    order = random.Random(args.seed + 1)
    losses, t0 = [], time.perf_counter()
    for step in range(args.warmup_steps):
        picked = order.sample(demos, args.warmup_batch)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = demonstrations_loss(model, picked, tok.pad_id, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == args.warmup_steps - 1:
            print(f"warm-up step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    seconds = time.perf_counter() - t0
    subprocess.run(["rm", "-rf", str(out)], check=True)
    model.save_pretrained(out)     # fp32, as trained: in bf16 most of its small updates would round away
    for f in Path(args.model).iterdir():     # the tokenizer's files, generation_config.json (its stop ids), ...
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".gguf") and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return {"steps": args.warmup_steps, "seconds": round(seconds, 1), "wall_s": round(time.perf_counter() - t_wall, 1),
            "demonstrations": len(demos), "batch": args.warmup_batch, "lr": args.warmup_lr, "device": device,
            "loss_first": round(losses[0], 4) if losses else None, "loss_last": round(losses[-1], 4) if losses else None,
            "model": str(out)}


def check(model_dir: Path, args) -> dict:
    """Greedy tools episodes on the first --warmup-check held-out problems, rendered as the tools
    run's (up to --max-turns turns of --new-tokens): the fraction whose first turn is a well-formed
    calculator call (one that runs), and the fraction whose final answer is right (last_number, as
    the reward role scores chain_sum)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    tok = load_tokenizer(model_dir)
    rows = read_rows(args.data / "test.parquet")[:args.warmup_check]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    contexts = [prompt_ids(r, tok, ToolEnvironment.tool_schemas(TOOLS)) for r in rows]
    final, called, open_ = [""] * len(rows), [False] * len(rows), list(range(len(rows)))
    for turn in range(args.max_turns):
        if not open_:
            break
        x, mask = real_model.left_padded([contexts[i] for i in open_], tok.pad_id, device)
        width = x.shape[1]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                 eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)[:, width:].tolist()
        still = []
        for k, i in enumerate(open_):
            seq = out[k]
            cut = next((j + 1 for j, t in enumerate(seq) if t in tok.stop_ids), None)
            text = final[i] = tok.decode(seq)
            answer = asyncio.run(tool_turn(rows[i], text, TOOLS))
            if turn == 0:
                called[i] = answer.info["tool_calls"] > 0 and answer.info["tool_errors"] == 0
            if not answer.done and turn + 1 < args.max_turns:
                contexts[i] = contexts[i] + (seq[:cut] if cut else seq + tok.stop_ids[:1]) + \
                    tok.encode_followup(answer.observation)
                still.append(i)
        open_ = still
    right = [last_number(final[i], r["reward_model"]["ground_truth"]) for i, r in enumerate(rows)]
    return {"problems": len(rows), "well_formed_call": round(sum(called) / len(rows), 3),
            "accuracy": round(sum(right) / len(rows), 3), "final_answers": final[:3]}


def free_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = real_model.parser(__doc__.split("\n\n")[0], "plain,tools", real_model.ROOT / "bench" / "tools.json",
                           Path("/tmp/hpcrl-bench-tools"))
    ap.add_argument("--max-turns", type=int, default=4, help="environment.max_turns of the tools run")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="environment.max_tokens of the tools run (default: --max-turns × --new-tokens)")
    ap.add_argument("--warmup-steps", type=int, default=60, help="supervised steps before the tools run (0: none)")
    ap.add_argument("--warmup-examples", type=int, default=800, help="training problems made into demonstrations")
    ap.add_argument("--warmup-batch", type=int, default=16)
    ap.add_argument("--warmup-lr", type=float, default=3e-5)
    ap.add_argument("--warmup-check", type=int, default=30, help="held-out problems played before and after it")
    ap.add_argument("--warmup-only", action="store_true", help="the warm-up and its check, no RL run")
    ap.set_defaults(minutes="15")
    args = ap.parse_args()
    environment = {"cls": "hpcrl.environments:ToolEnvironment", "kwargs": {"tools": TOOLS},
                   "max_turns": args.max_turns, "max_tokens": args.max_tokens or args.max_turns * args.new_tokens}
    # the calculator's description, a system message, makes the prompt ~240 tokens (the plain run's 64)
    tools = {**real_model.GRPO, "environment": environment, "max_prompt_length": 320}
    # the same task, calculator and turns as an agent of your own (issue 59): jobs/chain_sum_agent.py,
    # written against the openai package, through the generating role's endpoint
    agent = {**tools, "environment": {"agent": "hpcrl.jobs.chain_sum_agent:solve", "agent_time_limit": 300,
                                      "max_tokens": environment["max_tokens"]}}
    warmup = {}
    if args.warmup_steps > 0 and (args.warmup_only or {"tools", "agent"} & set(args.runs.split(","))):
        args.work.mkdir(parents=True, exist_ok=True)
        warmup["before"] = check(args.model, args) if args.warmup_check else None
        warmup.update(warm_up(args, args.work / "warmup-model"))
        warmup["after"] = check(Path(warmup["model"]), args) if args.warmup_check else None
        print(f"warm-up: {json.dumps(warmup)}", flush=True)
        free_gpu_memory()     # the runs' drivers take the GPU next
        tools["model"] = agent["model"] = warmup["model"]
    if args.warmup_only:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "warmup": warmup},
                                        indent=1))
        return 0
    real_model.learn(args, {"plain": real_model.GRPO, "tools": tools, "agent": agent}, extra={"warmup": warmup})
    return 0


if __name__ == "__main__":
    sys.exit(main())
