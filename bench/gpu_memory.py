"""Real model sizes on one GPU, through Slurm, beside the memory plan: each config a heterogeneous job
on the GPU machine's local cluster (`slurm/cluster up --packages`; one physical GPU that the `h100`
and `a100` virtual nodes share), submitted with `python -m hpcrl submit` as a user would. Per config:
the step and its phases, each process's measured peak (torch's max_memory_reserved per call, from
logs/<role>/rank0.calls.jsonl, and NVML's count of the process) and the GPU's (nvidia-smi, polled)
beside what `hpcrl plan` predicted for it; generation against the bandwidth bound and the update's
MFU. Then TRL's GRPOTrainer (LoRA) on the 7B shape with the same lengths, in the same call. The
weights are random (a model folder written once per shape, bf16): speed and memory, not learning.
Prints a table and writes the JSON after every config (a config that fails or runs out of memory is
a result).

    python bench/gpu_memory.py --work /tmp/gpu-memory --json /tmp/gpu-memory/gpu_memory.json
    python bench/gpu_memory.py --replan bench/gpu_memory.json     # the plan's predictions again, here, with
                                                                   # today's constants, beside the measured peaks

Calibration first (`calibrate`, in this process): a bare CUDA process's context (NVML less torch's
reserved memory), and one decoder layer of each shape, fp32 weights under bf16 autocast as the
torch engine runs it, eager and compiled: the bytes its forward keeps for the backward, per token
(the slope over two token counts) and fixed (the intercept: the weights' bf16 copies).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GIB = 2**30
PROMPT, RESPONSE = 256, 256
PEAK = {"H100": 989e12, "H200": 989e12}        # dense bf16 FLOP/s (datasheet, SXM)
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s (datasheet)

# name -> (shape, train settings, the other GPU roles: in actor_rollout's component, `rollout` in one of its own on
# the a100 partition, whose virtual node has the same GPU)
CONFIGS = {
    "0.5b-ppo": ("qwen2.5-0.5b", {"algorithm": {"advantage": "gae", "kl_coef": 0.001},
                                  "data": {"batch_size": 64}, "optim": {"micro_batch_size": 16}}, ["critic", "ref"]),
    "1.5b-ppo": ("qwen2.5-1.5b", {"algorithm": {"advantage": "gae", "kl_coef": 0.001},
                                  "data": {"batch_size": 64}, "optim": {"micro_batch_size": 2}}, ["critic", "ref"]),
    "1.5b-ppo-ckpt": ("qwen2.5-1.5b", {"algorithm": {"advantage": "gae", "kl_coef": 0.001},
                                       "data": {"batch_size": 64}, "optim": {"micro_batch_size": 16},
                                       "engine": {"activation_checkpointing": True}}, ["critic", "ref"]),
    "smollm2-grpo-apart": ("smollm2-135m", {"algorithm": {"advantage": "grpo", "kl_coef": 0.0},
                                            "data": {"batch_size": 16}, "rollout": {"n_samples": 8, "own_role": True},
                                            "optim": {"micro_batch_size": 32}}, ["rollout"]),
    "7b-grpo-lora": ("qwen2.5-7b", {"algorithm": {"advantage": "grpo", "kl_coef": 0.0},
                                    "data": {"batch_size": 16}, "rollout": {"n_samples": 4},
                                    "optim": {"micro_batch_size": 4}, "lora": {"rank": 16, "alpha": 32.0}}, []),
    "7b-grpo-lora-kl-ckpt": ("qwen2.5-7b", {"algorithm": {"advantage": "grpo", "kl_coef": 0.001},
                                            "data": {"batch_size": 16}, "rollout": {"n_samples": 4},
                                            "optim": {"micro_batch_size": 16}, "lora": {"rank": 16, "alpha": 32.0},
                                            "engine": {"activation_checkpointing": True}}, []),
    "7b-grpo-full": ("qwen2.5-7b", {"algorithm": {"advantage": "grpo", "kl_coef": 0.0},
                                    "data": {"batch_size": 16}, "rollout": {"n_samples": 4},
                                    "optim": {"micro_batch_size": 4}}, []),
    "7b-grpo-full-offload": ("qwen2.5-7b", {"algorithm": {"advantage": "grpo", "kl_coef": 0.0},
                                            "data": {"batch_size": 16}, "rollout": {"n_samples": 4, "release_memory": True},
                                            "optim": {"micro_batch_size": 8},
                                            "engine": {"activation_checkpointing": True, "offload": "optimizer"}}, []),
}


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def hpcrl(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """The command line as a user runs it (`python -m hpcrl`: the GPU image installs no scripts)."""
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


# ---------------------------------------------------------------- inputs
def model_dir(work: Path, shape: str) -> Path:
    """A random-weight HF folder of the named shape (bf16 safetensors, built on the GPU by a process of
    its own: this one never holds GPU memory) with a tokenizer of one character per id; written once."""
    out = work / "models" / shape
    if not (out / "config.json").exists():
        t = time.time()
        subprocess.run([sys.executable, __file__, "--make-model", shape, "--work", str(work)], check=True)
        say(f"model {shape}: written in {time.time() - t:.0f} s")
    return out


def make_model(work: Path, shape: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.models import CharTokenizer
    from hpcrl.models.size import NAMED_SHAPES

    out = work / "models" / shape
    fields = dict(NAMED_SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                                 dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    CharTokenizer("".join(chr(0x10000 + i) for i in range(NAMED_SHAPES[shape]["vocab_size"] - 3))).save(tmp)
    os.replace(tmp, out)


def prompts_file(work: Path, shape: str) -> Path:
    """256 prompts of PROMPT random ids of the shape's vocabulary."""
    import torch

    from hpcrl.models.size import NAMED_SHAPES

    out = work / f"prompts-{shape}.jsonl"
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(3, NAMED_SHAPES[shape]["vocab_size"], (256, PROMPT), generator=g)
    out.write_text("".join(json.dumps({"prompt_ids": r.tolist()}) + "\n" for r in rows))
    return out


