"""TRL's GRPOTrainer (TRL 1.12, peft LoRA, its own transformers generate, no vLLM) on a random-weight
model of a given Hugging Face config, on one GPU: per optimizer step its wall time, generation time
and memory, to put beside hpcrl's GRPO run of the same shape.

    python3 bench/trl_grpo.py --shape qwen2.5-7b --prompts 16 --n 4 --prompt-len 256 --response-len 256 \\
        --steps 3 --lora-rank 16 --json /tmp/x.json

Nothing is downloaded: the model is `AutoModelForCausalLM.from_config` (random bf16 weights, built on
the GPU), the tokenizer one word "t<id>" per id (pad t0, eos t2), the prompts `prompt_len` random
ids written as "t5 t17 ..." (they tokenise back to exactly those ids), the reward a rule on the ids.

One optimizer step = `prompts` prompts × `n_samples` samples, each exactly `response_len` new tokens
(`min_new_tokens` = `max_completion_length`: the eos logit is masked until the last token, so no
sample stops early), one pass over them (num_iterations 1) in micro-batches of `micro_batch`
sequences, gradients accumulated, one AdamW step; beta 0 (no reference model).
`--cpu` runs the same plumbing on the CPU (a tiny --config only; memory figures are then None).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hpcrl.models.size import NAMED_SHAPES  # noqa: E402

GIB = 1024 ** 3

# the named shapes (hpcrl.models.size); max_position_embeddings only bounds the rope table
SHAPES = {name: dict(fields, max_position_embeddings=4096) for name, fields in NAMED_SHAPES.items()}

PAD, EOS = 0, 2          # token ids of t0 and t2; prompts draw from ids 3 and up


def _tokenizer(vocab_size: int):
    """One word "t<id>" per id, split on whitespace: "t5 t17" → [5, 17] exactly. The special tokens
    are whole words only (single_word): a plain added "t2" would also match inside "t294"."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word = lambda s: AddedToken(s, single_word=True, special=True)  # noqa: E731
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=word("t0"), eos_token=word("t2"),
                                   unk_token=word("t0"))


def _prompts(tok, vocab_size: int, count: int, prompt_len: int, seed: int = 1) -> list[str]:
    """`count` texts of `prompt_len` random ids each (no pad, bos or eos id among them); checked to
    tokenise back to exactly those ids."""
    rng = random.Random(seed)
    ids = [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(count)]
    texts = [" ".join(f"t{i}" for i in row) for row in ids]
    back = tok(texts, add_special_tokens=False)["input_ids"]
    if back != ids:
        raise RuntimeError("prompt texts do not tokenise back to their ids")
    return texts


