"""Launches that finish themselves (kernels/grid_finish.py, docs/design.md#grid-finish) on the CPU
simulator: hc_site gives the bytes of fp32_gemv then hc_mix (an mHC site), moe_gate those of
fp32_gemv then moe_route (the router), for one token and several, bf16 and fp32 inputs, with the
outputs poisoned and guard rows past the shape untouched. The ops take the one launch only where
the backend can finish a launch (CUDA), given counters. tests/gpu/test_grid_finish_gpu.py repeats
this on the device with the kernel contract."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import fp32_linear as fl
from mlx_dsv41.kernels import grid_finish
from mlx_dsv41.kernels import hyper_connections as hc
from mlx_dsv41.kernels import moe_route as mr

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

HC, D, ITERS, HC_EPS, NORM_EPS, EPS = 4, 160, 20, 1e-6, 1e-20, 1e-6
GUARD = 2
SITE_KWARGS = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)


def _site(T, dtype, seed):
    rng = np.random.default_rng(seed)
    mix = (2 + HC) * HC
    streams = mx.array(rng.standard_normal((T, HC, D)).astype(np.float32)).astype(dtype)
    fn = mx.array((rng.standard_normal((mix, HC * D)) * 4 / np.sqrt(HC * D)).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 1.5, 3).astype(np.float32))
    prev = mx.array(rng.uniform(0.2, 1.0, (T, mix)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(dtype)
    return streams, fn, base, scale, prev, weight


SITES = [(1, mx.bfloat16), (3, mx.bfloat16), (2, mx.float32)]


@pytest.mark.parametrize("case", range(len(SITES)))
def test_a_site_in_one_launch_gives_the_two_launch_bytes(case):
    T, dtype = SITES[case]
    streams, fn, base, scale, prev, weight = _site(T, dtype, case)
    counters = grid_finish.split_counters(1)
    one = (
        hc.SITE,
        hc.site_args(streams, fn, base, scale, prev, weight, counters, ITERS, HC_EPS, NORM_EPS, EPS, guard=GUARD),
    )
    gemv = (fl.GEMV, fl.gemv_args(streams.reshape(T, HC * D), fn))
    program = exl3_sim.build([one, gemv], mma=True)
    mm, out, x = program.run(0)
    (mm2,) = program.run(1)
    assert mm.tobytes()[: mm2.nbytes] == mm2.tobytes()  # fp32_gemv's outputs, the same bytes
    mix = (
        hc.MIX,
        hc.mix_args(mx.array(mm2), streams, base, scale, prev, weight, ITERS, HC_EPS, NORM_EPS, EPS, guard=GUARD),
    )
    out2, x2 = exl3_sim.build([mix], mma=True).run(0)
    assert out.tobytes() == out2.tobytes() and x.tobytes() == x2.tobytes()  # the guard rows too: both untouched
    for a in (mm, out, x):
        assert np.all(a[T:].view(np.uint8) == 0xFF)
        assert np.isfinite(a[:T].astype(np.float32)).all()


# (tokens, dtype, D): D = 4,160 is past one block of hc_mix_token's dims (4 · 1,024): the output
# reloads the second block's streams instead of keeping them in registers; 5,120 is Flash's (each
# summing thread's chain five dims long); 5,632 is past one pass of hc_expand_site_token's x stores
# (24 values a thread on 224 threads).
EXPAND_SITES = [
    (1, mx.bfloat16, D),
    (3, mx.bfloat16, D),
    (2, mx.float32, D),
    (1, mx.bfloat16, 4160),
    (2, mx.bfloat16, 5120),
    (1, mx.bfloat16, 5632),
]


@pytest.mark.parametrize("case", range(len(EXPAND_SITES)))
def test_an_expand_and_the_next_site_in_one_launch_give_the_three_launch_bytes(case):
    """hc_expand_site == hc_expand, then hc_site (whose bytes are fp32_gemv's, then hc_mix's: the
    test above), for every output; guard rows untouched."""
    T, dtype, dim = EXPAND_SITES[case]
    rng = np.random.default_rng(20 + case)
    mix = (2 + HC) * HC
    residual = mx.array(rng.standard_normal((T, HC, dim)).astype(np.float32)).astype(dtype)
    y = mx.array(rng.standard_normal((T, dim)).astype(np.float32)).astype(dtype)
    m = mx.array(rng.uniform(0.1, 1.0, (T, mix)).astype(np.float32))  # the expanding site's mixes
    fn = mx.array((rng.standard_normal((mix, HC * dim)) * 4 / np.sqrt(HC * dim)).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 1.5, 3).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, dim).astype(np.float32)).astype(dtype)
    # the site's own arguments after its streams: fn, base, scale, pre (the expanding mixes), ...
    rest = (fn, base, scale, m, weight, grid_finish.split_counters(1), ITERS, HC_EPS, NORM_EPS, EPS)
    one = hc.expand_site_args(y, residual, m, *rest, guard=GUARD)
    mm, out, x, streams, _ = exl3_sim.build([(hc.EXPAND_SITE, one)], mma=True).run(0)  # then the scratch
    (streams2,) = exl3_sim.build([(hc.EXPAND, hc.expand_args(y, residual, m, guard=GUARD))], mma=True).run(0)
    assert streams.tobytes() == streams2.tobytes()
    site = hc.site_args(mx.array(streams2[:T]), *rest, guard=GUARD)
    mm2, out2, x2 = exl3_sim.build([(hc.SITE, site)], mma=True).run(0)
    for a, b in ((mm, mm2), (out, out2), (x, x2)):
        assert a.tobytes() == b.tobytes()
    for a in (mm, out, x, streams):
        assert np.all(a[T:].view(np.uint8) == 0xFF)
        assert np.isfinite(a[:T].astype(np.float32)).all()
    if dim > D:  # past one block, against the one-threadgroup-per-token hc_mix as well
        mix_call = hc.mix_args(
            mx.array(mm2[:T]), mx.array(streams2[:T]), base, scale, m, weight, ITERS, HC_EPS, NORM_EPS, EPS
        )
        out3, x3 = exl3_sim.build([(hc.MIX, mix_call)], mma=True).run(0)
        assert out3.tobytes() == out[:T].tobytes() and x3.tobytes() == x[:T].tobytes()


def test_an_expand_site_whose_part_would_not_fit_threadgroup_memory_is_two_launches():
    """hc_expand_site holds its part of the streams in threadgroup memory: 8 fp32 tokens at Flash's
    site (64 KB) do not fit, 8 bf16 ones (32 KB) do; the op then runs hc_expand and hc_site."""
    mix, dim = (2 + HC) * HC, 4096
    fn = mx.zeros((mix, HC * dim))
    rest = (fn, mx.zeros((mix,)), mx.ones((3,)), mx.ones((8, mix)), mx.ones((dim,)), grid_finish.split_counters(1))
    rest += (ITERS, HC_EPS, NORM_EPS, EPS)
    for dtype, fits in ((mx.bfloat16, True), (mx.float32, False)):
        residual, y = mx.zeros((8, HC, dim), dtype), mx.zeros((8, dim), dtype)
        call = hc.expand_site_args(y, residual, mx.ones((8, mix)), *rest)
        assert (call is not None) == fits
        if fits:
            assert dict(call["template"])["CAP"] == 256 and call["grid"] == (256 * 8 * 3, 1, 1)


GATES = [(1, 384, 6, 1.0, 1.5, mx.bfloat16), (3, 384, 6, 1.0, 2.5, mx.bfloat16), (2, 16, 2, 0.5, 1.0, mx.float32)]


@pytest.mark.parametrize("case", range(len(GATES)))
def test_the_router_in_one_launch_gives_the_two_launch_bytes(case):
    T, E, k, temp, scale, w_dtype = GATES[case]
    rng = np.random.default_rng(10 + case)
    x = mx.array(rng.standard_normal((T, 256)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array((rng.standard_normal((E, 256)) / 16).astype(np.float32)).astype(w_dtype)
    bias = mx.array((rng.standard_normal(E) * 0.1).astype(np.float32))
    counters = grid_finish.split_counters(1)
    program = exl3_sim.build(
        [(mr.GATE, mr.gate_args(x, w, bias, counters, k, temp, scale, guard=GUARD)), (fl.GEMV, fl.gemv_args(x, w))],
        mma=True,
    )
    logits, idx, wts = program.run(0)
    (logits2,) = program.run(1)
    assert logits[:T].tobytes() == logits2.tobytes()
    idx2, wts2 = exl3_sim.build(
        [(mr.ROUTE, mr.route_args(mx.array(logits2), bias, k, temp, scale, guard=GUARD))], mma=True
    ).run(0)
    assert idx.tobytes() == idx2.tobytes() and wts.tobytes() == wts2.tobytes()
    ref_idx, ref_wts = mr.route_reference(mx.array(logits2), bias, k, temp, scale)
    assert np.array_equal(idx[:T], np.array(ref_idx))
    np.testing.assert_allclose(wts[:T], np.array(ref_wts), rtol=2e-6)
    assert np.all(logits[T:].view(np.uint8) == 0xFF) and np.all(idx[T:] == -1)


def test_the_ops_take_one_launch_only_where_a_launch_can_finish_itself(monkeypatch):
    """On a backend without grid finish (Metal), or without counters, the two launches; on CUDA one
    (recorded, not run)."""
    import mlx_dsv41.kernels as kernels

    streams, fn, base, scale, prev, weight = _site(1, mx.bfloat16, 0)
    x, w, bias = mx.zeros((1, 256), mx.bfloat16), mx.zeros((16, 256), mx.bfloat16), mx.zeros((16,))
    seen = []

    def record(self, **call):
        seen.append(self.name)
        return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

    monkeypatch.setattr(kernels.Kernel, "__call__", record)
    for name in ("cuda", "metal"):
        for mod in (hc, mr, fl):
            monkeypatch.setattr(mod, "backend", lambda name=name: name)
        for counters in (grid_finish.split_counters(1), None):
            seen.clear()
            site, kwargs = (prev, weight, EPS, fn, base, scale), dict(SITE_KWARGS, counters=counters)
            hc.site(streams, *site, **kwargs)
            mr.gate(x, w, bias, 2, 1.0, 1.0, counters=counters)
            hc.expand_site(streams[:, 0], streams, prev, *site, **kwargs)  # y, residual, the expanding mixes
            one = name == "cuda" and counters is not None
            two = ["fp32_gemv", "hc_mix", "fp32_gemv", "moe_route", "hc_expand", "fp32_gemv", "hc_mix"]
            assert seen == (["hc_site", "moe_gate", "hc_expand_site"] if one else two)
    # on CUDA with counters, a site whose part of the streams would not fit threadgroup memory
    # (8 fp32 tokens at Flash's D) takes the expand's and the site's launches
    for mod in (hc, mr, fl):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    seen.clear()
    dim, mix = 4096, (2 + HC) * HC
    residual, m8 = mx.zeros((8, HC, dim)), mx.ones((8, mix))
    big = (m8, mx.ones((dim,)), EPS, mx.zeros((mix, HC * dim)), base, scale)
    hc.expand_site(residual[:, 0], residual, m8, *big, **dict(SITE_KWARGS, counters=grid_finish.split_counters(1)))
    assert seen == ["hc_expand", "hc_site"]