def spec_of(name: str, work: Path, gpu_type: str, steps: int) -> tuple[dict, str]:
    shape, train, beside = CONFIGS[name]
    settings = {"total_steps": steps, "progress": True,
                "model": {"path": str(model_dir(work, shape))},
                "data": {"dataset": str(prompts_file(work, shape)), "max_prompt_length": PROMPT, **train.get("data", {})},
                "reward": {"fn": "hpcrl.ppo.tasks.copy_digits:score"},
                "rollout": {"max_new_tokens": RESPONSE, **train.get("rollout", {})},
                "optim": {"ppo_epochs": 1, "warmup_steps": 0, "actor_lr": 1e-6, "critic_lr": 1e-6,
                          "mini_batch_size": train["data"]["batch_size"] * train.get("rollout", {}).get("n_samples", 1),
                          **train.get("optim", {})},
                "checkpoint": {"save_last": False, "snapshot_every": 0},
                **{k: v for k, v in train.items() if k not in ("data", "rollout", "optim")}}
    gpu = {"partition": "h100", "gpus_per_node": 1, "gpu_type": gpu_type, "cpus_per_task": 4, "mem": "8G",
           "time": "00:30:00"}
    roles = {"actor_rollout": gpu, **{r: {"same_nodes_as": "actor_rollout"} for r in beside if r != "rollout"},
             **({"rollout": {**gpu, "partition": "a100", "gpu_type": "a100", "gpu_mem": "80G"}} if "rollout" in beside else {}),
             "reward": {"partition": "cpu", "cpus_per_task": 2, "mem": "2G", "time": "00:30:00"}}
    together = ["actor_rollout", *(r for r in beside if r != "rollout")]
    if len(together) > 1:       # one GPU: its roles in one process (each process holds a GPU of its own)
        settings["layout"] = {"colocate": [together]}
    return {"name": f"mem-{name}", "run_dir": str(work / name), "requeue": False, "roles": roles, "train": settings}, shape


