#!/usr/bin/env bash
# One device call for what this tree has not yet run or measured on a GPU (docs/benchmarks.md,
# thirteenth session, "Next device session"): GPU tests and measurements, each stage under its own
# time limit so that a slow one leaves the others' results. Every stage's whole output goes to
# logs/<stage>.log, benchmark results beside it; $OUT keeps three files (the device tool returns
# only a few): stages.txt (exit codes), logs.tar.gz and ptx-cache.tar.xz (for the next call's .gpu/).
# Usage (repository root, MLX bundle carried in .gpu/): bash benchmarks/gpu_verify.sh [STAGE ...]
# Stages run in the order named (default: the list below). They share GPU_BUDGET seconds (default
# 500, under the device tool's 600 s per command, leaving the install, the unpacking and the
# packing their time): each is cut to what is left, so the packing at
# the end always runs.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
LOGS=$OUT/logs
mkdir -p "$LOGS"
DEADLINE=$((SECONDS + ${GPU_BUDGET:-500}))

stage() {  # stage NAME SECONDS COMMAND...: NAME's command, within the budget
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
  shift 2
  if ((left < limit)); then limit=$left; fi
  if ((limit < 20)); then echo "$name skipped (budget)" | tee -a "$OUT/stages.txt"; return 0; fi
  echo "== $name"
  # ABRT on time-out: Python's fault handler (gpu_env.sh) prints where each thread was
  timeout -s ABRT -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/stages.txt"
  tail -n 24 "$LOGS/$name.log"
}

