"""mxfp4_gemv on the GPU (issue 15 item 4: fp32 sums for few-row mxfp4 products at no cost), with
the kernel contract: against float64 x · Wᵀ of MLX's dequantized weight at Flash's expert shapes
for 1..7 rows of bf16 x; expert slots; outputs poisoned (NaN) before launch with guard rows
untouched; five repeats byte-identical; a row's bytes the same solo and batched; the launch limit
declared. Then the layers: MXLinear and MXExperts take the kernel on CUDA and agree with MLX's
fp32-x path to bf16 rounding."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import mxfp4_gemv as mg

pytestmark = pytest.mark.gpu
ONE = graph_constants.array(((0, 0),), mx.int32)


def _wq(seed, E, N, K):
    w = mx.random.normal((E, N, K), key=mx.random.key(seed)) * K**-0.5
    return mx.quantize(w, group_size=32, bits=4, mode="mxfp4")


def _x(seed, rows, K):
    return mx.array(np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)).astype(mx.bfloat16)


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


def _w64(q, s):
    return f64(mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4"))


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("N,K", [(2304, 5120), (5120, 2304)])
def test_expert_shapes_match_float64(rows, N, K):
    assert mg.takes_kernel(4, "mxfp4", rows)
    q, s = _wq(rows, 1, N, K)
    x = _x(rows, rows, K)
    y = np.array(mg.linear(x, q[0], s[0]))
    want = f64(x) @ _w64(q, s)[0].T
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()  # a bf16 sum would be ~1e-2


def test_slots_poison_guards_repeats_and_solo_equals_batched():
    q, s = _wq(9, 6, 2304, 5120)
    x = _x(9, 2, 5120)
    slots = mx.array([[0, 5], [1, 0], [0, 2], [1, 2], [0, 0], [1, 4]], mx.int32)
    runs = [np.array(mg.GEMV(**mg.gemv_args(x, q, s, slots, 1, guard=2, init_value=float("nan")))[0]) for _ in range(5)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    assert np.all(np.isnan(runs[0][6:])) and not np.any(np.isnan(runs[0][:6]))
    x64, w64 = f64(x), _w64(q, s)
    want = np.stack([x64[r] @ w64[e].T for r, e in np.array(slots).tolist()])
    assert np.abs(runs[0][:6] - want).max() <= 1e-5 * np.abs(want).max()
    xs = _x(10, 7, 5120)
    batched = np.array(mg.linear(xs, q[3], s[3]))
    for r in (0, 4, 6):
        solo = np.array(mg.linear(xs[r : r + 1], q[3], s[3]))
        assert np.array_equal(solo[0].view(np.uint32), batched[r].view(np.uint32))
    with pytest.raises(ValueError, match="declared limit"):
        mg.GEMV(**dict(mg.gemv_args(x, q, s, slots, 1), threadgroup=(512, 1, 1)))


def test_layers_take_the_kernel_and_agree_with_the_fp32_x_path(monkeypatch):
    from mlx_dsv41.quant.official import mx_quantized_linear

    q, s = _wq(11, 1, 1024, 5120)
    lin = mx_quantized_linear(q[0], s[0], "mxfp4")
    x = _x(11, 3, 5120)
    calls = []
    real = mg.GEMV
    monkeypatch.setattr(mg, "GEMV", lambda **kw: calls.append(1) or real(**kw))
    got = np.array(lin(x).astype(mx.float32))
    assert calls
    monkeypatch.setattr(mg, "takes_kernel", lambda *a: False)
    want = np.array(lin(x.astype(mx.float32)).astype(mx.bfloat16).astype(mx.float32))
    assert np.mean(got == want) > 0.9 and np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
