"""Launches that finish themselves (docs/design.md#grid-finish) on the device: hc_site gives the bytes
of fp32_gemv then hc_mix at a site of HC 4, D 4096 (fn 24 x 16384), hc_expand_site those of
hc_expand then hc_site there and at Flash's D 5120, moe_gate those of fp32_gemv then moe_route at Flash's router (384
experts, D 4096, top-6), for 1, 3 and 8 tokens, with the kernel contract: outputs poisoned (NaN)
before launch, guard rows untouched; five repeats byte-identical (each launch leaves its counters at
0: a counter left over would finish the next launch early or never); nonfinite inputs where float64
puts them (through the two-launch bytes and, for the site, tests/gpu/test_hc_kernels.py's float64
checks of hc_mix); the launch limit declared; and the ops (hc.site, moe_route.gate) take the one
launch on CUDA."""

import mlx.core as mx
import numpy as np
import pytest
from test_hyper_connections import mixes_f64

from mlx_dsv41.kernels import fp32_linear as fl
from mlx_dsv41.kernels import grid_finish
from mlx_dsv41.kernels import hyper_connections as hc
from mlx_dsv41.kernels import moe_route as mr

pytestmark = pytest.mark.gpu
HC, D, ITERS, HC_EPS, NORM_EPS, EPS = 4, 4096, 20, 1e-6, 1e-20, 1e-6
FLASH_D = 5120  # Flash's hidden size: hc_mix's summing threads take five dims each
NAN = float("nan")


def _np(a):
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def _bytes(arrays):
    return [np.ascontiguousarray(_np(a)).tobytes() for a in arrays]


