#!/usr/bin/env bash
# One command on a two-GPU machine (issue 7): unpack the MLX bundle carried in .gpu/ (as
# gpu_run.sh does), then run benchmarks/bench_distributed.py three times, each under `timeout`:
# the one-GPU baseline, two NCCL ranks in "experts" mode, two in "slots" mode (mlx.launch's entry
# point: the console script is not installed when the wheel is unpacked, docs/mlx.md#cuda-offline);
# then the report (markdown table on stdout, bench_distributed.{json,md} in $OUT). About 4-6 minutes
# with a cold JIT cache; each run is capped at 170 s. Logs and JSON go to $OUT (or ./gpu_out).
# Usage: bash benchmarks/gpu_run_x2.sh [extra bench_distributed.py options, e.g. --layers 4]
# CPU smoke test of the script itself: PATH=.venv/bin:$PATH BACKEND=ring OUT=/tmp/x2 \
#   bash benchmarks/gpu_run_x2.sh --smoke --layers 4 --prompt 16 --steps 4 --repeats 3 --chain 8
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available(), "nccl", mx.distributed.is_available("nccl"))'
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
LOG="$OUT/bench_distributed.log"
BENCH=(python3 benchmarks/bench_distributed.py --out "$OUT" "$@")
# mlx.launch --backend nccl -n 2 (one GPU per rank: CUDA_VISIBLE_DEVICES = rank)
LAUNCH=(python3 -c 'import sys; from mlx._distributed_utils.launch import main; sys.argv = ["mlx.launch", *sys.argv[1:]]; main()'
        --backend "${BACKEND:-nccl}" -n 2)
# timeout signals its whole process group: the launcher and both ranks.
echo "== one GPU (baseline)" | tee -a "$LOG"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 170 "${BENCH[@]}" --role single 2>&1 | tee -a "$LOG"
for partition in experts slots; do
  echo "== two GPUs, NCCL, --moe-partition $partition" | tee -a "$LOG"
  timeout -k 10 170 "${LAUNCH[@]}" "${BENCH[@]}" --role rank --partition "$partition" 2>&1 | tee -a "$LOG"
done
echo "== report" | tee -a "$LOG"
"${BENCH[@]}" --role report 2>&1 | tee -a "$LOG"
