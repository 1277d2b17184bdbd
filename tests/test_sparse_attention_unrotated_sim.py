"""The attention output turned back in the attention launch (sparse_attention_unrotated,
docs/numerics.md#unrotated-output) on the CPU simulator: for the serial and the parallel kernel,
its bytes are those of that kernel's float32 output turned by the rope kernel (inverse, the
model's whole-width periods), at positions past 2^15 and with several query rows, for bf16 and
float32 outputs, nonfinite values where the two launches put them. The op takes the one launch
only on a GPU, for serial or parallel. tests/gpu/test_sparse_attention_unrotated_gpu.py repeats
this on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import rope as rope_kernel
from mlx_dsv41.kernels import sparse_attention as sa
from mlx_dsv41.model.rope import RoPE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

# (seed, B, S, H, D, W, T, N, position, output dtype, nonfinite)
CASES = [
    (1, 1, 1, 8, 512, 37, 20, 40, 40961, mx.bfloat16, False),
    (2, 2, 3, 3, 256, 16, 0, 16, 5, mx.bfloat16, False),
    (3, 1, 2, 2, 512, 5, 9, 12, 0, mx.float32, False),
    (4, 1, 2, 4, 512, 8, 8, 16, 77, mx.bfloat16, True),
]


def make_inputs(seed, B, S, H, D, W, T, N, nonfinite):
    """(q, window, pool, indices, sinks) bf16 / int32 / fp32; nonfinite: a NaN in q[0, 0, head 1] and an
    inf in q[0, S - 1, head 2] (shared with the GPU test)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    window = rng.standard_normal((B, W, D)).astype(np.float32)
    pool = rng.standard_normal((B, T, D)).astype(np.float32)
    indices = rng.integers(-1, W + T, (B, S, N)).astype(np.int32)
    sinks = rng.standard_normal(H).astype(np.float32)
    if nonfinite:
        q[0, 0, 1, 6] = np.nan  # one (row, head): NaN outputs, and so the pairs they turn
        q[0, S - 1, 2, 4] = np.inf
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    return bf(q), bf(window), bf(pool), mx.array(indices), mx.array(sinks)


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_unrotated_output_gives_the_attention_then_rope_bytes(variant, case):
    seed, B, S, H, D, W, T, N, position, dtype, nonfinite = CASES[case]
    q, window, pool, indices, sinks = make_inputs(seed, B, S, H, D, W, T, N, nonfinite)
    period, offset = RoPE(64, 10000.0).whole_width(D), mx.array(position, mx.int32)
    one = sa.unrotated_args(q, window, pool, indices, sinks, 0.0625, period, offset, dtype, variant)
    attention = sa._launch_args(q, window, pool, indices, sinks, 0.0625, variant)
    program = exl3_sim.build([(sa.UNROTATED, one), (sa._KERNELS[variant], attention)], mma=True)
    (got,) = program.run(0)
    (o,) = program.run(1)
    rope = rope_kernel.args(mx.array(o), offset, period, dtype, 1, True, None)
    (want,) = exl3_sim.build([(rope_kernel.ROPE, rope)], mma=True).run(0)
    assert got.tobytes() == want.tobytes()
    assert got.shape == (B, S, H, D)
    values = got.astype(np.float32)
    if nonfinite:
        assert np.isnan(values[0, 0, 1]).all()
        assert not np.isfinite(values[0, S - 1, 2]).all()
    else:
        assert np.isfinite(values).all()
        # the leading pairs (infinite period) pass unchanged: the rounded attention output
        np.testing.assert_array_equal(
            values[..., : D - 64], o[..., : D - 64].astype(dtype_np(dtype)).astype(np.float32)
        )


def dtype_np(dtype):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == mx.bfloat16 else np.float32


def test_the_op_takes_one_launch_only_on_a_gpu_for_serial_or_parallel(monkeypatch):
    import mlx_dsv41.kernels as kernels

    q, window, pool, indices, sinks = make_inputs(5, 1, 1, 2, 256, 4, 4, 8, False)
    period, offset = RoPE(64, 10000.0).whole_width(256), mx.array(3, mx.int32)
    seen = []

    def record(self, **call):
        seen.append(self.name)
        return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

    assert sa.sparse_attention_unrotated(q, window, pool, indices, sinks, 0.0625, period, offset, mx.bfloat16) is None
    monkeypatch.setattr(kernels.Kernel, "__call__", record)
    monkeypatch.setattr(sa, "backend", lambda: "cuda")
    monkeypatch.setattr(sa, "_kernel_unavailable", lambda q: None)
    monkeypatch.setattr(sa, "_parallel_refusal", lambda *a: None)  # no probe launch
    for variant, want in (("serial", ["sparse_attention_unrotated"]), ("parallel", ["sparse_attention_unrotated"])):
        seen.clear()
        out = sa.sparse_attention_unrotated(
            q, window, pool, indices, sinks, 0.0625, period, offset, mx.bfloat16, variant
        )
        assert seen == want and out.dtype == mx.bfloat16 and out.shape == q.shape
    seen.clear()
    monkeypatch.setattr(sa, "rows_refusal", lambda *a: None)
    assert (
        sa.sparse_attention_unrotated(q, window, pool, indices, sinks, 0.0625, period, offset, mx.bfloat16, "rows")
        is None
    )
    assert (
        sa.sparse_attention_unrotated(q, window, pool, indices, sinks, 0.0625, period, 3, mx.bfloat16, "serial") is None
    )
    monkeypatch.setattr(sa, "UNROTATES", False)
    assert sa.sparse_attention_unrotated(q, window, pool, indices, sinks, 0.0625, period, offset, mx.bfloat16) is None
    assert seen == []
