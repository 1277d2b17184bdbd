"""The mHC kernels on the GPU (hc_mix, hc_collapse_norm, hc_expand; issue 16), with the kernel
contract: against float64 at Flash width (HC 4, D 5120) on peaked and plain mixes; nonfinite
inputs (NaN, ±inf in the streams) give what float64 gives, position by position; outputs
poisoned (NaN) before launch, guard rows untouched, five repeats byte-identical; a token's bytes
do not depend on the other tokens of the call (batched == solo); the launch limit is declared.
"""

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import rb
from test_hyper_connections import mixes_f64

from mlx_dsv41.kernels import hyper_connections as hc

pytestmark = pytest.mark.gpu
HC, D, ITERS, HC_EPS, NORM_EPS = 4, 5120, 20, 1e-6, 1e-20
NAN = float("nan")


def f64(a):
    return np.array(mx.array(a).astype(mx.float32), np.float64)


def _inputs(seed, T=5, peaked=4.0):
    rng = np.random.default_rng(seed)
    s = mx.array(rng.standard_normal((T, HC, D)).astype(np.float32)).astype(mx.bfloat16)
    mix = (2 + HC) * HC
    fn = mx.array((rng.standard_normal((mix, HC * D)) * peaked / np.sqrt(HC * D)).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 1.5, 3).astype(np.float32))
    return s, fn, base, scale


def _site_kernel(s, fn, base, scale, guard=0, init_value=None, mm=None, pre=None):
    """hc_mix's two outputs: the mixes and the site input (pre, by default, and weight from _site_norm)."""
    T = s.shape[0]
    mm = s.reshape(T, HC * D).astype(mx.float32) @ fn.T if mm is None else mm
    default_pre, w = _site_norm(T)
    pre = default_pre if pre is None else pre
    call = hc.mix_args(mm, s, base, scale, pre, w, ITERS, HC_EPS, NORM_EPS, NORM_EPS, init_value, guard)
    return [np.array(o.astype(mx.float32)) for o in hc.MIX(**call)]


def _site_norm(T):
    """(pre [T, HC], weight [D]); the weight is the same for every T."""
    weight = mx.array((1 + 0.1 * np.random.default_rng(12).standard_normal(D)).astype(np.float32))
    return mx.array(np.random.default_rng(11).uniform(0.1, 1, (T, HC)).astype(np.float32)), weight


def _mix_kernel(*a, **k):
    return _site_kernel(*a, **k)[0]


def _same_bytes(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32))


