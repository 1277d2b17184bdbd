"""The mxfp4_gemv kernel body (mlx_dsv41/metal_ext/mxfp4_gemv.metal) on the CPU simulator, with the
launch kwargs mlx_dsv41.kernels.mxfp4_gemv hands to MLX: against float64 x · Wᵀ of MLX's own
dequantized weight (fp32 sums: fp32-level error, far under a bf16 rounding) for fp32, bf16 and fp16
x and 1 to 8 rows; routed-expert slots, each its own row and expert; a row's bytes the same solo
and among 8; a NaN scale (E8M0 255) where float64 puts it; outputs past N and guard rows untouched
(poisoned). Then K off the 256-k step (a last, partial step; 2 and 8 SIMD groups splitting k, one
of them with no step), infinities and NaN in x against float64, scales above 240 (the 2^14 of the
decode not folded into them) against a float64 decode of our own, and x read element by element
(the path for a view that does not start 16-byte aligned) giving the same bytes.
tests/gpu/test_mxfp4_gemv_gpu.py repeats the first part on the device."""

import dataclasses
import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import mxfp4_gemv as mg

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

K, N, E, GUARD = 1280, 100, 3, 2  # K: 5 steps of 256 (2 SIMD groups split them); N % 4 != 0
ONE = graph_constants.array(((0, 0),), mx.int32)
DENSE = [(1, mx.float32), (5, mx.bfloat16), (8, mx.float16)]  # rows, x dtype
SLOTS = [[0, 2], [3, 0], [1, 1], [3, 2], [0, 0]]  # (x row, expert)


def _weights(seed, k=K, n=N):
    w = mx.array(np.random.default_rng(seed).standard_normal((E, n, k)).astype(np.float32) / np.sqrt(k))
    return mx.quantize(w, group_size=32, bits=4, mode="mxfp4")


def _x(seed, rows, dtype, k=K):
    return mx.array(np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)).astype(dtype)


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
    x = _x(9, 4, mx.bfloat16)  # and a slot's bytes are its row's in a linear of its expert
    same = np.concatenate([_in_order(x[r : r + 1], q[e : e + 1], s[e : e + 1]) for r, e in SLOTS])
    assert np.array_equal(y[:-GUARD].view(np.uint32), same.view(np.uint32))


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
    # Every product of that group positive: NaN still (an infinite scale would give +inf).
    words = np.array(q)
    words[0, 7, 12:16] = 0x22222222  # codes 2: value 1
    x = np.array(_x(1, 5, mx.float32))
    x[:, 96:128] = np.abs(x[:, 96:128]) + 0.5
    call = mg.gemv_args(mx.array(x).astype(mx.bfloat16), mx.array(words)[:1], s_nan[:1], ONE, 5, guard=GUARD)
    (y,) = prog.run(1, call)
    assert np.all(np.isnan(y[:5, 7]))


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


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _decode64(q, s):
    """Our own float64 decode of mxfp4 [E, N, K/8] words and [E, N, K/32] E8M0 scales (255: NaN)."""
    words = np.array(q).astype(np.uint64)
    codes = (words[..., None] >> (4 * np.arange(8, dtype=np.uint64))) & 15
    values = E2M1[codes.reshape(*words.shape[:-1], -1)]
    raw = np.array(s).astype(np.float64)
    scale = np.where(raw == 255, np.nan, 2.0 ** (raw - 127))
    return values * np.repeat(scale, 32, axis=-1)


