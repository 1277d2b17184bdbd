"""EXL3Linear and EXL3Experts (CPU: the plain-MLX reference path) against float64 references built
from the independent numpy decoder; stored-tensor validation errors."""

from pathlib import Path

import exl3_numpy
import ml_dtypes
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from exl3_numpy import rel_err
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from mlx_dsv41.exl3 import (
    EXL3Experts,
    EXL3Linear,
    codebook_from_markers,
    experts_from_stored,
    linear_from_stored,
    linear_tensors,
)
from mlx_dsv41.exl3.synthetic import random_experts_tensors, random_linear_tensors

FIXTURE = Path(__file__).parent / "fixtures" / "exl3_ref_fixture.safetensors"
MUL1_MARKER, MCG_MARKER = -2082680531, -877912083


def linear_f64(tensors, x, in_features, out_features, prefix="p"):
    t = {k[len(prefix) + 1 :]: v for k, v in tensors.items()}
    codebook = codebook_from_markers(tensors, prefix)
    w = exl3_numpy.dequantize(t["trellis"], t["suh"], t["svh"], codebook)[:in_features, :out_features]
    y = np.asarray(x, np.float64) @ w
    return y + t["bias"][:out_features].astype(np.float64) if "bias" in t else y


@pytest.mark.parametrize("tag", ["K3_mul1_fb", "K3_mul1_cal"])
def test_linear_matches_exllamav3_fixture(tag):
    d = load_file(str(FIXTURE))
    lin = EXL3Linear.from_stored(d, tag)
    x, y_ref = d[f"{tag}.x"], d[f"{tag}.y_exllamav3"].astype(np.float64)
    y = np.array(lin(mx.array(x)))
    assert y.dtype == np.float16 and y.shape == (4, 512)
    w = exl3_numpy.dequantize(d[f"{tag}.trellis"], d[f"{tag}.suh"], d[f"{tag}.svh"], "mul1")
    y64 = x.astype(np.float64) @ w
    # docs/exl3.md#fixture: exllamav3 is ~5e-4 from float64; the two fp16 paths agree to the same
    # order.
    assert rel_err(y, y64) < 8e-4
    assert rel_err(y, y_ref) < 8e-4
    assert rel_err(y_ref, y64) < 6e-4


@pytest.mark.parametrize(
    "in_f,out_f,bits,codebook,dtype,bias",
    [
        (256, 384, 3, "mul1", mx.bfloat16, False),
        (200, 300, 4, "mcg", mx.float16, True),  # both dims padded
        (128, 129, 2, "3inst", mx.float32, True),  # 127 padded outputs
        (300, 256, 2.5, "mul1", mx.bfloat16, False),  # half-integer K, padded input
        (256, 128, 8, "mul1", mx.float32, False),
    ],
)
def test_linear_vs_float64(in_f, out_f, bits, codebook, dtype, bias):
    tensors = random_linear_tensors(in_f, out_f, bits, codebook, seed=in_f + out_f, bias=bias, prefix="p")
    lin = EXL3Linear.from_stored(tensors, "p", in_f, out_f)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (2, 3, in_f)).astype(np.float32)
    x_mx = mx.array(x).astype(dtype)
    y = lin(x_mx)
    assert y.dtype == dtype and y.shape == (2, 3, out_f)
    y64 = linear_f64(tensors, np.array(x_mx.astype(mx.float32)), in_f, out_f)
    out_eps = {mx.float32: 0.0, mx.float16: 2**-12, mx.bfloat16: 2**-9}[dtype]
    # fp16 rounding of x·suh and of xh (docs/exl3.md#forward): ~3e-4 relative, plus the output
    # rounding.
    assert rel_err(np.array(y.astype(mx.float32)), y64) < 6e-4 + out_eps


def test_linear_matches_mlx_float32_dequantized():
    tensors = random_linear_tensors(256, 256, 3, seed=5, prefix="p")
    lin = EXL3Linear.from_stored(tensors, "p")
    x = mx.random.normal((4, 256), key=mx.random.key(0))
    from mlx_dsv41.exl3 import dequantize

    y_dense = x @ dequantize(lin.trellis, lin.suh, lin.svh, "mul1")
    assert rel_err(np.array(lin(x)), np.array(y_dense).astype(np.float64)) < 1.5e-3


