#!/bin/bash
# Wheels for the GPU machine (Python 3.12, torch 2.11 on the image, no internet), into .whl/ (git-ignored
# through .git/info/exclude): ray without its Java jar and source maps (to fit the 64 MiB transfer),
# megatron-core, TRL 1.12 (the last release with PPOTrainer), gguf (SmolLM2's conversion), peft (bench/lora.py), openai
# (the agents of bench/tools.py's agent run) and what they need beyond
# the image.
#   bash bench/gpu_wheels.sh [vllm]
# vllm: also vLLM 0.20.2 (the release built for torch 2.11 and CUDA 13, the image's) into .whl-vllm/, without
# the kernels a dense model on Hopper never loads (FlashAttention 2, MoE, FlashMLA, DeepGEMM: 244 MB → 120 MB),
# and into .whl/ the packages its offline engine imports that the image lacks (flashinfer is left out: vLLM
# then samples with its PyTorch top-k/top-p and attends with FlashAttention 3, which its wheel holds).
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.whl-vllm/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
rm -rf .whl && mkdir -p .whl
pip_get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
# strip_wheel WHEEL PATH...: the wheel rewritten without these paths (files or folders), its RECORD to match
strip_wheel() {
  local wheel=$1 tmp; shift
  tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$wheel" && rm -rf "$@" &&
   python3 -c "import os; r=[d for d in os.listdir('.') if d.endswith('.dist-info')][0]+'/RECORD'; \
open(r+'.new','w').writelines(l for l in open(r) if os.path.exists(l.split(',')[0])); os.replace(r+'.new', r)" &&
   rm "$wheel" && zip -q -r -9 "$wheel" .)
  rm -rf "$tmp"
}
pip_get -d .whl ray==2.60.0 megatron-core==0.19.2 trl==1.12.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
  jsonschema jsonschema-specifications referencing rpds-py submitit pydantic pydantic-core annotated-types typing-inspection \
  gguf==0.19.0 peft==0.21.2 openai==2.8.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
ray=$(ls "$PWD"/.whl/ray-2.60.0-*.whl)
strip_wheel "$ray" $(cd .whl && unzip -Z1 "$ray" | grep -E '\.(jar|map)$')
if [ "${1:-}" = vllm ]; then
  pip_get -d .whl msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.2 \
    openai-harmony==0.0.8 fastapi==0.120.0 starlette==0.48.0 llguidance==1.3.0 xgrammar==0.2.9 \
    apache-tvm-ffi==0.1.15.post2 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 depyf==0.20.0 astor==0.8.1 \
    setproctitle==1.3.8 blake3==1.0.11
  rm -rf .whl-vllm && mkdir -p .whl-vllm
  pip_get -d .whl-vllm vllm==0.20.2
  strip_wheel "$(ls "$PWD"/.whl-vllm/vllm-0.20.2-*.whl)" vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C.abi3.so \
    vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/third_party/deep_gemm
  du -sh .whl-vllm
fi
du -sh .whl
