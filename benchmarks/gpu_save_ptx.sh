#!/usr/bin/env bash
# Pack the CUDA JIT's PTX cache into $OUT/ptx-cache.tar.xz so the next call on a fresh GPU machine
# can carry it back in .gpu/ (benchmarks/gpu_env.sh unpacks it). Run after the tests or benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
tar -cJf "$OUT/ptx-cache.tar.xz" -C "$MLX_PTX_CACHE_DIR" .
ls -l "$OUT/ptx-cache.tar.xz"