def test_linear_parameters_and_markers():
    tensors = random_linear_tensors(256, 128, 3, "mcg", seed=2, bias=True, prefix="layers.0.attn.wq_a")
    lin = linear_from_stored(tensors, "layers.0.attn.wq_a", 256, 128)
    names = dict(tree_flatten(lin.parameters()))
    assert set(names) == {"trellis", "suh", "svh", "bias"}
    assert names["trellis"].dtype == mx.int16 and lin.codebook == "mcg" and lin.bits == 3
    assert isinstance(lin, nn.Module)
    with pytest.raises(ValueError, match=r"expects \[..., 256\]"):
        lin(mx.zeros((1, 255)))


def test_marker_errors():
    t = random_linear_tensors(128, 128, 2, "mul1", prefix="p")
    assert codebook_from_markers(t, "p") == "mul1"
    bad = dict(t, **{"p.mul1": np.array(0x83D6B12D, np.uint32).view(np.int32).reshape(())})
    with pytest.raises(ValueError, match="not the locked mul1 multiplier"):
        codebook_from_markers(bad, "p")
    both = dict(t, **{"p.mcg": np.array(MCG_MARKER, np.int32)})
    with pytest.raises(ValueError, match="both .mcg and .mul1"):
        linear_tensors(both, "p")
    wrong_dtype = dict(t, **{"p.mul1": np.array([1.0, 2.0], np.float32)})
    with pytest.raises(ValueError, match="0-dim int32"):
        codebook_from_markers(wrong_dtype, "p")
    no_marker = {k: v for k, v in t.items() if k != "p.mul1"}
    assert codebook_from_markers(no_marker, "p") == "3inst"
    mcg = dict(no_marker, **{"p.mcg": np.array(MCG_MARKER, np.int32)})
    assert linear_tensors(mcg, "p")["codebook"] == "mcg"


def test_shape_errors():
    t = random_linear_tensors(256, 256, 3, prefix="p")
    with pytest.raises(ValueError, match="last dim 36"):
        EXL3Linear.from_stored(dict(t, **{"p.trellis": np.zeros((16, 16, 36), np.int16)}), "p")
    with pytest.raises(ValueError, match="suh/svh"):
        EXL3Linear.from_stored(dict(t, **{"p.suh": np.zeros(128, np.float16)}), "p")
    with pytest.raises(ValueError, match="multiples of 128"):
        EXL3Linear.from_stored(
            dict(t, **{"p.trellis": np.zeros((4, 16, 48), np.int16), "p.suh": np.zeros(64, np.float16)}), "p"
        )
    with pytest.raises(ValueError, match="do not pad"):
        EXL3Linear.from_stored(t, "p", in_features=100)
    with pytest.raises(ValueError, match="int16"):
        EXL3Linear.from_stored(dict(t, **{"p.trellis": t["p.trellis"].astype(np.int32)}), "p")
    half_mcg = random_linear_tensors(128, 128, 2.5, "mul1", prefix="q")
    half_mcg = {
        ("q.mcg" if k == "q.mul1" else k): (np.array(MCG_MARKER, np.int32) if k == "q.mul1" else v)
        for k, v in half_mcg.items()
    }
    with pytest.raises(ValueError, match="half-integer"):
        EXL3Linear.from_stored(half_mcg, "q")
    with pytest.raises(KeyError, match="no .svh"):
        EXL3Linear.from_stored({k: v for k, v in t.items() if k != "p.svh"}, "p")


def test_legacy_sign_bitfields():
    # docs/exl3.md#stored-tensors: signs [+,-,-,+,+,+,+,+,-,+,+,+,+,+,+,-] pack to 0x8106.
    t = random_linear_tensors(128, 128, 3, prefix="p")
    signs = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, 1, 1, 1, 1, 1, 1, -1], np.float16)
    word = np.array([0x8106], np.uint16).view(np.int16)
    legacy = {k: v for k, v in t.items() if k not in ("p.suh", "p.svh")}
    legacy["p.su"] = np.tile(word, 8)
    legacy["p.sv"] = np.tile(word, 8)
    got = linear_tensors(legacy, "p")
    assert np.array_equal(np.array(got["suh"]), np.tile(signs, 8))
    assert np.array_equal(np.array(got["svh"]), np.tile(signs, 8))


