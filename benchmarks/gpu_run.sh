#!/usr/bin/env bash
# One command on the GPU machine (MLX CUDA backend): unpack the MLX bundle carried in .gpu/, run
# the GPU tests, then the GPU benchmarks. Logs and JSON results go to $OUT (or ./gpu_out).
# Usage: bash benchmarks/gpu_run.sh [tests|tests-parallel|bench|all] [pytest -k expression | files]
# tests-parallel runs one pytest process per test file, GPU_JOBS (4) at a time, each under
# GPU_FILE_TIMEOUT (520 s): a cold CUDA JIT is CPU-bound, so the files compile side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
kexpr=${2:-}
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available())'
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu ${kexpr:+-k "$kexpr"} 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = tests-parallel ]; then
  files=${kexpr:-$(ls tests/gpu/test_*.py)}
  : > "$OUT/gpu_tests_parallel.txt"
  # shellcheck disable=SC2086
  printf '%s\n' $files | xargs -P "${GPU_JOBS:-4}" -I{} sh -c \
    'f={}; n=$(basename "$f" .py); timeout "${GPU_FILE_TIMEOUT:-520}" python3 -m pytest -q -p no:cacheprovider "$f" > "$OUT/$n.log" 2>&1; echo "$n rc=$?" | tee -a "$OUT/gpu_tests_parallel.txt"; tail -n 3 "$OUT/$n.log"'
  if grep -q 'rc=[^0]' "$OUT/gpu_tests_parallel.txt" || [ ! -s "$OUT/gpu_tests_parallel.txt" ]; then rc=1; fi
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in benchmarks/bench_*.py; do
    [ -e "$b" ] || continue
    echo "== $b"
    python3 "$b" --out "$OUT" 2>&1 | tee -a "$OUT/bench.log"
  done
fi
exit "$rc"