def _site_inputs(T, seed, nonfinite=False, D=D):
    rng = np.random.default_rng(seed)
    mix = (2 + HC) * HC
    raw = rng.standard_normal((T, HC, D)).astype(np.float32)
    if nonfinite:
        raw[0, 1, 5], raw[T - 1, 3, 900] = np.nan, np.inf
    streams = mx.array(raw).astype(mx.bfloat16)
    fn = mx.array((rng.standard_normal((mix, HC * D)) * 4 / np.sqrt(HC * D)).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 1.5, 3).astype(np.float32))
    prev = mx.array(rng.uniform(0.2, 1.0, (T, mix)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(mx.bfloat16)
    return streams, fn, base, scale, prev, weight


def _two_site_launches(streams, fn, base, scale, prev, weight, guard):
    T = streams.shape[0]
    (mm,) = fl.GEMV(**fl.gemv_args(streams.reshape(T, HC * D), fn))
    out, x = hc.MIX(**hc.mix_args(mm, streams, base, scale, prev, weight, ITERS, HC_EPS, NORM_EPS, EPS, NAN, guard))
    return mm, out, x


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_a_site_in_one_launch_gives_the_two_launch_bytes_and_keeps_the_contract(T, nonfinite):
    inputs = _site_inputs(T, T, nonfinite)
    counters = grid_finish.split_counters(1)
    runs = []
    for _ in range(5):
        outs = hc.SITE(**hc.site_args(*inputs, counters, ITERS, HC_EPS, NORM_EPS, EPS, NAN, guard=2))
        mx.eval(outs)
        runs.append(_bytes(outs))
    assert all(r == runs[0] for r in runs)
    mm, out, x = (
        _np(a) for a in hc.SITE(**hc.site_args(*inputs, counters, ITERS, HC_EPS, NORM_EPS, EPS, NAN, guard=2))
    )
    for a in (mm, out, x):
        assert np.all(np.isnan(a[T:]))  # guard rows as poisoned
    mm2, out2, x2 = (_np(a) for a in _two_site_launches(*inputs, guard=2))
    assert mm[:T].tobytes() == mm2.tobytes() and out.tobytes() == out2.tobytes() and x.tobytes() == x2.tobytes()
    if not nonfinite:
        assert np.isfinite(out[:T]).all() and np.isfinite(x[:T]).all()
        streams, fn, base, scale = inputs[:4]
        want = mixes_f64(
            _np(streams).astype(np.float64),
            _np(fn).astype(np.float64),
            _np(base).astype(np.float64),
            _np(scale).astype(np.float64),
        )
        np.testing.assert_allclose(out[:T, :HC], want[0], rtol=0, atol=2e-6)
        np.testing.assert_allclose(out[:T, 2 * HC :].reshape(T, HC, HC), want[2], rtol=0, atol=1e-5)
    else:  # the NaN and the inf reach the tokens that hold them, and only those
        assert np.isnan(out[0]).all() and np.isnan(out[T - 1]).all()
        assert T < 3 or np.isfinite(out[1 : T - 1]).all()


@pytest.mark.parametrize("T,dim", [(1, D), (3, D), (8, D), (1, FLASH_D), (8, FLASH_D)])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_an_expand_and_the_next_site_in_one_launch_give_the_three_launch_bytes(T, dim, nonfinite):
    """hc_expand_site (docs/design.md#expand-site) == hc_expand, then hc_site (whose bytes are the two
    launches': the test above), at D 4,096 and Flash's 5,120; outputs poisoned, guard rows untouched,
    five repeats byte-identical, a NaN / inf of y or of the old streams in the tokens that hold them
    only."""
    residual, fn, base, scale, m, weight = _site_inputs(T, 100 + T, D=dim)
    rng = np.random.default_rng(200 + T)
    raw = rng.standard_normal((T, dim)).astype(np.float32)
    if nonfinite:
        raw[0, 7] = np.nan
        bad = np.array(_np(residual))
        bad[T - 1, 2, 4000] = np.inf
        residual = mx.array(bad).astype(mx.bfloat16)
    y = mx.array(raw).astype(mx.bfloat16)
    counters = grid_finish.split_counters(1)
    rest = (fn, base, scale, m, weight, counters, ITERS, HC_EPS, NORM_EPS, EPS)  # site_args' after the streams
    call = hc.expand_site_args(y, residual, m, *rest, init_value=NAN, guard=2)
    runs = [_bytes(hc.EXPAND_SITE(**call)) for _ in range(5)]
    assert all(r == runs[0] for r in runs)
    mm, out, x, streams, _ = (_np(a) for a in hc.EXPAND_SITE(**call))  # then the scratch
    for a in (mm, out, x, streams):
        assert np.all(np.isnan(a[T:]))  # guard rows as poisoned
    (streams2,) = hc.EXPAND(**hc.expand_args(y, residual, m))
    assert streams[:T].tobytes() == _np(streams2).tobytes()
    mm2, out2, x2 = (_np(a) for a in hc.SITE(**hc.site_args(streams2, *rest, init_value=NAN, guard=2)))
    assert mm.tobytes() == mm2.tobytes() and out.tobytes() == out2.tobytes() and x.tobytes() == x2.tobytes()
    if nonfinite:
        assert np.isnan(out[0]).all() and np.isnan(out[T - 1]).all()
        assert T < 3 or np.isfinite(out[1 : T - 1]).all()
    else:
        assert np.isfinite(out[:T]).all() and np.isfinite(x[:T]).all() and np.isfinite(streams[:T]).all()


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_the_router_in_one_launch_gives_the_two_launch_bytes_and_keeps_the_contract(T, nonfinite):
    rng = np.random.default_rng(40 + T)
    raw = rng.standard_normal((T, D)).astype(np.float32)
    if nonfinite:
        raw[0, 3] = np.nan
    x = mx.array(raw).astype(mx.bfloat16)
    w = mx.array((rng.standard_normal((384, D)) / 64).astype(np.float32)).astype(mx.bfloat16)
    bias = mx.array((rng.standard_normal(384) * 0.1).astype(np.float32))
    counters = grid_finish.split_counters(1)
    call = mr.gate_args(x, w, bias, counters, 6, 1.0, 2.5, init_value=NAN, guard=2)
    runs = [_bytes(mr.GATE(**call)) for _ in range(5)]
    assert all(r == runs[0] for r in runs)
    logits, idx, wts = (_np(a) for a in mr.GATE(**call))
    assert np.all(np.isnan(logits[T:])) and np.all(np.isnan(wts[T:]))
    (logits2,) = fl.GEMV(**fl.gemv_args(x, w))
    idx2, wts2 = mr.ROUTE(**mr.route_args(logits2, bias, 6, 1.0, 2.5, init_value=NAN, guard=2))
    assert logits[:T].tobytes() == _np(logits2).tobytes()
    assert idx[:T].tobytes() == _np(idx2)[:T].tobytes() and wts.tobytes() == _np(wts2).tobytes()
    want = _np(x).astype(np.float64) @ _np(w).astype(np.float64).T  # from the bf16 inputs the kernel reads
    if nonfinite:
        assert np.isnan(logits[0]).all() and np.isnan(wts[0]).all()
        rows = slice(1, T)
    else:
        rows = slice(0, T)
    np.testing.assert_allclose(logits[rows], want[rows], rtol=0, atol=1e-4)


def test_launch_limits_are_declared_and_the_ops_take_one_launch():
    assert hc.SITE.max_threads == mr.GATE.max_threads == fl.THREADS == 256
    with pytest.raises(ValueError, match="over its declared limit"):
        hc.SITE(inputs=[], output_shapes=[], output_dtypes=[], grid=(512, 1, 1), threadgroup=(512, 1, 1))
    assert grid_finish.available(hc.backend())
    streams, fn, base, scale, prev, weight = _site_inputs(1, 0)
    counters = grid_finish.split_counters(1)
    x, m = hc.site(
        streams, prev, weight, EPS, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, counters=counters
    )
    _, out, xs = hc.SITE(**hc.site_args(streams, fn, base, scale, prev, weight, counters, ITERS, HC_EPS, NORM_EPS, EPS))
    assert _bytes([x, m]) == _bytes([xs, out])
    assert hc.EXPAND_SITE.max_threads == 256
    y = streams[:, 0]
    kwargs = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, counters=counters)
    new, x, m = hc.expand_site(y, streams, prev, prev, weight, EPS, fn, base, scale, **kwargs)
    call = hc.expand_site_args(y, streams, prev, fn, base, scale, prev, weight, counters, ITERS, HC_EPS, NORM_EPS, EPS)
    _, out, xs, streams1, _ = hc.EXPAND_SITE(**call)
    assert _bytes([new, x, m]) == _bytes([streams1, xs, out])
