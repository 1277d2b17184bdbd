"""The fake_quant kernel (docs/model.md#fake-quant): x [..., D] rounded to a block float format, one
launch where the plain-MLX twin (mlx_dsv41/model/fake_quant.py, the CPU path and the oracle) is
about eight after fusion. The same operations in the same order: the same bytes
(tests/test_fake_quant_sim.py, tests/gpu/test_fake_quant_gpu.py).

    run(x, block, mode) -> x's shape and dtype;  mode: FP8_UE8M0, FP4_UE8M0 or FP4_E4M3
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_dsv41.kernels import Kernel, register

FP8_UE8M0, FP4_UE8M0, FP4_E4M3 = 0, 1, 2
BLOCKS = (16, 32)  # a block's lanes sit in one SIMD group
_THREADS = 256

FAKE_QUANT = register(
    Kernel(
        "fake_quant",
        ("x",),
        ("out",),
        includes=("fake_quant.h",),
        max_threads=_THREADS,
        examples=lambda: _examples(),
    )
)


def takes(x: mx.array, block: int) -> bool:
    """Whether the kernel takes x (a float array whose last axis is whole blocks of 16 or 32)."""
    return takes_shape(x.shape, block)


def takes_shape(shape: tuple, block: int) -> bool:
    """`takes` for an array of this shape."""
    return block in BLOCKS and len(shape) >= 1 and math.prod(shape) > 0 and shape[-1] % block == 0


def args(x: mx.array, block: int, mode: int, init_value=None, guard: int = 0) -> dict:
    rows = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    flat = x.reshape(rows, x.shape[-1])
    return dict(
        inputs=[flat],
        output_shapes=[(rows + guard, x.shape[-1])],
        output_dtypes=[x.dtype],
        grid=(_THREADS * math.ceil(flat.size / _THREADS), 1, 1),
        threadgroup=(_THREADS, 1, 1),
        template=[("T", x.dtype), ("BLOCK", block), ("MODE", mode)],
        init_value=init_value,
    )


def run(x: mx.array, block: int, mode: int) -> mx.array:
    return FAKE_QUANT(**args(x, block, mode))[0].reshape(x.shape)


def _examples():
    x = mx.random.normal((3, 2, 64), key=mx.random.key(6)) * 40
    xb = x.astype(mx.bfloat16)
    return [args(xb, 32, FP8_UE8M0), args(x, 32, FP4_UE8M0), args(xb, 16, FP4_E4M3)]
