"""mHC mixes, Sinkhorn, collapse and expand against float64 references written from
docs/model.md#mhc."""

import mlx.core as mx
import numpy as np
from attention_stack import rb

from mlx_dsv41.model.hyper_connections import collapse, expand, hc_mixes, initial_mixes, initial_pre

rng = np.random.default_rng(11)
HC, D, ITERS, HC_EPS, NORM_EPS = 4, 48, 20, 1e-6, 1e-20


def _site(scale=1.0):
    mix = (2 + HC) * HC
    fn = rng.standard_normal((mix, HC * D)).astype(np.float32) * (scale / np.sqrt(HC * D))
    base = rng.standard_normal(mix).astype(np.float32)
    sc = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    return fn, base, sc


def mixes_f64(streams, fn, base, sc, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS):
    """docs/model.md#mhc line by line, float64: streams [..., HC, D] -> pre, post, comb (test_model
    uses it)."""
    *lead, hc, dim = streams.shape
    z = streams.reshape(*lead, hc * dim).astype(np.float64)
    m = (z @ fn.astype(np.float64).T) / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + norm_eps)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    pre = sig(m[..., :hc] * sc[0] + base[:hc]) + hc_eps
    post = 2 * sig(m[..., hc : 2 * hc] * sc[1] + base[hc : 2 * hc])
    c = (m[..., 2 * hc :] * sc[2] + base[2 * hc :]).reshape(*lead, hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return pre, post, c


def _streams(B=2, S=5):
    return rb(rng.standard_normal((B, S, HC, D)))


def test_mixes_match_float64():
    streams = _streams()
    fn, base, sc = _site()
    got = hc_mixes(
        mx.array(streams.astype(np.float32)).astype(mx.bfloat16),
        mx.array(fn),
        mx.array(base),
        mx.array(sc),
        iters=ITERS,
        hc_eps=HC_EPS,
        norm_eps=NORM_EPS,
    )
    for g, r, name in zip(got, mixes_f64(streams, fn, base, sc), ("pre", "post", "comb")):
        assert g.dtype == mx.float32, name
        np.testing.assert_allclose(np.array(g), r, rtol=2e-5, atol=2e-6, err_msg=name)


def test_sinkhorn_is_nearly_doubly_stochastic_and_matches_float64_on_peaked_inputs():
    fn, base, sc = _site(scale=4.0)  # peaked softmax rows: Sinkhorn has real work to do
    s64 = _streams()
    streams = mx.array(s64.astype(np.float32))
    _, _, comb = hc_mixes(
        streams, mx.array(fn), mx.array(base), mx.array(sc), iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS
    )
    comb = np.array(comb)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)  # the last step normalises columns
    rows = np.abs(comb.sum(-1) - 1).max()
    # One iteration leaves the rows far from 1: the test would notice a missing loop.
    _, _, one = hc_mixes(streams, mx.array(fn), mx.array(base), mx.array(sc), iters=1, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    assert rows < 0.1 * np.abs(np.array(one).sum(-1) - 1).max()
    # Every one of the 20 iterations counts: 19 or 21 move peaked mixes by ~2e-3, 400x the
    # fp32 error against the float64 transcription (measured 5e-7).
    want = mixes_f64(s64, fn, base, sc)[2]
    np.testing.assert_allclose(comb, want, rtol=0, atol=5e-6)
    for iters in (ITERS - 1, ITERS + 1):
        assert np.abs(mixes_f64(s64, fn, base, sc, iters=iters)[2] - want).max() > 100 * 5e-6


def test_collapse_and_expand_match_float64_then_bf16():
    streams = _streams()
    pre = rng.uniform(0.1, 1.0, (2, 5, HC))
    post = rng.uniform(0.0, 2.0, (2, 5, HC))
    comb = rng.uniform(0.0, 1.0, (2, 5, HC, HC))  # not symmetric: catches a transposed mix
    y = rb(rng.standard_normal((2, 5, D)))
    s_mx = mx.array(streams.astype(np.float32)).astype(mx.bfloat16)

    got = collapse(s_mx, mx.array(pre.astype(np.float32)))
    assert got.dtype == mx.bfloat16
    ref = np.einsum("bsi,bsid->bsd", pre.astype(np.float32).astype(np.float64), streams)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), ref, rtol=2**-8, atol=1e-6)

    mixes = np.concatenate([pre, post, comb.reshape(2, 5, HC * HC)], axis=-1)  # pre | post | comb
    got = expand(mx.array(y.astype(np.float32)).astype(mx.bfloat16), s_mx, mx.array(mixes.astype(np.float32)))
    assert got.dtype == mx.bfloat16
    p32, c32 = post.astype(np.float32).astype(np.float64), comb.astype(np.float32).astype(np.float64)
    # new_j = post_j·y + Σ_i C[i, j]·old_i: the sum runs over the FIRST index of C.
    ref = p32[..., :, None] * y[:, :, None, :] + np.einsum("bsij,bsid->bsjd", c32, streams)
    wrong = p32[..., :, None] * y[:, :, None, :] + np.einsum("bsji,bsid->bsjd", c32, streams)
    g = np.array(got.astype(mx.float32))
    np.testing.assert_allclose(g, ref, rtol=2**-8, atol=1e-6)
    assert np.abs(g - wrong).max() > 0.1
    # bf16 streams: the result is the float64 value rounded once (up to fp32 summation order).
    assert np.mean(g == rb(ref)) > 0.99


def test_layer0_one_hot_pre_returns_the_embedding():
    h = mx.array(rng.standard_normal((2, 3, D)).astype(np.float32)).astype(mx.bfloat16)
    streams = mx.broadcast_to(h[:, :, None, :], (2, 3, HC, D))
    pre = initial_pre(2, 3, HC)
    assert np.array_equal(np.array(pre), np.broadcast_to(np.eye(HC)[0], (2, 3, HC)))
    assert mx.array_equal(collapse(streams, pre), h).item()
    mixes = initial_mixes(2, 3, HC)  # what layer 0 reads: the one-hot pre, then zeros
    assert mixes.shape == (2, 3, (2 + HC) * HC) and np.array_equal(np.array(mixes)[..., :HC], np.array(pre))
    assert not np.array(mixes)[..., HC:].any() and mx.array_equal(collapse(streams, mixes), h).item()
