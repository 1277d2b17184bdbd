#!/usr/bin/env bash
# One device call for what this tree has not yet run on a GPU (docs/benchmarks.md, eleventh session,
# "Next device session"): the GPU tests of the new kernels and paths, side by side in processes of
# their own, then the attention kernels and the model's prefill beside mlx-lm and with the rows
# attention kernel, each stage under its own
# time limit so that a slow one leaves the others' results. Every stage's whole output goes to
# $OUT/<stage>.log; $OUT/stages.txt lists the exit codes; the PTX cache is packed for the next call.
# Usage (repository root, MLX bundle carried in .gpu/): bash benchmarks/gpu_verify.sh  (about 10 minutes)
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

TESTS="tests/gpu/test_sparse_attention_rows_gpu.py tests/gpu/test_exl3_rows_gpu.py tests/gpu/test_model_gpu.py"
TESTS="$TESTS tests/gpu/test_f16_gemm_gpu.py"
# beside them: the model's equalities (decode == prefill, chunked == one, batched == solo) with the
# rows attention kernel
stage model_rows 180 env MLX_DSV41_ATTENTION=rows python3 -m pytest -q tests/gpu/test_model_gpu.py &
stage tests 180 env GPU_JOBS=4 GPU_FILE_TIMEOUT=170 bash benchmarks/gpu_run.sh tests-parallel "$TESTS"
wait
stage attention 60 python3 benchmarks/bench_sparse_attention.py --quick --out "$OUT"
stage prefill_rows 190 env MLX_DSV41_ATTENTION=rows python3 benchmarks/bench_model.py --quick --prefill 2048 --out "$OUT"
mv "$OUT/bench_model_prefill.md" "$OUT/bench_model_prefill_2k.md" 2>/dev/null
stage prefill_8k 150 env MLX_DSV41_ATTENTION=rows python3 benchmarks/bench_model.py --quick --skip-mlx-lm \
  --prefill 8192 --out "$OUT"
bash benchmarks/gpu_save_ptx.sh > /dev/null 2>&1 || true
