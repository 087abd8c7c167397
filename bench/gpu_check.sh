#!/usr/bin/env bash
# One-call GPU check for a lent accelerator (e.g. one H200): CUDA tests, then both benchmarks at both
# sizes, every figure into one file. Meant to finish well under 10 minutes.
#   bash bench/gpu_check.sh [OUT_DIR]      (OUT_DIR defaults to $OUT, else ./gpu_out)
# Uses the machine's python3 (torch with CUDA, transformers, hypothesis); no Ray, no network there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export RLFLOW_DEVICE=cuda
LOG="$OUT_DIR/gpu_check.log"
FIG="$OUT_DIR/gpu_figures.jsonl"
: > "$FIG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG"

run() {  # run NAME TIMEOUT CMD...: log everything, keep the JSON last line as a figure
  local name=$1 t=$2; shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$t" "$@" > "$OUT_DIR/$name.out" 2>&1
  local rc=$?
  tail -n 30 "$OUT_DIR/$name.out" >> "$LOG"
  echo "=== $name rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
  local last
  last=$(tail -n 1 "$OUT_DIR/$name.out")
  if [[ $last == \{* ]]; then echo "{\"name\": \"$name\", \"rc\": $rc, \"result\": $last}" >> "$FIG"; fi
}

# timeouts add up to under 10 minutes (one device call); each run is far shorter on an H200
if $PY -c "import pytest" 2>/dev/null; then
  run cuda_tests 110 $PY -m pytest -q -m "cuda or not slow" -p no:cacheprovider tests/test_plan_cuda.py tests/test_rollout.py tests/test_hf_parity.py
else
  echo "=== cuda_tests: skipped, pytest is not installed" | tee -a "$LOG"
fi
run rollout_tiny 60 $PY bench/rollout_vs_hf.py --device cuda --batch 256 --new-tokens 128
run rollout_tiny_compiled 100 $PY bench/rollout_vs_hf.py --device cuda --batch 256 --new-tokens 128 --compile
run rollout_0p5b 100 $PY bench/rollout_vs_hf.py --device cuda --dtype bfloat16 --preset qwen3-moe-0.5b --batch 256 --new-tokens 128 --repeats 2
if $PY -c "import trl" 2>/dev/null; then  # the lent machine's python may lack TRL (no network to install it)
  run e2e_tiny 60 $PY bench/e2e_vs_trl.py --device cuda
  run e2e_0p5b 120 $PY bench/e2e_vs_trl.py --device cuda --dtype bfloat16 --preset qwen3-moe-0.5b --max-new-tokens 256 --warmup 1 --steps 3
else
  echo "=== e2e_tiny, e2e_0p5b: skipped, TRL is not installed" | tee -a "$LOG"
fi
# vLLM as the rollout engine (rlflow/engines/vllm.py): where the lent machine's python has vllm
if $PY -c "import vllm" 2>/dev/null; then
  run vllm_tests 120 $PY -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py -m "not slow"
  run rollout_vllm_0p5b 120 $PY bench/rollout_vs_vllm.py --device cuda --dtype bfloat16 --preset qwen3-moe-0.5b --batch 256 --new-tokens 128 --repeats 2
else
  echo "=== vllm_tests, rollout_vllm_0p5b: skipped, vllm is not installed" | tee -a "$LOG"
fi
# PPO's critic (values, GAE, its update) on the device, one process: the recipe's own run, 20 steps
run ppo_recipe 40 $PY recipes/grpo_qwen3_moe.py --world 1 --adv-estimator gae --steps 20 --out "$OUT_DIR/ppo" --overwrite
echo "figures: $FIG" | tee -a "$LOG"