# ---------------------------------------------------------------- measuring
class GpuPoll:
    """nvidia-smi's memory.used of GPU 0 every 0.5 s, in a thread: the GPU's peak over a job."""

    def __init__(self):
        self.peak_mib, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True)
            except OSError:      # no nvidia-smi: no GPU figure
                return
            if out.returncode == 0 and out.stdout.strip():
                self.peak_mib = max(self.peak_mib, int(out.stdout.split()[0]))
            self.stop.wait(0.5)

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return round(self.peak_mib / 1024, 3)


def process_peaks(run: Path) -> dict:
    """Each role's process: the largest per-call peaks of rank 0 (GiB), overall and by method."""
    from hpcrl.observe.logs import read_calls

    out = {}
    for role, calls in read_calls(run).items():
        calls = [c for c in calls if "gpu_reserved_gib" in c]
        if not calls:
            continue
        by_method: dict = {}
        for c in calls:
            m = by_method.setdefault(c["method"], {"reserved": 0.0, "allocated": 0.0})
            m["reserved"] = max(m["reserved"], c["gpu_reserved_gib"])
            m["allocated"] = max(m["allocated"], c["gpu_allocated_gib"])
        nvml = [c["gpu_process_gib"] for c in calls if c.get("gpu_process_gib") is not None]
        out[role] = {"reserved": max(c["gpu_reserved_gib"] for c in calls),
                     "allocated": max(c["gpu_allocated_gib"] for c in calls),
                     "nvml": max(nvml) if nvml else None, "by_method": by_method}
    return out


def run_config(name: str, args, device: str) -> dict:
    """One config through Slurm; with the plan's prediction, measured peaks, step phases."""
    import yaml

    spec, shape = spec_of(name, args.work, args.gpu_type, args.steps)
    run = Path(spec["run_dir"])
    subprocess.run(["rm", "-rf", str(run)], check=True)
    path = args.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    plan = hpcrl("plan", str(path), "--json")
    row = {"config": name, "shape": shape, "spec": spec, "plan": json.loads(plan.stdout) if plan.stdout.strip() else None,
           "plan_exit": plan.returncode}
    if plan.returncode != 0:      # the plan refuses it: the exact reason is the result
        row["refused"] = hpcrl("validate", str(path), "--offline").stderr.strip()
        say(f"{name}: refused by the plan before submission")
        return row
    poll, t = GpuPoll(), time.time()
    try:
        done = hpcrl("submit", str(path), "--wait", timeout=args.timeout)
        row.update(exit=done.returncode, output=(done.stdout + done.stderr)[-4000:])
    except subprocess.TimeoutExpired:
        row.update(exit=None, output=f"timed out after {args.timeout} s")
        subprocess.run(["scancel", "--name", spec["name"]])
    row["gpu_peak_nvidia_smi_gib"] = poll.done()
    row["wall_s"] = round(time.time() - t, 1)
    row["processes"] = process_peaks(run)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    row["records"] = [{k: v for k, v in r.items() if k.startswith("timing/") or k in ("step", "reward/mean",
                                                                                       "response_length/mean",
                                                                                       "throughput/tokens_per_s")}
                      for r in recs]
    row["fail"] = next((json.loads(x).get("error") for x in (run / "events.jsonl").read_text().splitlines()
                        if '"fail"' in x), None) if (run / "events.jsonl").exists() else None
    row.update(summarise(recs, spec, shape, device))
    row["errors"] = process_errors(row)
    return row