# decode against MLX's CUDA graph settings. MLX records launches into CUDA graphs of at most
# MLX_MAX_OPS_PER_BUFFER nodes (its source: 100 on sm_90), updating a cached executable graph at
# each commit; MLX_USE_CUDA_GRAPHS=0 launches each kernel directly instead (the fourteenth
# session: more host time). mlx_dsv41 sets 1,000 where unset (docs/design.md#graph-size).
# GRAPH_SETTINGS overrides the list: one process each, in order; commas join settings of one process,
# NONE leaves both variables unset (the package's default)
graphs() {
  for setting in ${GRAPH_SETTINGS:-MLX_MAX_OPS_PER_BUFFER=100 NONE}; do
    echo "$setting"
    local vars=${setting//,/ }
    [ "$vars" = NONE ] && vars=
    # shellcheck disable=SC2086
    env -u MLX_MAX_OPS_PER_BUFFER -u MLX_MAX_MB_PER_BUFFER $vars python3 benchmarks/bench_model.py --quick --skip-mlx-lm --no-dspark \
      --out "$LOGS/graphs_$setting" | grep -A2 "^| model"
  done
}
export LOGS
export -f graphs
# GPU_TESTS: the files (or pytest node ids) the tests stage runs, GPU_JOBS at a time (default: the
# files that cover this session's kernels and the token path)
TESTS=${GPU_TESTS:-"tests/gpu/test_roped_gemv_gpu.py tests/gpu/test_rope_gpu.py tests/gpu/test_sparse_attention_unrotated_gpu.py tests/gpu/test_index_select_gpu.py
tests/gpu/test_hc_kernels.py tests/gpu/test_model_gpu.py
tests/gpu/test_compiled_step_gpu.py tests/gpu/test_grid_finish_gpu.py tests/gpu/test_kernel_header_files_gpu.py
tests/gpu/test_exl3_kernels.py::test_a_k_split_gemv_finishes_itself_with_the_two_launch_bytes
tests/gpu/test_exl3_kernels.py::test_linear_dispatch
tests/gpu/test_exl3_kernels.py::test_gemv_rows_and_splits
tests/gpu/test_exl3_kernels.py::test_gemv_row_bytes_do_not_depend_on_the_other_rows"}

run() {  # run NAME: one stage
  case $1 in
    graphs) stage graphs 450 bash -c graphs ;;
    # the GPU tests side by side, five files at a time (each process compiles its own kernels)
    tests) stage tests 240 env OUT="$LOGS" GPU_JOBS=${GPU_JOBS:-8} GPU_FILE_TIMEOUT=230 bash benchmarks/gpu_run.sh tests-parallel "$TESTS" ;;
    # greedy DSpark against plain greedy on the demo (issue 18)
    agreement) stage agreement 230 python3 benchmarks/dspark_agreement.py --demo --prompts 4 --tokens 32 ;;
    # the demo in one process: cold, a warm time to first token, greedy DSpark == plain (issues 17, 18)
    timeline) stage timeline 400 python3 benchmarks/demo_timeline.py --tokens 24 --prompts 6 ;;
    # the indexer's scores and top-k: index_scores against the plain-MLX path, one decode row (issue 16)
    index) stage index 100 python3 benchmarks/bench_index_select.py --out "$LOGS" ;;
    # where auto's rows rule (sparse_attention.ROWS_AUTO_MIN) should start
    sweep) stage sweep 60 python3 benchmarks/bench_sparse_attention.py --quick --out "$LOGS" \
      --rows-sweep 1 2 4 6 8 12 16 24 32 64 128 ;;
    # the demo's time to the first token in a warm process: the second pass (issue 17)
    demo_ttft) stage demo_ttft 330 python3 -m mlx_dsv41.warmup --demo --tokens 40 ;;
    # where a 2,048-token prefill goes, auto's kernels (issue 17 item 1)
    prefill_parts) stage prefill_parts 150 python3 benchmarks/bench_model.py --quick --skip-mlx-lm --prefill-parts 2048 --out "$LOGS" ;;
    # the fp32-sums costs of the MX linears (issue 15 item 4)
    linear) stage linear 110 python3 benchmarks/bench_linear_arithmetic.py --rows 1 5 --repeats 5 --out "$LOGS" ;;
    # the DSpark verify and draft costs against a decode step (issue 18 item 6)
    dspark) stage dspark 170 python3 benchmarks/bench_model.py --quick --dspark-only --verify-k 4 --skip-mlx-lm --out "$LOGS" ;;
    # prefill with auto's kernels, three timed passes per size (issue 17 item 2)
    prefill) stage prefill 150 python3 benchmarks/bench_model.py --skip-mlx-lm --prefill 2048 8192 --repeats 3 --out "$LOGS" ;;
    # decode, Flash-shaped, beside mlx-lm (issue 16); again with k-split EXL3 linears finished by
    # exl3_gemv_out (two launches each) instead of by their own last threadgroup
    # (DECODE_AB= leaves the A/B out)
    decode) stage decode 420 python3 benchmarks/bench_model.py --quick --no-dspark --out "$LOGS" \
      ${DECODE_AB---exl3-tuning finish_splits=0} ;;
    # the demo checkpoint's decode beside mlx-lm at the demo's dimensions (issue 16: >= 200 tokens/s)
    demo) stage demo 200 python3 benchmarks/bench_model.py --quick --demo --no-dspark --out "$LOGS/demo" ;;
    # our Flash-shaped decode alone, every kernel's count and time in logs/profile/bench_model.json; PROFILE_AB adds an A/B run
    profile) stage profile 240 python3 benchmarks/bench_model.py --quick --no-dspark --skip-mlx-lm --out "$LOGS/profile" ${PROFILE_AB-} ;;
    # decode from the pruned and from the whole kernel sources, one process (issue 16)
    pruning) stage pruning 300 python3 benchmarks/bench_model.py --quick --no-dspark --skip-mlx-lm \
      --whole-kernel-sources --out "$LOGS/pruning" ;;
    # what a launch pays to read or write MLX's small (managed-pool) arrays against device memory
    pool) stage pool 120 python3 benchmarks/scalar_pool.py --out "$LOGS" ;;
    # where the merged launches' device time goes: each beside its parts and ablated copies
    parts) stage parts 150 python3 benchmarks/kernel_parts.py --out "$LOGS" ;;
    # the mHC site launches alone after a 512 MiB read each: as cold as in a decode step
    parts_cold) stage parts_cold 120 python3 benchmarks/kernel_parts.py --cold --sites-only --out "$LOGS/cold" ;;
    # MLX's host cost a launch: trivial kernels, then against the inputs and outputs a launch carries
    # (the inputs part again with MLX_USE_CUDA_GRAPHS=0: each kernel launched directly)
    host) stage host 120 bash -c "python3 benchmarks/profile_exl3.py --part host && python3 benchmarks/profile_exl3.py --part inputs \
      && MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/profile_exl3.py --part inputs" ;;
    *) echo "gpu_verify.sh: no stage $1" | tee -a "$OUT/stages.txt" ;;
  esac
}

# CUDA kernel headers are handed to MLX as files (docs/design.md#kernel-header-files): where NVRTC
# cannot include one, every stage would fail to compile, so the call goes on with them inline.
if ! timeout 120 python3 -c 'import mlx.core as mx; from mlx_dsv41.kernels import fp32_linear as f
x = mx.ones((1, 64)); mx.eval(f.GEMV(**f.gemv_args(x, mx.ones((8, 64))))[0])' > "$LOGS/header_files.log" 2>&1; then
  export MLX_DSV41_KERNEL_HEADERS=inline
  echo "kernel header files failed to compile: headers inline (logs/header_files.log)" | tee -a "$OUT/stages.txt"
fi

# the machine's GPU, driver and MIG mode: the greedy tokens have differed between calls
# (docs/benchmarks.md, twenty-first session), and the driver compiles the PTX to machine code
nvidia-smi --query-gpu=name,driver_version,mig.mode.current,clocks.max.sm,memory.total --format=csv,noheader \
  > "$LOGS/gpu.txt" 2>&1 || true
echo "gpu: $(head -n 1 "$LOGS/gpu.txt")" | tee -a "$OUT/stages.txt"
for name in ${*:-decode tests}; do run "$name"; done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
bash benchmarks/gpu_save_ptx.sh > /dev/null 2>&1 || true
