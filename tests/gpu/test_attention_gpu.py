"""Attention-side model semantics on the GPU (run by `bash benchmarks/gpu_run.sh`; skipped on CPU).

- fake quantization is bit-identical to MLX's CPU stream (it is integer / bit arithmetic plus
  exact power-of-two scaling and half-to-even rounding);
- top-k and candidate-block selection over scores full of exact ties is identical to the CPU
  stream (the int64 ranking keys leave no ties for a backend to order);
- RoPE agrees with the CPU stream to fp32 rounding;
- an attention stack with every role, at head_dim 256 so the sparse-attention kernels run:
  decode == prefill and chunked prefill == prefill at rounding level (GPU GEMMs change with the
  row count, so not bit for bit), and the stack is within the CPU suite's bounds of the float64
  reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import (
    FLASH_YARN,
    assert_rows_match,
    build_stack,
    check_against_reference,
    make_caches,
    random_input,
    run_chunks,
    run_stack,
    tiny_args,
)

from mlx_dsv41.kernels import sparse_attention as sa
from mlx_dsv41.model.fake_quant import E2M1, E4M3, fake_quant_fp4, fake_quant_fp8, round_to_grid
from mlx_dsv41.model.indexer import select_candidate_blocks, select_topk
from mlx_dsv41.model.rope import RoPE


def _both(fn, *inputs):
    """fn on the default (GPU) device and on the CPU stream, as numpy."""
    gpu = fn(*inputs)
    with mx.stream(mx.cpu):
        cpu = fn(*inputs)
    mx.eval(gpu, cpu)
    return np.array(gpu), np.array(cpu)


def _spread(shape, seed):
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.integers(-30, 12, (*shape[:-1], shape[-1] // 16, 1)).repeat(16, -1).reshape(shape)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fake_quant_is_bit_identical_to_cpu(dtype):
    x = _spread((64, 512), 0).astype(dtype)
    for fn in (
        lambda a: fake_quant_fp8(a, 32),
        lambda a: fake_quant_fp4(a, 32),
        lambda a: fake_quant_fp4(a, 16, scale="e4m3"),
        lambda a: round_to_grid(a * 64, E4M3),
        lambda a: round_to_grid(a, E2M1),
    ):
        gpu, cpu = _both(lambda a: fn(a).astype(mx.float32), x)
        assert np.array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


def test_selection_with_ties_is_identical_to_cpu():
    rng = np.random.default_rng(1)
    T, S = 1000, 33
    s = np.round(rng.standard_normal((2, S, T)) * 2) / 2
    s[rng.random(s.shape) < 0.4] = 0.0
    visible = np.linspace(0, T, S).astype(int)
    s = np.where(np.arange(T)[None, None] < visible[None, :, None], s, -np.inf).astype(np.float32)
    scores = mx.array(s)
    for k in (1, 64, 512):
        gpu, cpu = _both(lambda a: select_topk(a, k, visible), scores)
        assert np.array_equal(gpu, cpu), k
    gpu, cpu = _both(lambda a: select_candidate_blocks(a, visible, 8, 20), scores)
    assert np.array_equal(gpu, cpu)


def test_rope_matches_cpu():
    x = mx.array(np.random.default_rng(2).standard_normal((2, 7, 8, 512)).astype(np.float32))
    for rope in (RoPE(64, 10000.0), RoPE(64, 160000.0, FLASH_YARN)):
        gpu, cpu = _both(lambda a: rope(a, 65530), x)
        assert np.abs(gpu - cpu).max() <= 2.0**-23 * 65540 * np.abs(cpu).max()


@pytest.fixture(scope="module")
def kernel_stack():
    args = tiny_args(head_dim=256, sliding_window=16)
    return args, build_stack(args, seed=4)


def test_stack_uses_the_kernels_and_decode_matches_prefill(kernel_stack):
    args, stack = kernel_stack
    x = random_input(args, 2, 40, seed=5)
    before = sa.variant_counts()
    prefill = run_stack(stack, make_caches(args), x)
    after = sa.variant_counts()
    assert after["reference"] == before["reference"], sa.reference_reasons()
    assert after["serial"] + after["parallel"] == before["serial"] + before["parallel"] + args.num_hidden_layers
    assert_rows_match(run_chunks(stack, make_caches(args), x, [1] * 40), prefill, "decode")
    for chunk in (3, 16, 17, 32):
        sizes = [chunk] * (40 // chunk) + ([40 % chunk] if 40 % chunk else [])
        assert_rows_match(run_chunks(stack, make_caches(args), x, sizes), prefill, f"chunks of {chunk}")


def test_stack_matches_float64_reference_on_gpu(kernel_stack):
    args, stack = kernel_stack
    check_against_reference(args, stack, random_input(args, 1, 40, seed=6))
