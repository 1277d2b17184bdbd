#!/usr/bin/env bash
# Pack the CUDA JIT's PTX cache into $OUT/ptx-cache.tar.xz (and the driver's cache into
# cuda-cache.tar.xz) so the next call on a fresh GPU machine can carry them back in .gpu/ (benchmarks/gpu_env.sh unpacks it). Run after the tests or benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
# xz on every core, at level 3: the driver's cache grows with each call's new kernels, and one core took tens of
# seconds of the call's time limit (the twenty-second session's first call ran past it after its last stage)
export XZ_OPT=${XZ_OPT:--T0 -3}
tar -cJf "$OUT/ptx-cache.tar.xz" -C "$MLX_PTX_CACHE_DIR" .
if [ -d "$CUDA_CACHE_PATH" ]; then tar -cJf "$OUT/cuda-cache.tar.xz" -C "$CUDA_CACHE_PATH" .; fi
ls -l "$OUT"/*-cache.tar.xz
