"""The mHC kernel bodies (mlx_dsv41/metal_ext/hc_*.metal) on the CPU simulator (tests/exl3_sim), with the launch
kwargs mlx_dsv41.kernels.hyper_connections hands to MLX: hc_mix against the float64 transcription
of docs/model.md#mhc (every Sinkhorn iteration counts: peaked inputs, where 19 or 21 iterations move
the mix by ~2e-3), hc_collapse_norm and hc_expand against float64 with the reference's roundings.
Outputs start poisoned; guard rows past the shape must stay untouched. tests/gpu/test_hc_kernels.py
repeats this on the device with the kernel contract (nonfinite inputs, repeats, guards)."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest
from attention_stack import rb
from test_hyper_connections import mixes_f64

from mlx_dsv41.kernels import hyper_connections as hc

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

T, HC, D, ITERS, HC_EPS, NORM_EPS = 3, 4, 160, 20, 1e-6, 1e-20
GUARD = 2


def _site(rng, peaked=4.0):
    mix = (2 + HC) * HC
    fn = rng.standard_normal((mix, HC * D)) * (peaked / np.sqrt(HC * D))
    return (
        fn.astype(np.float32),
        rng.standard_normal(mix).astype(np.float32),
        rng.uniform(0.5, 1.5, 3).astype(np.float32),
    )


def _streams(rng, dtype=mx.bfloat16):
    return mx.array(rng.standard_normal((T, HC, D)).astype(np.float32)).astype(dtype)


def f64(a):
    return np.array(mx.array(a).astype(mx.float32), np.float64)


@pytest.fixture(scope="module")
def runs():
    rng = np.random.default_rng(0)
    s = _streams(rng)
    fn, base, scale = _site(rng)
    z = s.reshape(T, HC * D)
    mm = z.astype(mx.float32) @ mx.array(fn).T
    pre = mx.array(rng.uniform(0.1, 1.0, (T, HC)).astype(np.float32))
    weight = mx.array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32)).astype(mx.bfloat16)
    y = mx.array(rng.standard_normal((T, D)).astype(np.float32)).astype(mx.bfloat16)
    post = mx.array(rng.uniform(0, 2, (T, HC)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (T, HC * HC)).astype(np.float32))  # not symmetric
    specs = [
        (
            hc.MIX,
            hc.mix_args(
                mm, s, mx.array(base), mx.array(scale), pre, weight, ITERS, HC_EPS, NORM_EPS, NORM_EPS, guard=GUARD
            ),
        ),
        (hc.COLLAPSE_NORM, hc.collapse_norm_args(s, pre, weight, NORM_EPS, guard=GUARD)),
        (hc.EXPAND, hc.expand_args(y, s, mx.concatenate([pre, post, comb], axis=-1), guard=GUARD)),
    ]
    program = exl3_sim.build(specs, mma=True)
    data = dict(s=s, fn=fn, base=base, scale=scale, pre=pre, weight=weight, y=y, post=post, comb=comb)
    mix, site_input = program.run(0)
    return data, [mix, *(program.run(i)[0] for i in range(1, len(specs))), site_input]


def _guards_poisoned(out, rows):
    raw = out[rows:].view(np.uint32 if out.dtype == np.float32 else np.uint16)
    return np.all(raw == (0xFFFFFFFF if out.dtype == np.float32 else 0xFFFF))


def test_mix_matches_float64_with_every_sinkhorn_iteration(runs):
    d, (mix, _, _, _) = runs
    assert _guards_poisoned(mix, T)
    pre, post, comb = mixes_f64(f64(d["s"]), d["fn"], d["base"], d["scale"])
    got = mix[:T].astype(np.float64)
    np.testing.assert_allclose(got[:, :HC], pre, rtol=0, atol=2e-6)
    np.testing.assert_allclose(got[:, HC : 2 * HC], post, rtol=0, atol=4e-6)
    np.testing.assert_allclose(got[:, 2 * HC :].reshape(T, HC, HC), comb, rtol=0, atol=5e-6)
    wrong = mixes_f64(f64(d["s"]), d["fn"], d["base"], d["scale"], iters=ITERS - 1)[2]
    assert np.abs(wrong - comb).max() > 100 * 5e-6


@pytest.mark.parametrize("kernel", ["hc_collapse_norm", "hc_mix"])
def test_collapse_norm_matches_float64(runs, kernel):
    """hc_collapse_norm, and hc_mix's site input (the same collapse and norm, summed in its own order)."""
    d, (_, collapse_norm_out, _, site_input) = runs
    out = collapse_norm_out if kernel == "hc_collapse_norm" else site_input
    assert _guards_poisoned(out, T)
    x = rb(np.einsum("ti,tid->td", f64(d["pre"]), f64(d["s"])))
    want = rb(x / np.sqrt(np.mean(x * x, -1, keepdims=True) + NORM_EPS) * f64(d["weight"]))
    got = out[:T].astype(np.float64)
    assert np.mean(got == want) > 0.98 and np.abs(got - want).max() <= 2**-7 * np.abs(want).max()


