# Sourced by gpu_run.sh and gpu_run_x2.sh (from the repository root): MLX with its CUDA backend
# (unpacked from the bundle carried in .gpu/ when the machine has no MLX installed), the PTX
# cache, this checkout on the path, and $OUT for logs and results.
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if ! python3 -c 'import mlx.core' 2>/dev/null; then
  SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  tar -xJf .gpu/mlx-cuda13-sm90.tar.xz -C "$SP" || exit 1
fi
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}
# A PTX cache saved by an earlier call (benchmarks/gpu_save_ptx.sh) skips the CUDA JIT's first-run
# compiles, which cost minutes for the compiled decode step.
if [ -f .gpu/ptx-cache.tar.xz ] && [ ! -d "$MLX_PTX_CACHE_DIR" ]; then
  mkdir -p "$MLX_PTX_CACHE_DIR" && tar -xJf .gpu/ptx-cache.tar.xz -C "$MLX_PTX_CACHE_DIR"
fi
# The driver's own JIT cache (PTX -> SASS, per process otherwise): a fresh machine's first run of a
# cached PTX module still pays the driver's compile; carried like the PTX cache.
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/cuda-compute-cache}
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
if [ -f .gpu/cuda-cache.tar.xz ] && [ ! -d "$CUDA_CACHE_PATH" ]; then
  mkdir -p "$CUDA_CACHE_PATH" && tar -xJf .gpu/cuda-cache.tar.xz -C "$CUDA_CACHE_PATH"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # a stage killed with SIGABRT on time-out prints its Python stacks