# ------------------------------------------------------------------------------------- experts


def _bf16(v):
    return v.astype(ml_dtypes.bfloat16).astype(np.float64)


def experts_f64(tensors, prefix, x, indices, weights, hidden, inter, limit, lo, hi):
    """Per-slot outputs in float64 from the numpy decoder; g, u, h and y are rounded to bf16 where
    the reference's bf16 linears round them (the experts contract, docs/model.md#moe)."""
    T, k = indices.shape
    out = np.zeros((T, k, hidden))
    cache = {}

    def w(e, proj, d_in, d_out):
        if (e, proj) not in cache:
            p = f"{prefix}.{e}.{proj}"
            w = exl3_numpy.dequantize(
                tensors[f"{p}.trellis"], tensors[f"{p}.suh"], tensors[f"{p}.svh"], codebook_from_markers(tensors, p)
            )
            cache[e, proj] = w[:d_in, :d_out]
        return cache[e, proj]

    for t in range(T):
        for s in range(k):
            e = int(indices[t, s])
            if not lo <= e < hi:
                continue
            g = _bf16(x[t] @ w(e, "w1", hidden, inter))
            u = _bf16(x[t] @ w(e, "w3", hidden, inter))
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            h = _bf16(weights[t, s] * (g / (1 + np.exp(-g)) * u))
            out[t, s] = _bf16(h @ w(e, "w2", inter, hidden))
    return out


@pytest.mark.parametrize(
    "hidden,inter,bits,codebook,expert_range",
    [
        (256, 384, {"w1": 3, "w3": 3, "w2": (2, 3, 4)}, "mul1", None),  # mixed K within w2
        (200, 300, {"w1": (3, 2), "w3": 4, "w2": 2.5}, "mul1", (2, 6)),  # padded dims, partial range
        (128, 256, 4, {"w1": "mcg", "w3": ("3inst", "mul1"), "w2": "mcg"}, (0, 3)),  # mixed codebooks
    ],
)
def test_experts_vs_float64(hidden, inter, bits, codebook, expert_range):
    n_experts, T, top_k = 6, 3, 4
    tensors = random_experts_tensors(n_experts, hidden, inter, bits, codebook, seed=hidden, prefix="ffn.experts")
    lo, hi = expert_range or (0, n_experts)
    ex = EXL3Experts.from_tensors(tensors, "ffn.experts", n_experts, expert_range, hidden, inter)
    rng = np.random.default_rng(hidden)
    x = rng.normal(0, 3, (T, hidden)).astype(np.float32)
    indices = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.5, (T, top_k)).astype(np.float32)
    x_mx = mx.array(x).astype(mx.bfloat16)
    y = ex(x_mx, mx.array(indices), mx.array(weights))
    assert y.dtype == mx.float32 and y.shape == (T, top_k, hidden)
    y = np.array(y)
    y64 = experts_f64(
        tensors,
        "ffn.experts",
        np.array(x_mx.astype(mx.float32)).astype(np.float64),
        indices,
        weights,
        hidden,
        inter,
        10.0,
        lo,
        hi,
    )
    outside = (indices < lo) | (indices >= hi)
    assert np.all(y[outside] == 0.0) and np.all(np.signbit(y[outside]) == 0)
    # fp16 xh roundings (~3e-4), and bf16 g, u, h, y on both sides: an upstream difference that
    # crosses a bf16 rounding boundary moves that element by one bf16 ulp (2^-8 relative).
    assert rel_err(y[~outside], y64[~outside]) < 2.5e-3 + 2**-8
    for t, s in zip(*np.nonzero(~outside)):  # every held slot, not just the total
        assert rel_err(y[t, s], y64[t, s]) < 5e-3 + 2**-8