@pytest.mark.parametrize("peaked", [1.0, 4.0, 16.0])
def test_mix_matches_float64(peaked):
    s, fn, base, scale = _inputs(1, peaked=peaked)
    pre, post, comb = hc.mixes(s, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    want = mixes_f64(f64(s), f64(fn), f64(base), f64(scale))
    for got, ref, tol in ((pre, want[0], 2e-6), (post, want[1], 4e-6), (comb, want[2], 1e-5)):
        np.testing.assert_allclose(np.array(got), ref, rtol=0, atol=tol)


def test_mix_contract_poison_guards_repeats_and_batch_independence():
    s, fn, base, scale = _inputs(2, T=6)
    runs = [_mix_kernel(s, fn, base, scale, guard=3, init_value=NAN) for _ in range(5)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    assert np.all(np.isnan(runs[0][6:])) and not np.any(np.isnan(runs[0][:6]))
    # The kernel's own rows are independent (MLX's matmul that makes mm is not: its GEMV for one
    # row sums in another order than its GEMM for six, so the solo call gets row 2 of the same mm).
    mm = s.reshape(6, HC * D).astype(mx.float32) @ fn.T
    solo = _mix_kernel(s[2:3], fn, base, scale, mm=mm[2:3])
    assert _same_bytes(solo, _mix_kernel(s, fn, base, scale, mm=mm)[2:3])


def test_mix_nonfinite_streams_follow_float64():
    s, fn, base, scale = _inputs(3, T=4)
    raw = np.array(s.astype(mx.float32))
    raw[1, 0, 7], raw[2, 3, 100], raw[3, 1, 0] = np.nan, np.inf, -np.inf
    s = mx.array(raw).astype(mx.bfloat16)
    got = _mix_kernel(s, fn, base, scale)
    with np.errstate(all="ignore"):
        want = np.concatenate([a.reshape(4, -1) for a in mixes_f64(f64(s), f64(fn), f64(base), f64(scale))], axis=1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-5)


def _collapse_norm_f64(s, pre, w):
    x = rb(np.einsum("ti,tid->td", pre, s))
    return rb(x / np.sqrt(np.mean(x * x, -1, keepdims=True) + NORM_EPS) * w)


def test_collapse_norm_contract():
    s, *_ = _inputs(4, T=6)
    rng = np.random.default_rng(4)
    pre = mx.array(rng.uniform(0.1, 1, (6, HC)).astype(np.float32))
    w = mx.array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32)).astype(mx.bfloat16)

    def call(x, guard=2):
        return np.array(
            hc.COLLAPSE_NORM(**hc.collapse_norm_args(x, pre[: x.shape[0]], w, NORM_EPS, NAN, guard))[0].astype(
                mx.float32
            )
        )

    runs = [call(s) for _ in range(5)]
    assert all(_same_bytes(r, runs[0]) for r in runs) and np.all(np.isnan(runs[0][6:]))
    want = _collapse_norm_f64(f64(s), f64(pre), f64(w))
    assert np.mean(runs[0][:6] == want) > 0.98 and np.abs(runs[0][:6] - want).max() <= 2**-7 * np.abs(want).max()
    assert np.array_equal(call(s[:1], 0), runs[0][:1])
    raw = np.array(s.astype(mx.float32))
    raw[2, 1, 9] = np.inf
    got = call(mx.array(raw).astype(mx.bfloat16), 0)
    with np.errstate(all="ignore"):
        want = _collapse_norm_f64(raw.astype(np.float64), f64(pre), f64(w))
    assert np.array_equal(np.isnan(got), np.isnan(want))


def test_expand_contract():
    s, *_ = _inputs(5, T=6)
    rng = np.random.default_rng(5)
    y = mx.array(rng.standard_normal((6, D)).astype(np.float32)).astype(mx.bfloat16)
    post = mx.array(rng.uniform(0, 2, (6, HC)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (6, HC * HC)).astype(np.float32))
    m = mx.concatenate([mx.zeros((6, HC)), post, comb], axis=-1)  # the site's mixes: pre | post | comb
    call = lambda: np.array(hc.EXPAND(**hc.expand_args(y, s, m, NAN, 2))[0].astype(mx.float32))  # noqa: E731
    runs = [call() for _ in range(5)]
    assert all(_same_bytes(r, runs[0]) for r in runs) and np.all(np.isnan(runs[0][6:]))
    c = f64(comb).reshape(6, HC, HC)
    want = rb(f64(post)[..., None] * f64(y)[:, None, :] + np.einsum("tij,tid->tjd", c, f64(s)))
    assert np.mean(runs[0][:6] == want) > 0.99