def test_expand_matches_float64_and_mixes_with_comb_transposed(runs):
    d, (_, _, out, _) = runs
    assert _guards_poisoned(out, T)
    c = f64(d["comb"]).reshape(T, HC, HC)
    want = rb(f64(d["post"])[..., None] * f64(d["y"])[:, None, :] + np.einsum("tij,tid->tjd", c, f64(d["s"])))
    got = out[:T].astype(np.float64)
    assert np.mean(got == want) > 0.99
    wrong = np.einsum("tji,tid->tjd", c, f64(d["s"]))
    assert np.abs(got - want).max() < 0.1 * np.abs(wrong - np.einsum("tij,tid->tjd", c, f64(d["s"]))).max()


def test_the_ops_check_their_shapes():
    s = mx.zeros((2, 3, 8))
    with pytest.raises(ValueError, match="power-of-two hc_mult"):
        hc.mixes(s, mx.zeros((15, 24)), mx.zeros((15,)), mx.ones((3,)), iters=2, hc_eps=1e-6, norm_eps=1e-20)
    with pytest.raises(ValueError, match="fn \\[24, 32\\]"):
        hc.mixes(
            mx.zeros((2, 4, 8)),
            mx.zeros((24, 31)),
            mx.zeros((24,)),
            mx.ones((3,)),
            iters=2,
            hc_eps=1e-6,
            norm_eps=1e-20,
        )
    with pytest.raises(ValueError, match="pre"):
        hc.collapse_norm(mx.zeros((2, 4, 8)), mx.zeros((2, 3)), mx.ones((8,)), 1e-20)


def test_one_stream_collapse_norm_is_the_models_rms_norm():
    """hc_collapse_norm over one stream of weight 1 (kernels.hyper_connections.rms_norm on a GPU):
    the collapse is exact, so it is the RMSNorm of docs/numerics.md#dtypes (fp32 math, one bf16
    rounding), with an fp32-held weight."""
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((T, 1, D)).astype(np.float32) * 3).astype(mx.bfloat16)
    weight = mx.array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    one = mx.ones((T, 1), mx.float32)
    program = exl3_sim.build(
        [(hc.COLLAPSE_NORM, hc.collapse_norm_args(x, one, weight, NORM_EPS, guard=GUARD))], mma=True
    )
    out = program.run(0)[0]
    assert _guards_poisoned(out, T)
    xf = f64(x)[:, 0]
    want = rb(xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + NORM_EPS) * f64(weight))
    got = out[:T].astype(np.float64)
    assert np.mean(got == want) > 0.98 and np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
    cpu = np.array(hc.rms_norm(x[:, 0], weight, NORM_EPS).astype(mx.float32))  # the CPU reference
    assert np.mean(cpu == got) > 0.98