def test_experts_clamp_is_active():
    # Large activations: g and u beyond the limit, so min/clamp decide the result.
    tensors = random_experts_tensors(2, 128, 128, 3, seed=9, prefix="e")
    ex = experts_from_stored(tensors, "e", 2, 128, 128, 10.0)
    x = np.full((1, 128), 60.0, np.float32) * np.random.default_rng(0).choice([-1, 1], 128)
    idx, wts = np.array([[0, 1]], np.int32), np.array([[1.0, 0.5]], np.float32)
    y = np.array(ex(mx.array(x), mx.array(idx), mx.array(wts)))
    y64 = experts_f64(tensors, "e", x.astype(np.float64), idx, wts, 128, 128, 10.0, 0, 2)
    g = x[0].astype(np.float64) @ exl3_numpy.dequantize(
        tensors["e.0.w1.trellis"], tensors["e.0.w1.suh"], tensors["e.0.w1.svh"], "mul1"
    )
    assert np.abs(g).max() > 20  # the limit matters in this test
    assert rel_err(y, y64) < 2.5e-3


def test_experts_structure_and_errors():
    tensors = random_experts_tensors(4, 128, 256, {"w1": 3, "w3": 3, "w2": (2, 3)}, seed=3, prefix="x")
    ex = EXL3Experts.from_tensors(tensors, "x", 4, (1, 3))
    assert [g.k2 for g in ex.w2.groups] == [4, 6] and ex.w2.groups[0].experts == (1,)
    assert ex.w2.groups[1].position.tolist() == [0, -1]  # local ids: expert 1 is K=3, expert 2 K=2
    names = {k for k, _ in tree_flatten(ex.parameters())}
    assert names == {
        "w1.suh",
        "w1.svh",
        "w1.groups.0.trellis",
        "w3.suh",
        "w3.svh",
        "w3.groups.0.trellis",
        "w2.suh",
        "w2.svh",
        "w2.groups.0.trellis",
        "w2.groups.1.trellis",
    }
    with pytest.raises(ValueError, match="expert_range"):
        EXL3Experts.from_tensors(tensors, "x", 4, (3, 3))
    with pytest.raises(KeyError, match="x.4.w1.trellis"):
        EXL3Experts.from_tensors(tensors, "x", 5)
    bad = dict(tensors, **{"x.2.w3.svh": np.zeros(512, np.float16), "x.2.w3.trellis": np.zeros((8, 32, 48), np.int16)})
    with pytest.raises(ValueError, match="different shapes"):
        EXL3Experts.from_tensors(bad, "x", 4)
    with pytest.raises(ValueError, match="has a bias"):
        EXL3Experts.from_tensors(dict(tensors, **{"x.0.w2.bias": np.zeros(128, np.float16)}), "x", 4)
    x = mx.zeros((2, 128))
    with pytest.raises(ValueError, match="indices must be int32"):
        ex(x, mx.zeros((2, 2), mx.int64), mx.zeros((2, 2)))
    with pytest.raises(ValueError, match="weights must be float32"):
        ex(x, mx.zeros((2, 2), mx.int32), mx.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"x must be float \[T, 128\]"):
        ex(mx.zeros((2, 64)), mx.zeros((2, 2), mx.int32), mx.zeros((2, 2)))


def test_expert_projection_from_stacked_equals_per_expert():
    from mlx_dsv41.exl3 import EXL3ExpertProjection

    tensors = random_experts_tensors(3, 128, 256, 3, seed=12, prefix="s")
    per_expert = EXL3Experts.from_tensors(tensors, "s", 3)

    def stacked(proj):
        return EXL3ExpertProjection.from_stacked(
            mx.stack([mx.array(tensors[f"s.{e}.{proj}.trellis"]) for e in range(3)]),
            mx.stack([mx.array(tensors[f"s.{e}.{proj}.suh"]) for e in range(3)]),
            mx.stack([mx.array(tensors[f"s.{e}.{proj}.svh"]) for e in range(3)]),
            "mul1",
        )

    ex = EXL3Experts(stacked("w1"), stacked("w3"), stacked("w2"), 3)
    x = mx.random.normal((2, 128), key=mx.random.key(1))
    idx, w = mx.array([[0, 2], [1, 0]], mx.int32), mx.array([[0.5, 0.5], [1.0, 0.25]])
    assert np.array_equal(np.array(ex(x, idx, w)), np.array(per_expert(x, idx, w)))
    with pytest.raises(ValueError, match="does not match"):
        EXL3Experts(stacked("w1"), stacked("w3"), stacked("w2"), 4, (0, 2))