def summarise(recs: list[dict], spec: dict, shape: str, device: str) -> dict:
    """Median phases over the steps after the first (it compiles); generation against the bandwidth
    bound; the updates' MFU."""
    from gpu_ppo import decode_bytes, model_flops
    from hpcrl.models.size import NAMED_SHAPES

    timed = [r for r in recs if "reward/mean" in r][1:]
    if not timed:
        return {}
    med = lambda k: statistics.median(r[k] for r in timed) if all(r.get(k) is not None for r in timed) else None  # noqa: E731
    out = {f"{k.removeprefix('timing/')}_s": med(k) for k in ("timing/step", "timing/generate", "timing/score",
                                                              "timing/update_critic", "timing/update_actor",
                                                              "timing/sync_weights")}
    fields = {k: NAMED_SHAPES[shape][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "intermediate_size", "vocab_size")}
    train = spec["train"]
    rows = train["data"]["batch_size"] * train["rollout"].get("n_samples", 1)
    card = next((k for k in PEAK if k in device), "H100")
    if out["generate_s"]:
        out["generate_of_bound"] = decode_bytes(fields, RESPONSE, rows, PROMPT) / BANDWIDTH[card] / out["generate_s"]
    if out["update_actor_s"]:      # model FLOPs (gpu_ppo.model_flops: 64 rows of PROMPT + RESPONSE), no recompute counted
        # LoRA: the frozen weights get no gradient, so a backward is one forward's FLOPs, not two
        actor = model_flops(False, True, fields, RESPONSE) * (2 / 3 if train.get("lora", {}).get("rank") else 1)
        critic = model_flops(False, False, fields, RESPONSE) if "critic" in spec["roles"] else 0.0
        out["update_mfu"] = actor / out["update_actor_s"] / PEAK[card]
        out["update_mfu_with_critic"] = (actor + critic) / (out["update_actor_s"] + (out["update_critic_s"] or 0)) / PEAK[card]
    return out


# ---------------------------------------------------------------- calibration
CONTEXT = """
import json, torch, pynvml, os
torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")
torch.cuda.synchronize()
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
print(json.dumps({"nvml": used[0] if used else None, "reserved": torch.cuda.memory_reserved()}))
"""


