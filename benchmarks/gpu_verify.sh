#!/usr/bin/env bash
# One device call for what this tree has not yet run on a GPU (docs/benchmarks.md, eleventh session,
# "Next device session"): the GPU tests of the new kernels and paths, side by side in processes of
# their own, then the prefill ops and the model's prefill beside mlx-lm, each stage under its own
# time limit so that a slow one leaves the others' results. Every stage's whole output goes to
# $OUT/<stage>.log; $OUT/stages.txt lists the exit codes; the PTX cache is packed for the next call.
# Usage (repository root, MLX bundle carried in .gpu/): bash benchmarks/gpu_verify.sh  (about 8 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/stages.txt"
  tail -n 20 "$OUT/$name.log"
}

TESTS="tests/gpu/test_f16_gemm_gpu.py tests/gpu/test_exl3_rows_gpu.py tests/gpu/test_model_gpu.py"
TESTS="$TESTS tests/gpu/test_compiled_step_gpu.py"
# the EXL3 cases whose paths the many-row kernels changed, beside the files above
EXL3_CASES="linear_dispatch or many_token or grouped_linear or experts_vs_float64"
stage exl3_prefill_tests 140 python3 -m pytest -q tests/gpu/test_exl3_kernels.py -k "$EXL3_CASES" &
stage tests 140 env GPU_JOBS=4 GPU_FILE_TIMEOUT=130 bash benchmarks/gpu_run.sh tests-parallel "$TESTS"
wait
stage prefill_ops 50 python3 benchmarks/bench_prefill_ops.py --rows 2048 --repeats 3 --out "$OUT"
stage prefill 190 python3 benchmarks/bench_model.py --quick --prefill 2048 --out "$OUT"
mv "$OUT/bench_model_prefill.md" "$OUT/bench_model_prefill_2k.md" 2>/dev/null
stage prefill_8k 90 python3 benchmarks/bench_model.py --quick --skip-mlx-lm --prefill 8192 --out "$OUT"
bash benchmarks/gpu_save_ptx.sh > /dev/null 2>&1 || true
