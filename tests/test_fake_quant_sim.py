"""The fake_quant kernel body (mlx_dsv41/metal_ext/fake_quant.metal) on the CPU simulator, with the
launch kwargs mlx_dsv41.kernels.fake_quant hands to MLX: the bytes of the plain-MLX twin
(mlx_dsv41/model/fake_quant.py) for the three uses (window KV e4m3 / 32, compressed KV e2m1 with
an e4m3 scale / 16, indexer e2m1 / 32), in bf16 and fp32, on data spanning many binades, all-zero
and tiny blocks, grid ties, saturation, and NaN / inf (NaN where the twin gives NaN); guard rows
untouched. tests/gpu/test_fake_quant_gpu.py repeats this on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import fake_quant as fqk
from mlx_dsv41.model import fake_quant as fq

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

GUARD = 1
CASES = [  # dtype, block, mode, the twin
    (mx.bfloat16, 32, fqk.FP8_UE8M0, lambda x: fq.fake_quant_fp8(x, 32)),
    (mx.bfloat16, 16, fqk.FP4_E4M3, lambda x: fq.fake_quant_fp4(x, 16, scale="e4m3")),
    (mx.bfloat16, 32, fqk.FP4_UE8M0, lambda x: fq.fake_quant_fp4(x, 32)),
    (mx.float32, 32, fqk.FP4_UE8M0, lambda x: fq.fake_quant_fp4(x, 32)),
    (mx.float32, 16, fqk.FP4_E4M3, lambda x: fq.fake_quant_fp4(x, 16, scale="e4m3")),
]


def inputs(seed: int, dtype) -> mx.array:
    """[3, 5, 128]: blocks of magnitudes 2^-30 .. 2^12, an all-zero block, a tiny block, grid ties, NaN / inf."""
    rng = np.random.default_rng(seed)
    binade = np.repeat(np.exp2(rng.integers(-30, 12, (3, 5, 8))), 16, axis=-1)  # one per 16 values
    x = rng.standard_normal((3, 5, 128)) * binade
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = 1e-30
    x[1, 0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -2.5, 6, -6, 7, 100, 0.5, -0.0, 3]
    x[2, 3, 5], x[2, 4, 70], x[1, 2, 33] = np.nan, np.inf, -np.inf
    return mx.array(x.astype(np.float32)).astype(dtype)


@pytest.fixture(scope="module")
def program():
    specs = [(fqk.FAKE_QUANT, fqk.args(inputs(i, d), b, m, guard=GUARD)) for i, (d, b, m, _) in enumerate(CASES)]
    return exl3_sim.build(specs, mma=True)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_kernel_gives_the_twins_bytes(program, i):
    dtype, _, _, twin = CASES[i]
    x = inputs(i, dtype)
    (out,) = program.run(i)
    assert np.all(_bits(out[-GUARD:]) == (0xFFFF if out.dtype.itemsize == 2 else 0xFFFFFFFF))  # poison kept
    got = out[:-GUARD].reshape(x.shape)
    want = twin(x)
    want_np = np.array(want.astype(mx.float32)) if dtype == mx.bfloat16 else np.array(want)
    got_f = got.astype(np.float32) if dtype == mx.bfloat16 else got
    nan = np.isnan(want_np)
    assert np.array_equal(np.isnan(got_f), nan)
    assert np.array_equal(_bits(np.ascontiguousarray(got_f[~nan])), _bits(np.ascontiguousarray(want_np[~nan])))
    assert np.count_nonzero(want_np) > want_np.size // 3  # not a test of zeros


def test_the_twin_takes_the_kernel_on_a_gpu_only(monkeypatch):
    x = inputs(0, mx.bfloat16)
    assert not fq._on_kernel(x, 32)
    monkeypatch.setattr(fq, "backend", lambda: "cuda")
    assert fq._on_kernel(x, 32) and fq._on_kernel(x, 16) and not fq._on_kernel(x[..., :24], 16)