def test_ops_on_the_model_shapes_match_the_mlx_reference():
    """The ops as the Block calls them ([B, S, HC, D]) against the plain-MLX reference on this GPU."""
    s, fn, base, scale = _inputs(6, T=6)
    s4 = s.reshape(2, 3, HC, D)
    got = hc.mixes(s4, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    ref = hc.mixes_reference(s4, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.array(g), np.array(r), rtol=0, atol=1e-5)
    w = mx.ones((D,), mx.bfloat16)
    x, xr = hc.collapse_norm(s4, got[0], w, NORM_EPS), hc.collapse_norm_reference(s4, got[0], w, NORM_EPS)
    assert x.shape == (2, 3, D) and np.mean(f64(x) == f64(xr)) > 0.98
    m = mx.concatenate([got[0], got[1], got[2].reshape(2, 3, HC * HC)], axis=-1)
    e, er = hc.expand(x, s4, m), hc.expand_reference(x, s4, got[1], got[2])
    assert e.shape == s4.shape and np.mean(f64(e) == f64(er)) > 0.99


def test_launch_limits_are_declared():
    for kernel in (hc.COLLAPSE_NORM, hc.EXPAND):
        assert kernel.max_threads == 256
    assert hc.MIX.max_threads == 1024 and hc.SITE.max_threads == 256  # hc_site finishes in fp32_gemv's threadgroup


def test_site_input_contract():
    """hc_mix's second output, the site input: collapse_norm against float64 (and within a rounding of
    the hc_collapse_norm kernel, which sums in another order), poison and guards, five repeats, a
    token's bytes solo == batched, NaN where float64 has it."""
    s, fn, base, scale = _inputs(7, T=6)
    runs = [_site_kernel(s, fn, base, scale, guard=2, init_value=NAN)[1] for _ in range(5)]
    assert all(_same_bytes(r, runs[0]) for r in runs) and np.all(np.isnan(runs[0][6:]))
    pre, w = _site_norm(6)
    want = _collapse_norm_f64(f64(s), f64(pre), f64(w))
    got = runs[0][:6]
    assert np.mean(got == want) > 0.98 and np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
    other = np.array(hc.COLLAPSE_NORM(**hc.collapse_norm_args(s, pre, w, NORM_EPS))[0].astype(mx.float32))
    assert np.mean(other == got) > 0.98
    mm = s.reshape(6, HC * D).astype(mx.float32) @ fn.T
    solo = _site_kernel(s[2:3], fn, base, scale, mm=mm[2:3], pre=pre[2:3])
    batched = _site_kernel(s, fn, base, scale, mm=mm)
    assert _same_bytes(solo[0], batched[0][2:3]) and _same_bytes(solo[1], batched[1][2:3])
    raw = np.array(s.astype(mx.float32))
    raw[4, 2, 77] = np.inf
    got = _site_kernel(mx.array(raw).astype(mx.bfloat16), fn, base, scale)[1]
    with np.errstate(all="ignore"):
        want = _collapse_norm_f64(raw.astype(np.float64), f64(pre), f64(w))
    # inf in one element: the row's statistic is inf, so that element is inf · 0 = NaN and the rest 0
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 1 and np.isnan(got[4, 77])


def test_site_is_the_block_s_collapse_norm_and_mixes():
    """The op the Block calls (kernels.hyper_connections.site, [B, S, HC, D]) against the plain-MLX
    references on this GPU."""
    s, fn, base, scale = _inputs(8, T=6)
    s4 = s.reshape(2, 3, HC, D)
    pre, w = _site_norm(6)
    pre = pre.reshape(2, 3, HC)
    prev = mx.concatenate([pre, mx.ones((2, 3, (1 + HC) * HC))], axis=-1)  # a previous site's mixes
    x, m = hc.site(s4, prev, w, NORM_EPS, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    assert m.shape == (2, 3, (2 + HC) * HC)
    ref = hc.mixes_reference(s4, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    for g, r in zip(hc.split(m, HC), ref):
        np.testing.assert_allclose(np.array(g), np.array(r), rtol=0, atol=1e-5)
    xr = hc.collapse_norm_reference(s4, pre, w, NORM_EPS)
    assert x.shape == (2, 3, D) and np.mean(f64(x) == f64(xr)) > 0.98


def test_rms_norm_is_one_stream_collapse_norm():
    """kernels.hyper_connections.rms_norm on the GPU (hc_collapse_norm, one stream of weight 1):
    the RMSNorm against float64 with one bf16 rounding, a row's bytes the same solo and batched, and
    within one bf16 rounding of the CPU reference's mx.fast.rms_norm."""
    rng = np.random.default_rng(9)
    x = mx.array(rng.standard_normal((6, D)).astype(np.float32) * 3).astype(mx.bfloat16)
    w = mx.array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    got = np.array(hc.rms_norm(x, w, NORM_EPS).astype(mx.float32), np.float64)
    xf = f64(x)
    want = rb(xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + NORM_EPS) * f64(w))
    assert np.mean(got == want) > 0.98 and np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
    solo = np.array(hc.rms_norm(x[3:4], w, NORM_EPS).astype(mx.float32))
    assert np.array_equal(solo[0], got[3].astype(np.float32))
    fast = np.array(mx.fast.rms_norm(x.astype(mx.float32), w, NORM_EPS).astype(mx.bfloat16).astype(mx.float32))
    assert np.abs(fast - got).max() <= 2**-7 * np.abs(want).max()
