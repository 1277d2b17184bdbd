"""The mxfp4_gemv kernel body (mlx_dsv41/metal_ext/mxfp4_gemv.metal) on the CPU simulator, with the
launch kwargs mlx_dsv41.kernels.mxfp4_gemv hands to MLX: against float64 x · Wᵀ of MLX's own
dequantized weight (fp32 sums: fp32-level error, far under a bf16 rounding) for fp32, bf16 and fp16
x and 1 to 8 rows; routed-expert slots, each its own row and expert; a row's bytes the same solo
and among 8; a NaN scale (E8M0 255) where float64 puts it; outputs past N and guard rows untouched
(poisoned). tests/gpu/test_mxfp4_gemv_gpu.py repeats this on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import mxfp4_gemv as mg

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

K, N, E, GUARD = 1280, 100, 3, 2  # K: 40 scale groups (lanes 0-7 take two); N: a partial threadgroup
ONE = graph_constants.array(((0, 0),), mx.int32)
DENSE = [(1, mx.float32), (5, mx.bfloat16), (8, mx.float16)]  # rows, x dtype
SLOTS = [[0, 2], [3, 0], [1, 1], [3, 2], [0, 0]]  # (x row, expert)


def _weights(seed):
    w = mx.array(np.random.default_rng(seed).standard_normal((E, N, K)).astype(np.float32) / np.sqrt(K))
    return mx.quantize(w, group_size=32, bits=4, mode="mxfp4")


def _x(seed, rows, dtype):
    return mx.array(np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)).astype(dtype)


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


def _w64(q, s):
    return f64(mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4"))  # [E, N, K]


@pytest.fixture(scope="module")
def program():
    q, s = _weights(0)
    specs = [(mg.GEMV, mg.gemv_args(_x(i, r, d), q[:1], s[:1], ONE, r, guard=GUARD)) for i, (r, d) in enumerate(DENSE)]
    specs.append((mg.GEMV, mg.gemv_args(_x(9, 4, mx.bfloat16), q, s, mx.array(SLOTS, mx.int32), 1, guard=GUARD)))
    return exl3_sim.build(specs, mma=True), (q, s)


@pytest.mark.parametrize("i", range(len(DENSE)))
def test_dense_rows_match_float64(program, i):
    prog, (q, s) = program
    rows, dtype = DENSE[i]
    (y,) = prog.run(i)
    assert np.all(np.isnan(y[-GUARD:]))  # guard rows keep the 0xFF poison
    want = f64(_x(i, rows, dtype)) @ _w64(q, s)[0].T
    err = np.abs(y[:-GUARD] - want).max() / np.abs(want).max()
    assert err < 2e-6, err  # fp32 sums over K = 1280 (a bf16 rounding is 4e-3)


def test_expert_slots_match_float64(program):
    prog, (q, s) = program
    (y,) = prog.run(len(DENSE))
    assert np.all(np.isnan(y[-GUARD:]))
    x64, w64 = f64(_x(9, 4, mx.bfloat16)), _w64(q, s)
    want = np.stack([x64[r] @ w64[e].T for r, e in SLOTS])
    assert np.abs(y[:-GUARD] - want).max() < 2e-6 * np.abs(want).max()


def test_a_row_has_the_same_bytes_solo_and_batched(program):
    prog, (q, s) = program
    x = _x(2, 8, mx.float16)
    (batched,) = prog.run(2)
    (solo,) = prog.run(0, mg.gemv_args(x[3:4].astype(mx.float32), q[:1], s[:1], ONE, 1, guard=GUARD))
    (solo16,) = prog.run(2, mg.gemv_args(mx.concatenate([x[3:4]] * 8), q[:1], s[:1], ONE, 8, guard=GUARD))
    assert np.array_equal(solo16[0].view(np.uint32), batched[3].view(np.uint32))
    assert np.array_equal(solo[0].view(np.uint32), batched[3].view(np.uint32))  # fp16 x widened exactly


def test_a_nan_scale_gives_nan_where_float64_does(program):
    prog, (q, s) = program
    raw = np.array(s)
    raw[0, 7, 3] = 255  # output 7, k 96..127
    s_nan = mx.array(raw)
    (y,) = prog.run(1, mg.gemv_args(_x(1, 5, mx.bfloat16), q[:1], s_nan[:1], ONE, 5, guard=GUARD))
    assert np.all(np.isnan(y[:5, 7])) and not np.any(np.isnan(np.delete(y[:5], 7, axis=1)))


@pytest.fixture
def simulated_cuda(monkeypatch, program):
    """The MX layers' CUDA path on this CPU: mxfp4_gemv taken, its launches run on the simulator."""
    prog, _ = program
    launches = []

    def launch(**call):
        launches.append(call["template"])
        spec = 3 if dict(call["template"])["M"] == 1 else 1  # a spec with the call's template
        return [mx.array(prog.run(spec, call)[0])]

    monkeypatch.setattr(mg, "takes_kernel", lambda bits, mode, rows: mode == "mxfp4" and rows < mg.MAX_ROWS)
    monkeypatch.setattr(mg, "GEMV", launch)
    return launches


def _close_bf16(got, want):
    """bf16 outputs of two fp32 summation orders: most equal, the rest one rounding apart."""
    assert np.mean(got == want) > 0.9
    assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max()


def test_mx_linear_and_experts_take_the_kernel(simulated_cuda, monkeypatch):
    from mlx_dsv41.quant.mx_experts import MXExperts
    from mlx_dsv41.quant.official import mx_quantized_linear

    q, s = _weights(3)
    lin = mx_quantized_linear(q[0], s[0], "mxfp4")
    x = _x(4, 5, mx.bfloat16)
    got = np.array(lin(x[None]).astype(mx.float32))[0]
    want = np.array((f64(x) @ _w64(q, s)[0].T).astype(np.float32))
    assert got.shape == (5, N) and simulated_cuda == [[("M", 5), ("COLS", 4)]]
    _close_bf16(got, np.array(mx.array(want).astype(mx.bfloat16).astype(mx.float32)))

    D, inter = 256, 128
    rng = np.random.default_rng(5)
    w = {
        p: mx.array(rng.standard_normal((3, *shape)).astype(np.float32) / 16)
        for p, shape in (("w1", (inter, D)), ("w3", (inter, D)), ("w2", (D, inter)))
    }
    parts = {p: [(*mx.quantize(w[p][e], group_size=32, bits=4, mode="mxfp4"), "mxfp4") for e in range(3)] for p in w}
    ex = MXExperts.from_parts(parts, 4, D, inter, 10.0, (1, 4))
    xe = mx.array(rng.standard_normal((1, D)).astype(np.float32)).astype(mx.bfloat16)
    idx, wts = mx.array([[0, 3, 1, 2]], mx.int32), mx.array([[0.4, 0.3, 0.2, 0.1]], mx.float32)
    simulated_cuda.clear()
    got = np.array(ex(xe, idx, wts))
    assert simulated_cuda == [[("M", 1), ("COLS", 4)]] * 3  # w1, w3, w2: a launch each over the slots
    monkeypatch.setattr(mg, "takes_kernel", lambda *a: False)  # MLX's path (fp32 x: fp32 sums)
    want = np.array(ex(xe, idx, wts))
    assert np.all(got[0, 0] == 0)  # expert 0 is not held
    _close_bf16(got, want)