class _Nvml:
    """This process's GPU memory as NVML reports it (None where NVML or the process is not seen, e.g.
    a container's own pid namespace), and the device's used memory (all processes)."""

    def __init__(self, device_index: int):
        self.handle = None
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            self.nv = pynvml
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            for h in handles:
                u = pynvml.nvmlDeviceGetUUID(h)
                if (u.decode() if isinstance(u, bytes) else u).endswith(uuid):
                    self.handle = h
            if self.handle is None and len(handles) == 1:
                self.handle = handles[0]
        except Exception as e:         # no NVML here: the memory columns from NVML are None
            print(f"NVML not read: {type(e).__name__}: {e}", file=sys.stderr)

    def process_gib(self) -> float | None:
        if self.handle is None:
            return None
        try:
            for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return p.usedGpuMemory / GIB
        except Exception:
            pass
        return None

    def device_used_gib(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return self.nv.nvmlDeviceGetMemoryInfo(self.handle).used / GIB
        except Exception:
            return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def run_trl_grpo(config: dict, prompts: int, n_samples: int, prompt_len: int, response_len: int, steps: int,
                 lora_rank: int | None, micro_batch: int, work: Path, lr: float = 1e-6,
                 gradient_checkpointing: bool = False, device: str = "cuda") -> dict:
    """TRL GRPOTrainer on a random model of HF `config` (a dict with model_type); one optimizer step per
    batch of `prompts` × `n_samples` sequences of `prompt_len` + `response_len` tokens. Returns
    {"rows": per step, "settings": ..., "error": None or "<ExceptionType>: <first line>"}: an exception
    (out of memory above all) ends the run with the rows it had, it is not raised."""
    import torch

    cuda = device == "cuda"
    batch = prompts * n_samples
    if batch % micro_batch:
        raise ValueError(f"micro_batch {micro_batch} must divide prompts × n_samples = {batch}")
    rows: list[dict] = []
    settings: dict = {}
    result = {"rows": rows, "settings": settings, "error": None}
    generate_s: list[float] = []
    lengths: list[tuple[int, int]] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainer = model = None
    try:
        from datasets import Dataset
        from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
        import transformers
        import trl
        from trl import GRPOConfig, GRPOTrainer

        fields = dict(config)
        cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = PAD, EOS, None
        vocab = cfg.vocab_size
        tok = _tokenizer(vocab)
        data = Dataset.from_dict({"prompt": _prompts(tok, vocab, prompts * steps, prompt_len)})

        torch.manual_seed(1)
        with torch.device(device):      # random init straight on the GPU (an 8B model on the CPU takes minutes)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        nvml = _Nvml(torch.cuda.current_device()) if cuda else None
        peft_config = None
        if lora_rank:
            from peft import LoraConfig

            peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                     target_modules="all-linear", bias="none", task_type="CAUSAL_LM")

        args = GRPOConfig(
            output_dir=str(work / "trl_grpo"),
            # batch sizes count sequences (completions), not prompts. steps_per_generation and
            # generation_batch_size are left unset: TRL then makes steps_per_generation =
            # gradient_accumulation_steps and generation_batch_size = per_device × that = prompts × n,
            # i.e. one generate call for the whole batch, then one optimizer step over it.
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=batch // micro_batch,
            num_generations=n_samples,
            num_iterations=1,
            max_completion_length=response_len,
            generation_kwargs={"min_new_tokens": response_len},   # eos masked: exactly response_len tokens
            temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
            beta=0.0,
            learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_steps=steps,
            bf16=True,
            gradient_checkpointing=gradient_checkpointing,   # GRPOConfig's default is True: always pass it
            use_vllm=False,
            shuffle_dataset=False,
            mask_truncated_completions=False,   # every sample ends without eos: masking them would drop all
            eval_strategy="no", save_strategy="no", report_to=[],
            logging_steps=1, disable_tqdm=True, log_completions=False,
            seed=1, dataloader_num_workers=0,
            use_cpu=not cuda,
        )

        def reward_even_ids(completion_ids, **_):
            """Fraction of even token ids: costs nothing, varies between samples."""
            lengths.append((min(map(len, completion_ids)), max(map(len, completion_ids))))
            return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]

        class Probe(TrainerCallback):
            def on_step_begin(self, *_, **__):
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                self.gens = len(generate_s)
                self.t = time.perf_counter()

            def on_step_end(self, _args, state, *__, **___):
                sync()
                step_s = time.perf_counter() - self.t
                gen = generate_s[self.gens:]
                row = {"step": state.global_step, "step_s": step_s, "generate_s": sum(gen) if gen else None,
                       "generate_calls": len(gen),
                       "reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
                       "allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
                       "nvml_gib": nvml.process_gib() if nvml else None,
                       "nvml_device_used_gib": nvml.device_used_gib() if nvml else None,
                       "response_min": lengths[-1][0] if lengths else None,
                       "response_max": lengths[-1][1] if lengths else None,
                       "tokens_per_s": batch * (prompt_len + response_len) / step_s}
                rows.append(row)
                fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
                print(f"trl grpo step {row['step']}: {step_s:.2f} s, generate {fmt(row['generate_s'], '.2f')} s, "
                      f"reserved {fmt(row['reserved_gib'], '.1f')} GiB, allocated {fmt(row['allocated_gib'], '.1f')} "
                      f"GiB, nvml {fmt(row['nvml_gib'], '.1f')} GiB, response {row['response_min']}.."
                      f"{row['response_max']} tokens", flush=True)

            def on_log(self, _args, _state, _control, logs=None, **__):
                keep = ("loss", "grad_norm", "reward", "completions/mean_length", "step_time")
                if rows and logs and "step_time" in logs:     # TRL's own numbers of the step just ended
                    rows[-1]["trl_log"] = {k: float(logs[k]) for k in keep if k in logs}

        trainer = GRPOTrainer(model=model, reward_funcs=reward_even_ids, args=args, train_dataset=data,
                              processing_class=tok, peft_config=peft_config, callbacks=[Probe()])

        single_turn = trainer._generate_single_turn     # the one transformers generate call per batch

        def timed_single_turn(*a, **k):
            sync()
            t = time.perf_counter()
            out = single_turn(*a, **k)
            sync()
            generate_s.append(time.perf_counter() - t)
            return out
        trainer._generate_single_turn = timed_single_turn

        a = trainer.args
        if (a.generation_batch_size, a.steps_per_generation) != (batch, batch // micro_batch):
            raise RuntimeError(f"TRL batch is not one step of {batch}: generation_batch_size "
                               f"{a.generation_batch_size}, steps_per_generation {a.steps_per_generation}")
        train_model = trainer.model
        settings.update({
            k: getattr(a, k) for k in (
                "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "generation_batch_size", "num_generations", "num_iterations", "max_completion_length",
                "generation_kwargs", "temperature", "top_p", "top_k", "beta", "loss_type", "scale_rewards",
                "epsilon", "importance_sampling_level", "learning_rate", "lr_scheduler_type", "optim",
                "weight_decay", "max_grad_norm", "bf16", "gradient_checkpointing", "use_vllm",
                "mask_truncated_completions", "max_steps")})
        for k in ("optim", "lr_scheduler_type"):
            settings[k] = str(getattr(settings[k], "value", settings[k]))
        settings.update({
            "prompts": prompts, "n_samples": n_samples, "prompt_len": prompt_len, "response_len": response_len,
            "micro_batch": micro_batch, "batch": batch,
            "lora": None if not lora_rank else {"r": lora_rank, "alpha": 2 * lora_rank, "dropout": 0.0,
                                                "target_modules": "all-linear"},
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "parameters": sum(p.numel() for p in train_model.parameters()),
            "trainable_parameters": sum(p.numel() for p in train_model.parameters() if p.requires_grad),
            "trainable_dtype": str(next(p.dtype for p in train_model.parameters() if p.requires_grad)),
            "model_allocated_gib": torch.cuda.memory_allocated() / GIB if cuda else None,
            "nvml_process_seen": bool(nvml and nvml.process_gib() is not None),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
        })
        trainer.train()
    except Exception as e:     # out of memory (or anything else) is a result: the rows so far and why it ended
        result["error"] = _first_line(e)
        if cuda:
            result["peak_at_error"] = {"reserved_gib": torch.cuda.max_memory_reserved() / GIB,
                                       "allocated_gib": torch.cuda.max_memory_allocated() / GIB}
        print(f"trl grpo: {result['error']}", flush=True)
    finally:
        del trainer, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()    # leave the GPU to whatever runs next in this process
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", choices=sorted(SHAPES))
    which.add_argument("--config", type=Path, help="JSON file of HF config fields, model_type among them")
    ap.add_argument("--prompts", type=int, required=True, help="prompts per step")
    ap.add_argument("--n", type=int, required=True, help="samples per prompt (≥ 2)")
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--response-len", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (alpha 2×rank, all linear layers); "
                    "left out or 0: full fine-tuning")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trl-grpo-bench"))
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--cpu", action="store_true", help="smoke check of the plumbing on the CPU (tiny configs)")
    args = ap.parse_args()
    config = SHAPES[args.shape] if args.shape else json.loads(args.config.read_text())
    args.work.mkdir(parents=True, exist_ok=True)
    out = run_trl_grpo(config, args.prompts, args.n, args.prompt_len, args.response_len, args.steps,
                       args.lora_rank or None, args.micro_batch, args.work, lr=args.lr,
                       gradient_checkpointing=args.gradient_checkpointing, device="cpu" if args.cpu else "cuda")
    out = {"shape": args.shape or str(args.config), "config": config, **out}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 1 if out["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
