"""Rollout with vLLM, behind the same `generate` as `TorchRollout`, with in-place weight updates.

Token ids in, token ids out: the engine starts without a tokenizer (`skip_tokenizer_init`), so
any tokenizer the trainer uses works. New weights go into the running engine through the
worker's own `reload_weights` (the model's HF-name → tensor mapping), then the prefix cache is
reset so no KV entry computed with the old weights is reused. No file is written.

With one process (tensor parallel 1) the engine runs inside the caller's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uniprocess executor): weights are handed over as the
tensors themselves. With tensor parallel > 1 (or `in_process=False`) vLLM runs its own engine and
worker processes; the weights then travel to them as one safetensors buffer through `collective_rpc`.

Seeds: by default every row is its own request with its own seed (`row_seed`), so a row's sample
does not depend on the batch it came in. vLLM 0.20's sampler draws for such requests one by one
in Python; an in-process engine can instead seed the process's generator once per call
(`seed_rows=False`): the same call still samples the same tokens, but a row's draws then depend on
its batch, as the static-cache engine's do. bench/gpu_rollout.py times both.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from hpcrl.algo import truncate_at_eos
from hpcrl.engines.base import SamplingParams
from hpcrl.engines.compile_cache import use_compile_cache


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a generate call seeded `seed`."""
    return seed * 4099 + row


class WeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`): the receiving end of a weight push."""

    def hpcrl_load_weights(self, weights) -> None:
        if isinstance(weights, (bytes, bytearray)):
            from safetensors.torch import load

            weights = load(bytes(weights))
        self.reload_weights(weights_iterator=list(weights.items()), is_checkpoint_format=True)


def vllm_environment(cache_dir: Path) -> None:
    """Before vLLM is imported: no usage reports leave the machine; caches and temp files stay in
    the run's own space (not /tmp/vllm_* or ~/.cache/vllm)."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    cache_dir = Path(cache_dir)
    (cache_dir / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_CACHE_ROOT"] = str(cache_dir)
    use_compile_cache(cache_dir)
    os.environ["TMPDIR"] = str(cache_dir / "tmp")
    tempfile.tempdir = None          # re-read TMPDIR


class VLLMRollout:
    shares_module = False

    def __init__(self, model_dir: str | Path, pad_id: int, eos_ids: list[int], cache_dir: str | Path,
                 tensor_parallel_size: int = 1, dtype: str | None = None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, in_process: bool | None = None,
                 seed_rows: bool = True):
        vllm_environment(Path(cache_dir))
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")    # GiB; vLLM's default takes far more
        self.in_process = tensor_parallel_size == 1 if in_process is None else in_process
        if self.in_process and tensor_parallel_size > 1:
            raise ValueError("in_process needs tensor_parallel_size 1: vLLM runs a process per tensor-parallel rank")
        if not (seed_rows or self.in_process):
            raise ValueError("seed_rows=False needs the engine in this process (its sampler seeded here)")
        self.seed_rows = seed_rows
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        from vllm import LLM

        dtype = dtype or ("bfloat16" if on_gpu else "float32")      # as the static-cache engine samples
        self.pad_id, self.eos_ids, self.dtype = pad_id, list(eos_ids), getattr(torch, dtype)
        self.sleeping, self.can_sleep = False, on_gpu
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                       tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                       enforce_eager=not on_gpu, logprobs_mode="processed_logprobs",
                       worker_extension_cls=f"{__name__}.WeightLoader",
                       **({"distributed_executor_backend": "uni"} if self.in_process else {}),
                       **({"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True} if on_gpu else {}))

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 seed: int) -> dict[str, torch.Tensor]:
        """Same layout as TorchRollout.generate. Row i is its own request, seeded `row_seed(seed, i)`
        (seed_rows) or drawn from this process's generator seeded `seed`. Log-probs are those the
        sampler drew from (after temperature, top-k and top-p)."""
        from vllm import SamplingParams as VSamplingParams

        self.wake_up()
        if not self.seed_rows:
            torch.manual_seed(seed)
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids, prompt_mask)]
        sampling = [VSamplingParams(n=1, temperature=params.temperature, top_p=params.top_p,
                                    top_k=params.top_k or -1, max_tokens=params.max_new_tokens,
                                    stop_token_ids=self.eos_ids, logprobs=0, seed=row_seed(seed, i) if self.seed_rows else None,
                                    detokenize=False)
                    for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        b, width = len(prompts), params.max_new_tokens
        responses = torch.full((b, width), self.pad_id, dtype=torch.long)
        logp = torch.zeros(b, width)
        for i, out in enumerate(outputs):
            seq = out.outputs[0]
            responses[i, :len(seq.token_ids)] = torch.tensor(seq.token_ids, dtype=torch.long)
            logp[i, :len(seq.token_ids)] = torch.tensor([step[t].logprob for t, step in zip(seq.token_ids, seq.logprobs)])
        responses, response_mask, has_eos = truncate_at_eos(responses, self.eos_ids, self.pad_id)
        return {"responses": responses, "response_mask": response_mask, "has_eos": has_eos,
                "rollout_log_probs": logp * response_mask}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the engine's parameters with these (HF names, the trainer's state_dict)."""
        self.wake_up()
        if self.in_process:
            payload = {k: v.detach() for k, v in weights.items()}
        else:
            from safetensors.torch import save

            payload = save({k: v.detach().cpu().contiguous() for k, v in weights.items()})
        self.llm.collective_rpc("hpcrl_load_weights", args=(payload,))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the GPU memory the engine holds (weights to CPU, KV cache dropped) so a colocated
        trainer can use it; a no-op on CPU, where vLLM has no sleep mode."""
        if self.can_sleep and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
