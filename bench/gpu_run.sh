#!/bin/bash
# On the GPU machine, from the repository root with .whl/ carried (bench/gpu_wheels.sh makes it):
#   bash bench/gpu_run.sh tests bench split
# tests: tests/gpu; bench: bench/gpu_ppo.py on one GPU; split: the two-GPU layout. Logs and JSON to $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for stage in "$@"; do
  case $stage in
    tests) timeout 300 python3 -m pytest tests/gpu -x -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    bench) timeout 420 python3 bench/gpu_ppo.py --steps "${STEPS:-4}" 2>&1 | tee "$OUT/bench.log" | tail -8
           cp bench/gpu_ppo.json "$OUT/" ;;
    split) timeout 420 python3 bench/gpu_ppo.py --layout two-gpus --steps "${STEPS:-3}" --runs megatron \
             --out bench/gpu_ppo_two_gpus.json 2>&1 | tee "$OUT/split.log" | tail -6
           cp bench/gpu_ppo_two_gpus.json "$OUT/" ;;
  esac
done