def test_empty_inputs():
    lin = EXL3Linear.from_stored(random_linear_tensors(256, 128, 3, prefix="p"), "p")
    assert lin(mx.zeros((0, 256), mx.bfloat16)).shape == (0, 128)
    assert lin(mx.zeros((2, 0, 256))).shape == (2, 0, 128)
    ex = EXL3Experts.from_tensors(random_experts_tensors(2, 128, 128, 2, seed=1, prefix="e"), "e", 2)
    y = ex(mx.zeros((0, 128)), mx.zeros((0, 6), mx.int32), mx.zeros((0, 6)))
    assert y.shape == (0, 6, 128) and y.dtype == mx.float32


@pytest.mark.parametrize("batch_experts", [1, 2, 6])
def test_many_token_experts_give_the_one_expert_at_a_time_bytes(monkeypatch, batch_experts):
    """The many-token path (the GPU's prefill path; on the CPU for experts too large to keep
    decoded): host-sorted slots, W̃ decoded per batch of routed experts, one grouped gather_mm per
    projection and batch. On the CPU it must give the expert-at-a-time bytes, whatever the batch
    size, with mixed K in w1 and w2, an expert without slots, and slots outside the held range."""
    from mlx_dsv41.exl3 import ops, reference

    tensors = random_experts_tensors(6, 256, 384, bits={"w1": (3, 4), "w3": 3, "w2": (2, 4)}, seed=11)
    ex = experts_from_stored(tensors, "experts", 6, 256, 384, 10.0, (1, 6))
    monkeypatch.setattr(ops, "CPU_HELD_WEIGHTS", 0)
    monkeypatch.setattr(ops, "EXPERT_GEMM_BYTES", batch_experts * 2 * 256 * 384)
    rng = np.random.default_rng(4)
    x = mx.array(rng.normal(0, 2, (7, 256)).astype(np.float32)).astype(mx.bfloat16)
    idx = np.stack([rng.permutation([0, 1, 2, 4, 5])[:3] for _ in range(7)]).astype(np.int32)  # 3 gets none
    idx, wts = mx.array(idx), mx.array(rng.uniform(0.1, 1.0, (7, 3)).astype(np.float32))
    decoded = []
    monkeypatch.setattr(ops, "decoded_stack", lambda p, e, f=ops.decoded_stack: decoded.append(list(e)) or f(p, e))
    got = np.array(ex(x, idx, wts))
    want = np.array(
        reference.experts_by_expert(x, idx, wts, ex.w1, ex.w3, ex.w2, ex.expert_range, 10.0, reference.linear)
    )
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.all(got[np.array(idx) == 0] == 0)  # expert 0 is outside the held range (1, 6)
    assert all(2 not in batch and len(batch) <= batch_experts for batch in decoded)  # local 2 = expert 3
    assert sorted(e for batch in decoded[::3] for e in batch) == [0, 1, 3, 4]


@pytest.mark.parametrize("expert_range", [None, (1, 5)])
def test_cpu_gathered_experts_give_the_one_expert_at_a_time_bytes(expert_range):
    """The CPU path runs every slot at once over the decoded W̃ (no host read of the routing); it
    must give exactly what one expert at a time gives (the CPU's GEMMs are row-independent), mixed
    K in w2 and slots outside the held range (exactly 0) included."""
    from mlx_dsv41.exl3 import ops, reference

    tensors = random_experts_tensors(6, 256, 384, bits={"w1": 3, "w3": 3, "w2": (2, 4)}, seed=9)
    ex = experts_from_stored(tensors, "experts", 6, 256, 384, 10.0, expert_range)
    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(0, 2, (5, 256)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.permutation(6)[:3] for _ in range(5)]).astype(np.int32))
    wts = mx.array(rng.uniform(0.1, 1.0, (5, 3)).astype(np.float32))
    got = np.array(ex(x, idx, wts))
    want = np.array(
        reference.experts_by_expert(x, idx, wts, ex.w1, ex.w3, ex.w2, ex.expert_range, 10.0, reference.linear)
    )
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert getattr(ex.w1, "_w_tilde", None) is not None  # decoded once, kept (not a parameter)
    assert not any("_w_tilde" in k for k, _ in tree_flatten(ex.parameters()))
    assert ops.CPU_HELD_WEIGHTS >= 6 * 256 * 384