def calibrate(shapes: list[str]) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.models.size import NAMED_SHAPES

    out: dict = {}
    got = subprocess.run([sys.executable, "-c", CONTEXT], capture_output=True, text=True)
    try:
        c = json.loads(got.stdout.strip().splitlines()[-1])
        out["context_gib"] = round((c["nvml"] - c["reserved"]) / GIB, 3) if c["nvml"] else None
    except (IndexError, ValueError):
        out["context_error"] = (got.stderr or got.stdout)[-500:]
    for shape in shapes:
        fields = dict(NAMED_SHAPES[shape], num_hidden_layers=1, vocab_size=1024)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device("cuda"):
            layer = AutoModelForCausalLM.from_config(config).model.layers[0].float()
            rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
        row = {}
        for kind in ("eager", "compiled"):
            run = torch.compile(layer) if kind == "compiled" else layer
            kept = []
            for tokens in (2048, 4096):
                x = torch.randn(tokens // 512, 512, config.hidden_size, device="cuda", requires_grad=True)
                pos = torch.arange(512, device="cuda")[None].expand(tokens // 512, -1)
                pe = rotary(x, pos)
                for _ in range(2):       # the first compiles
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = run(x, attention_mask=None, position_embeddings=pe, position_ids=pos)
                    y = y[0] if isinstance(y, tuple) else y
                    torch.cuda.synchronize()
                    after = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
                    y.float().sum().backward()
                    del y
                kept.append(after)
            per_token = (kept[1] - kept[0]) / 2048
            row[kind] = {"per_token_bytes": round(per_token), "fixed_bytes": round(kept[0] - 2048 * per_token),
                         "per_token_per_hidden": round(per_token / config.hidden_size, 2),
                         "weights_bf16_bytes": 2 * sum(p.numel() for p in layer.parameters())}
        out[shape] = row
        del layer
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- replanning here
def replan(path: Path) -> None:
    """The plan's predictions of the configs in a bench JSON made again here, with the plan as it is now
    (`plan_now`, beside `plan`: what it predicted when the bench ran), each process's error against
    its measured peak, and the phases recomputed from the records."""
    import yaml

    data = json.loads(path.read_text())
    for row in data["rows"]:
        if "spec" not in row:
            continue
        tmp = Path(f"/tmp/replan-{row['config']}.yaml")
        spec = dict(row["spec"])
        spec["train"] = {**spec["train"], "model": {"path": ""}}
        tmp.write_text(yaml.safe_dump(spec, sort_keys=False))
        got = hpcrl("plan", str(tmp), "--json", "--shape", row["shape"])
        row["plan_now"] = json.loads(got.stdout) if got.stdout.strip() else None
        row["errors"] = process_errors(row)
        if row.get("records"):
            row.update(summarise(row["records"], row["spec"], row["shape"], data.get("device", "")))
    path.write_text(json.dumps(data, indent=1))
    table(data)


def process_errors(row: dict) -> dict:
    """Each process of a config: its measured peak, and the error of the plan when the bench ran
    (before) and of the plan as it is now (now, after a --replan)."""
    plan = row.get("plan_now") or row.get("plan") or {}
    return {"+".join(p["roles"]): {"measured_nvml_gib": measured_process(row, p["roles"]).get("nvml"),
                                   "before": planned_error(row.get("plan"), p["roles"], row),
                                   "now": planned_error(row.get("plan_now"), p["roles"], row)}
            for g in plan.get("gpus", []) for p in g["processes"]}


def planned_error(plan: dict | None, roles: list[str], row: dict) -> float | None:
    """(planned − measured) / measured of a process, measured by NVML (torch's reserved and the plan's
    context where NVML did not see it)."""
    from hpcrl.jobspec.memory import CONSTANTS

    planned = next((p["peak"] for g in (plan or {}).get("gpus", []) for p in g["processes"] if p["roles"] == roles), None)
    got = measured_process(row, roles)
    measured = got.get("nvml") or (got["reserved"] + CONSTANTS.context / 2**30 if got else None)
    return None if planned is None or not measured else round((planned - measured) / measured, 4)


def table(data: dict) -> None:
    print(f"\n{data.get('device')}: planned against measured, GiB per process (NVML; torch's reserved beside it); "
          "the error of the plan as it ran (before) and with the constants measured here (now)")
    print(f"{'config':24} {'process':24} {'planned':>8} {'now':>6} {'reserved':>9} {'nvml':>6} {'before':>7} {'now':>7}"
          f"   {'step s':>7} {'gen %bd':>7} {'upd MFU':>7}")
    for row in data["rows"]:
        if row.get("refused"):
            print(f"{row['config']:24} refused: {row['refused'].splitlines()[-1][:150]}")
            continue
        if "trl" in row:
            print(f"{row['config']:24} {'TRL GRPOTrainer':24} {'':>8} {'':>6} {fmt(row.get('reserved'), '9.1f')} "
                  f"{fmt(row.get('nvml'), '6.1f')} {'':>7} {'':>7}   {fmt(row.get('step_s'), '7.2f')}  {row.get('error') or ''}")
            continue
        planned = {"+".join(p["roles"]): p["peak"] for g in (row.get("plan") or {}).get("gpus", []) for p in g["processes"]}
        now = {"+".join(p["roles"]): p["peak"] for g in (row.get("plan_now") or {}).get("gpus", []) for p in g["processes"]}
        for i, roles in enumerate(planned):
            got = measured_process(row, roles.split("+"))
            errors = row.get("errors", {}).get(roles, {})
            tail = (f"   {fmt(row.get('step_s'), '7.2f')} {fmt(row.get('generate_of_bound'), '7.1%')} "
                    f"{fmt(row.get('update_mfu'), '7.1%')}") if i == 0 else ""
            print(f"{row['config'] if i == 0 else '':24} {roles:24} {planned[roles]:8.1f} {fmt(now.get(roles), '6.1f')} "
                  f"{fmt(got.get('reserved'), '9.1f')} {fmt(got.get('nvml'), '6.1f')} {fmt(errors.get('before'), '+7.1%')} "
                  f"{fmt(errors.get('now'), '+7.1%')}{tail}")


def measured_process(row: dict, roles: list[str]) -> dict:
    """The largest peaks of the calls of a process's roles (colocated roles: one process, a calls file each)."""
    got = [row.get("processes", {})[r] for r in roles if r in row.get("processes", {})]
    if not got:
        return {}
    nvml = [g["nvml"] for g in got if g.get("nvml") is not None]
    return {"reserved": max(g["reserved"] for g in got), "allocated": max(g["allocated"] for g in got),
            "nvml": max(nvml) if nvml else None}


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


ORDER = "7b-grpo-lora,trl,7b-grpo-full-offload,7b-grpo-full,1.5b-ppo-ckpt,0.5b-ppo,smollm2-grpo-apart,calibrate,1.5b-ppo"


def run_trl(args) -> dict:
    """TRL's GRPOTrainer with LoRA on the 7B LoRA config's shape, batch and lengths, in a process of its own."""
    shape, train, _ = CONFIGS["7b-grpo-lora"]
    out = args.work / "trl.json"
    cmd = [sys.executable, str(ROOT / "bench" / "trl_grpo.py"), "--shape", shape, "--prompts", str(train["data"]["batch_size"]),
           "--n", str(train["rollout"]["n_samples"]), "--prompt-len", str(PROMPT), "--response-len", str(RESPONSE),
           "--steps", str(args.steps), "--lora-rank", str(train["lora"]["rank"]),
           "--micro-batch", str(train["optim"]["micro_batch_size"]), "--work", str(args.work / "trl"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    got = json.loads(out.read_text()) if out.exists() else {"rows": [], "error": (done.stderr or done.stdout)[-2000:]}
    timed = got["rows"][1:] or got["rows"]
    med = lambda k: statistics.median(r[k] for r in timed) if timed and all(r.get(k) is not None for r in timed) else None  # noqa: E731
    return {"config": f"trl-{shape}-grpo-lora", "trl": got, "step_s": med("step_s"), "generate_s": med("generate_s"),
            "reserved": max((r["reserved_gib"] for r in got["rows"] if r.get("reserved_gib")), default=None),
            "nvml": max((r["nvml_gib"] for r in got["rows"] if r.get("nvml_gib")), default=None), "error": got.get("error")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-memory"))
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "gpu_memory.json")
    ap.add_argument("--order", default=ORDER, help="configs (CONFIGS), `trl` and `calibrate`, in the order run")
    ap.add_argument("--steps", type=int, default=3, help="steps of each config (the first is left out of the times)")
    ap.add_argument("--gpu-type", default="h100", help="the GRES type of the local cluster's GPU nodes")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a config's job may take")
    ap.add_argument("--calibrate", default="qwen2.5-1.5b,qwen2.5-7b", help="the shapes of the one-layer calibration")
    ap.add_argument("--replan", type=Path, help="a bench JSON: plan its configs again here and print the table")
    ap.add_argument("--make-model", help=argparse.SUPPRESS)
    ap.add_argument("--calibrate-only", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replan:
        replan(args.replan)
        return 0
    if args.make_model:
        make_model(args.work, args.make_model)
        return 0
    if args.calibrate_only:
        args.calibrate_only.write_text(json.dumps(calibrate(args.calibrate.split(","))))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True,
                            text=True).stdout.strip()
    data: dict = {"device": device, "date": time.strftime("%Y-%m-%d"), "prompt": PROMPT, "response": RESPONSE,
                  "steps": args.steps, "rows": []}
    for name in args.order.split(","):
        say(f"== {name}")
        t = time.time()
        try:
            if name == "calibrate":
                out = args.work / "calibration.json"
                subprocess.run([sys.executable, __file__, "--calibrate-only", str(out), "--calibrate", args.calibrate],
                               check=True, timeout=args.timeout)
                data["calibration"] = json.loads(out.read_text())
                say(f"calibration: {json.dumps(data['calibration'])}")
            elif name == "trl":
                data["rows"].append(run_trl(args))
            else:
                data["rows"].append(run_config(name, args, device))
        except Exception as e:        # the next ones still count
            data["rows"].append({"config": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        say(f"{name}: {time.time() - t:.0f} s")
        args.json.write_text(json.dumps(data, indent=1))
    table(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
