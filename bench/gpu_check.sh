#!/usr/bin/env bash
# One-call GPU check for a lent accelerator (e.g. one H200): CUDA tests, then both benchmarks at both
# sizes and a short PPO recipe run, every figure into one file.
#   bash bench/gpu_check.sh [OUT_DIR]      (OUT_DIR defaults to $OUT, else ./gpu_out)
# Uses the machine's python3 (torch with CUDA, transformers, hypothesis); no Ray, vLLM, matplotlib or TRL
# need be there, and no network.
#   GPU_CHECK_LIMIT_S (default 420): no step starts unless it can end, at its timeout, within this many
#     seconds of the start; the rest of a 600 s device call is for the machine's start-up and the transfers.
#   GPU_CHECK_DRY=1: run the start-up probes, list the steps it would launch (each charged its full timeout
#     against the limit), launch none; tests/test_gpu_check.py runs them from this list on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export RLFLOW_DEVICE=cuda
LIMIT=${GPU_CHECK_LIMIT_S:-420}
DRY=${GPU_CHECK_DRY:-0}
ALLOWANCE_S=30  # start-up below (nvidia-smi, the python probes), before the first step
LOG="$OUT_DIR/gpu_check.log"
FIG="$OUT_DIR/gpu_figures.jsonl"
: > "$LOG"
: > "$FIG"
# the budget is read off the run lines below, so it cannot drift from them
STEPS_S=$(grep -oE '^[[:space:]]*run [a-z0-9_]+ [0-9]+ ' bench/gpu_check.sh | awk '{s += $3} END {print s + 0}')
echo "budget: steps' timeouts ${STEPS_S}s + start-up ${ALLOWANCE_S}s = $((STEPS_S + ALLOWANCE_S))s;" \
     "no step starts past GPU_CHECK_LIMIT_S=${LIMIT}s" | tee -a "$LOG"

if [[ $DRY == 1 ]]; then
  echo "dry run: no steps launched" | tee -a "$LOG"
else
  timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
fi
timeout 60 $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$LOG"
has() { timeout 60 $PY -c "import $1" 2>/dev/null; }  # probes run here, inside the start-up allowance
HAS_PYTEST=0; has pytest && HAS_PYTEST=1
HAS_TRL=0; has trl && HAS_TRL=1  # the lent machine's python may lack TRL (no network to install it)

CHARGED=0  # dry run: the seconds the listed steps would take at their timeouts
run() {  # run NAME TIMEOUT CMD...: log everything, keep the JSON last line as a figure
  local name=$1 t=$2; shift 2
  local now=$((SECONDS + CHARGED))
  if (( now + t > LIMIT )); then
    echo "=== $name: skipped, ${now}s elapsed + ${t}s timeout > GPU_CHECK_LIMIT_S=${LIMIT}s" | tee -a "$LOG"
    return
  fi
  local cmd
  cmd=$(printf '%q ' "$@")
  echo "=== $name (timeout ${t}s): ${cmd% }" | tee -a "$LOG"
  if [[ $DRY == 1 ]]; then CHARGED=$((CHARGED + t)); return; fi
  local start=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT_DIR/$name.out" 2>&1
  local rc=$?
  tail -n 30 "$OUT_DIR/$name.out" >> "$LOG"
  echo "=== $name rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
  local last
  last=$(tail -n 1 "$OUT_DIR/$name.out")
  if [[ $last == \{* ]]; then echo "{\"name\": \"$name\", \"rc\": $rc, \"result\": $last}" >> "$FIG"; fi
}

# most valuable first: a step the limit leaves out is one of the last
if (( HAS_PYTEST )); then
  run cuda_tests 90 $PY -m pytest -q -m "cuda or not slow" -p no:cacheprovider tests/test_plan_cuda.py tests/test_ops_cuda.py tests/test_rollout.py tests/test_hf_parity.py
else
  echo "=== cuda_tests: skipped, pytest is not installed" | tee -a "$LOG"
fi
run rollout_tiny 40 $PY bench/rollout_vs_hf.py --device cuda --batch 256 --new-tokens 128
run rollout_0p5b 90 $PY bench/rollout_vs_hf.py --device cuda --dtype bfloat16 --preset qwen3-moe-0.5b --batch 256 --new-tokens 128 --repeats 2
# PPO's critic (values, GAE, its update) on the device, one process: the recipe's own run, 20 steps
run ppo_recipe 40 $PY recipes/grpo_qwen3_moe.py --world 1 --adv-estimator gae --steps 20 --out "$OUT_DIR/ppo" --overwrite
if (( HAS_TRL )); then
  run e2e_tiny 40 $PY bench/e2e_vs_trl.py --device cuda --warmup 1 --steps 4
  run e2e_0p5b 75 $PY bench/e2e_vs_trl.py --device cuda --dtype bfloat16 --preset qwen3-moe-0.5b --max-new-tokens 128 --warmup 1 --steps 2
else
  echo "=== e2e_tiny, e2e_0p5b: skipped, TRL is not installed" | tee -a "$LOG"
fi
echo "figures: $FIG" | tee -a "$LOG"
