#!/usr/bin/env bash
# One device call for what this tree has not yet run or measured on a GPU (docs/benchmarks.md,
# twelfth session, "Next device session"): GPU tests and measurements, each stage under its own
# time limit so that a slow one leaves the others' results. Every stage's whole output goes to
# logs/<stage>.log, benchmark results beside it; $OUT keeps three files (the device tool returns
# only a few): stages.txt (exit codes), logs.tar.gz and ptx-cache.tar.xz (for the next call's .gpu/).
# Usage (repository root, MLX bundle carried in .gpu/): bash benchmarks/gpu_verify.sh [STAGE ...]
# Name stages to run only those. Stages share GPU_BUDGET seconds (default 540, under the device
# tool's 600 s per command): each is cut to what is left, so the packing at the end always runs.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
LOGS=$OUT/logs
mkdir -p "$LOGS"
WANTED=" ${*:-graphs demo_ttft agreement linear prefill} "
DEADLINE=$((SECONDS + ${GPU_BUDGET:-540}))

stage() {  # stage NAME SECONDS COMMAND...: runs only if NAME was asked for, within the budget
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
  shift 2
  [[ $WANTED == *" $name "* ]] || return 0
  if ((left < limit)); then limit=$left; fi
  if ((limit < 20)); then echo "$name skipped (budget)" | tee -a "$OUT/stages.txt"; return 0; fi
  echo "== $name"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/stages.txt"
  tail -n 24 "$LOGS/$name.log"
}

# decode against MLX's CUDA graph settings: the step's ~2,000 launches make ~100 graphs of 20 nodes,
# as many as MLX's graph cache holds (MLX_CUDA_GRAPH_CACHE_SIZE, 100): does the host re-instantiate
# them every step? (issue 16; docs/benchmarks.md, twelfth session)
graphs() {
  for ops in 20 200; do
    for cache in 100 1000; do
      echo "MLX_MAX_OPS_PER_BUFFER=$ops MLX_CUDA_GRAPH_CACHE_SIZE=$cache"
      MLX_MAX_OPS_PER_BUFFER=$ops MLX_CUDA_GRAPH_CACHE_SIZE=$cache python3 benchmarks/bench_model.py --quick \
        --skip-mlx-lm --no-dspark --out "$LOGS/graphs_${ops}_$cache" | grep -A2 "^| model"
    done
  done
}
export LOGS
export -f graphs
stage graphs 240 bash -c graphs
TESTS="tests/gpu/test_sparse_attention_rows_gpu.py tests/gpu/test_model_gpu.py tests/gpu/test_mxfp4_gemv_gpu.py"
TESTS="$TESTS tests/gpu/test_fp32_linear_gpu.py tests/gpu/test_compiled_step_gpu.py"
# the GPU tests side by side; beside them, greedy DSpark against plain greedy on the demo (issue 18)
stage tests 140 env OUT="$LOGS" GPU_JOBS=5 GPU_FILE_TIMEOUT=130 bash benchmarks/gpu_run.sh tests-parallel "$TESTS" &
stage agreement 150 python3 benchmarks/dspark_agreement.py --demo --prompts 8 --tokens 48 &
wait
# where auto's rows rule (sparse_attention.ROWS_AUTO_MIN) should start
stage sweep 60 python3 benchmarks/bench_sparse_attention.py --quick --out "$LOGS" \
  --rows-sweep 1 2 4 6 8 12 16 24 32 64 128
# the demo's time to the first token in a warm process: the second pass (issue 17)
stage demo_ttft 200 python3 -m mlx_dsv41.warmup --demo --tokens 40
# where a 2,048-token prefill goes, auto's kernels (issue 17 item 1)
stage prefill_parts 150 python3 benchmarks/bench_model.py --quick --skip-mlx-lm --prefill-parts 2048 --out "$LOGS"
# the fp32-sums costs of the MX linears (issue 15 item 4)
stage linear 120 python3 benchmarks/bench_linear_arithmetic.py --rows 1 5 --repeats 5 --out "$LOGS"
# the DSpark verify and draft costs against a decode step (issue 18 item 6)
stage dspark 170 python3 benchmarks/bench_model.py --quick --dspark-only --verify-k 4 --skip-mlx-lm --out "$LOGS"
# prefill with auto's kernels, three timed passes per size (issue 17 item 2)
stage prefill 150 python3 benchmarks/bench_model.py --skip-mlx-lm --prefill 2048 8192 --repeats 3 --out "$LOGS"
# decode, Flash-shaped, beside mlx-lm, and the DSpark verify and draft costs (issues 16, 18)
stage decode 240 python3 benchmarks/bench_model.py --quick --verify-k 4 --out "$LOGS"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
bash benchmarks/gpu_save_ptx.sh > /dev/null 2>&1 || true