def _sum64(x, w):
    """float64 Σ_k x[m, k] · w[n, k] term by term: IEEE inf · 0 = NaN, inf - inf = NaN."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.sum(x[:, None, :] * w[None, :, :], axis=-1)


def _fma32(a, b, c):
    """fp32 fma(a, b, c) through float64 (a · b exact there; a second rounding could differ from a
    true fma only on an exact fp32 tie after the first, which these seeded data do not hit)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _in_order(x, q, s):
    """y [M, N] float32 by the order docs/numerics.md#mxfp4-gemv gives, from our float64 decode:
    per lane and word 8 FMAs with the codes times 2^-14, then fma(partial, 2^(s - 113), sum)
    (s <= 240 here), steps split in runs over S SIMD groups, the xor butterfly, the groups in order."""
    x32 = np.array(x.astype(mx.float32))
    k = x32.shape[1]
    kw, S = k // 8, mg.split(k)
    steps = -(-kw // 32)
    run = -(-steps // S)
    codes = (_decode64(q, mx.full(s.shape, 127, mx.uint8))[0] * 2.0**-14).astype(np.float32)  # [N, K]
    scale = (2.0 ** (np.array(s[0]).astype(np.float64) - 113)).astype(np.float32)  # [N, K/32]
    assert np.array(s).max() <= 240
    g, lane = np.arange(S)[:, None], np.arange(32)[None, :]
    out = []
    for xr in x32:
        acc = np.zeros((S, 32, codes.shape[0]), np.float32)
        for i in range(run):
            st = g * run + i
            word = 32 * st + lane  # [S, 32]
            ok = word < kw  # a step past K, or a word past K in a last, partial step
            wq = np.minimum(word, kw - 1)
            p = np.zeros_like(acc)
            for t in range(8):
                p = _fma32(xr[8 * wq + t][..., None], codes[:, 8 * wq + t].transpose(1, 2, 0), p)
            acc = np.where(ok[..., None], _fma32(p, scale[:, wq // 4].transpose(1, 2, 0), acc), acc)
        for o in (16, 8, 4, 2, 1):
            acc = acc + acc[:, np.arange(32) ^ o]
        y = acc[0, 0]
        for h in range(1, S):
            y = y + acc[h, 0]
        out.append(y)
    return np.stack(out)


@pytest.mark.parametrize("k,n", [(1280, N), (1312, 36), (8224, 8)])
def test_the_documented_order_gives_the_same_bytes(program, k, n):
    prog, _ = program
    q, s = _weights(5, k, n)
    for spec, (rows, dtype) in enumerate(DENSE):
        x = _x(6 + spec, rows, dtype, k)
        (y,) = prog.run(spec, mg.gemv_args(x, q[:1], s[:1], ONE, rows, guard=GUARD))
        assert np.array_equal(y[:-GUARD].view(np.uint32), _in_order(x, q, s).view(np.uint32)), (k, rows)


@pytest.mark.parametrize("k,n", [(1312, 36), (8224, 8)])
def test_k_off_the_step_matches_float64(program, k, n):
    """1312: 6 steps, the last 4 words (lanes 0-3), 2 SIMD groups of 3 steps; 8224: 33 steps, 8
    SIMD groups of 5 (two batches of loads), the seventh with 3 ending on a partial step, the eighth
    with none."""
    assert (mg.split(1312), mg.split(8224)) == (2, 8)
    prog, _ = program
    q, s = _weights(5, k, n)
    w64 = _decode64(q, s)[0]
    assert np.array_equal(w64, _w64(q, s)[0])  # our decode is MLX's
    for spec, (rows, dtype) in enumerate(DENSE):
        x = _x(6 + spec, rows, dtype, k)
        (y,) = prog.run(spec, mg.gemv_args(x, q[:1], s[:1], ONE, rows, guard=GUARD))
        assert np.all(np.isnan(y[-GUARD:]))
        want = f64(x) @ w64.T
        assert np.abs(y[:-GUARD] - want).max() <= 2e-6 * np.abs(want).max(), (k, rows)


def test_infinities_and_nan_in_x_go_where_float64_puts_them(program):
    prog, (q, s) = program
    x = np.array(_x(7, 5, mx.float32))
    x[0, 5], x[1, 700], x[1, 33], x[2, 1279], x[3, 64] = np.inf, -np.inf, np.inf, np.inf, np.nan
    xb = mx.array(x).astype(mx.bfloat16)
    (y,) = prog.run(1, mg.gemv_args(xb, q[:1], s[:1], ONE, 5, guard=GUARD))
    want = _sum64(f64(xb), _w64(q, s)[0])
    y = y[:-GUARD]
    assert np.array_equal(np.isnan(y), np.isnan(want))
    assert np.array_equal(np.isposinf(y), np.isposinf(want)) and np.array_equal(np.isneginf(y), np.isneginf(want))
    assert np.isnan(want[0]).any() and np.isinf(want[0]).any()  # inf against a code 0 (± 0) and not
    assert np.isnan(want[1]).any() and np.isnan(want[3]).all()  # inf - inf; NaN
    finite = np.isfinite(want)
    assert np.all(finite[4]) and np.abs(y[finite] - want[finite]).max() <= 2e-6 * np.abs(want[finite]).max()


def test_scales_above_240_match_float64(program):
    """Scales 241..254 cannot take the decode's 2^14 (2^(s - 113) overflows): the partial sum is
    multiplied by 2^14 first. Each changed column against its own float64 sum."""
    prog, (q, s) = program
    raw = np.array(s)
    raw[0, 7, 3], raw[0, 8, 0], raw[0, 8, 39], raw[0, 9, 20] = 241, 245, 250, 240
    s_big = mx.array(raw)
    x = _x(8, 5, mx.bfloat16)
    (y,) = prog.run(1, mg.gemv_args(x, q[:1], s_big[:1], ONE, 5, guard=GUARD))
    want = _sum64(f64(x), _decode64(q, s_big)[0])
    y = y[:-GUARD]
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(want))
    err = np.abs(y - want).max(axis=0) / np.abs(want).max(axis=0)
    assert err.max() < 2e-6, err.max()
    assert np.abs(want[:, 8]).max() > 1e30  # the large scales did take part


def test_element_loads_give_the_same_bytes(program):
    """The element-load path (x not 16-byte aligned) against the 16-byte loads, every x dtype."""
    prog, (q, s) = program
    scalar = dataclasses.replace(mg.GEMV, defines=(("MXFP4_ELEMENT_LOADS", 1),), _built={})
    calls = [mg.gemv_args(_x(i, r, d), q[:1], s[:1], ONE, r, guard=GUARD) for i, (r, d) in enumerate(DENSE)]
    elem = exl3_sim.build([(scalar, c) for c in calls], mma=True)
    for i, call in enumerate(calls):
        (got,) = elem.run(i)
        (want,) = prog.run(i, call)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), DENSE[i]
