"""The quant seam's official and MX branches: official FP8 linears -> mxfp8, FP8 `wo_a` -> bf16,
FP4 (and FP8) experts -> MXExperts, converted MLX mxfp4/mxfp8 tensors (per expert or stacked);
checked against float64 decodes of the raw codes (numpy tables, independent of MLX)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dsv41.quant import FormatError, MXExperts, make_experts, make_grouped_linear, make_linear, module_tensors
from mlx_dsv41.quant.official import fp4_to_mxfp4, fp8_block_to_mxfp8
from mlx_dsv41.synthetic_checkpoints import decode_fp4, decode_fp8, quantize_fp4, quantize_fp8

rng = np.random.default_rng(11)
N, D, INTER = 6, 64, 96


def _fp8(out, inp):
    codes, scale = quantize_fp8(rng.standard_normal((out, inp)) / np.sqrt(inp))
    return {"weight": mx.array(codes), "scale": mx.array(scale)}, decode_fp8(codes, scale)


def _fp4(out, inp):
    packed, scale = quantize_fp4(rng.standard_normal((out, inp)) / np.sqrt(inp))
    return {"weight": mx.array(packed), "scale": mx.array(scale)}, decode_fp4(packed, scale)


def _keyed(prefix, parts):
    return {f"{prefix}.{k}": v for k, v in parts.items()}


def test_quantizers_round_trip_through_the_codes():
    """The test data itself: FP8 / FP4 codes decode back near the input (amax-scaled, RNE-ish)."""
    w = rng.standard_normal((40, 64))
    codes, scale = quantize_fp8(w)
    assert scale.shape == (2, 2) and np.abs(decode_fp8(codes, scale) - w).max() <= 2.0**-3 * np.abs(w).max()
    packed, scale4 = quantize_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (40, 32) and scale4.shape == (40, 2)
    assert np.abs(decode_fp4(packed, scale4) - w).max() <= 0.5 * np.abs(w).max()


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_official_linear_is_exact(fmt):
    parts, ref = (_fp8 if fmt == "fp8" else _fp4)(80, 64)  # 80 rows: a partial 32-row tile for FP8
    layer = make_linear(_keyed("p", parts), "p", 64, 80)
    assert layer.mode == {"fp8": "mxfp8", "fp4": "mxfp4"}[fmt]
    x = rng.standard_normal((3, 64)).astype(np.float32)
    y = np.array(layer(mx.array(x)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ ref.T, rtol=1e-5, atol=1e-5)
    # the converted layout (the module's own tensors, as the converter stores them) loads the same
    again = make_linear(module_tensors(layer, "q"), "q", 64, 80)
    assert np.array_equal(np.array(again(mx.array(x))), y)


def test_fp8_grouped_linear_is_dequantized_exactly():
    parts, ref = _fp8(2 * 48, 64)
    layer = make_grouped_linear(_keyed("wo_a", parts), "wo_a", 2, 64, 48)
    assert layer.weight.dtype == mx.bfloat16
    assert np.array_equal(np.array(layer.weight.astype(mx.float32)), ref.astype(np.float32))


def _expert_tensors(make, prefix="e"):
    tensors, ref = {}, {}
    for e in range(N):
        for proj, (o, i) in {"w1": (INTER, D), "w3": (INTER, D), "w2": (D, INTER)}.items():
            parts, w = make(o, i)
            tensors.update(_keyed(f"{prefix}.{e}.{proj}", parts))
            ref[(e, proj)] = w
    return tensors, ref


def _slots_reference(x, idx, wts, ref, lo, hi, limit=10.0):
    """float64 per-slot outputs: w2(w · silu(min(g, L)) · clip(u, ±L)), 0 outside [lo, hi)."""
    out = np.zeros((*idx.shape, D))
    for t in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            e = idx[t, s]
            if lo <= e < hi:
                g = np.minimum(ref[(e, "w1")] @ x[t], limit)
                u = np.clip(ref[(e, "w3")] @ x[t], -limit, limit)
                out[t, s] = ref[(e, "w2")] @ (wts[t, s] * g / (1 + np.exp(-g)) * u)
    return out


@pytest.mark.parametrize("make,expert_range", [(_fp4, None), (_fp4, (2, 5)), (_fp8, (1, 6))])
def test_official_experts(make, expert_range):
    tensors, ref = _expert_tensors(make)
    experts = make_experts(tensors, "e", N, D, INTER, 10.0, expert_range)
    assert isinstance(experts, MXExperts)
    lo, hi = expert_range or (0, N)
    assert experts.w1.weight.shape[0] == hi - lo
    x = rng.standard_normal((5, D)).astype(np.float32) * 2
    idx = rng.integers(0, N, (5, 3)).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (5, 3)).astype(np.float32)
    y = np.array(experts(mx.array(x), mx.array(idx), mx.array(wts)))
    want = _slots_reference(x.astype(np.float64), idx, wts, ref, lo, hi)
    assert y.dtype == np.float32
    assert np.all(y[(idx < lo) | (idx >= hi)] == 0)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # the converted per-expert layout and the module's own stacked parameters load the same
    per_expert = {}
    for e in range(lo, hi):
        for proj in ("w1", "w3", "w2"):
            layer = make_linear(tensors, f"e.{e}.{proj}", *((D, INTER) if proj != "w2" else (INTER, D)))
            per_expert.update(module_tensors(layer, f"c.{e}.{proj}"))
    stacked = dict(tree_flatten(experts.parameters()))
    for again in (
        make_experts(per_expert, "c", N, D, INTER, 10.0, expert_range),
        make_experts({f"s.{k}": v for k, v in stacked.items()}, "s", N, D, INTER, 10.0, expert_range),
    ):
        assert np.array_equal(np.array(again(mx.array(x), mx.array(idx), mx.array(wts))), y)


def test_stacked_experts_over_all_experts_sliced_to_the_range():
    tensors, _ = _expert_tensors(_fp4)
    full = dict(tree_flatten(make_experts(tensors, "e", N, D, INTER, 10.0).parameters()))
    part = make_experts({f"s.{k}": v for k, v in full.items()}, "s", N, D, INTER, 10.0, (3, 6))
    assert part.w2.weight.shape[0] == 3
    assert np.array_equal(np.array(part.w2.weight), np.array(full["w2.weight"][3:6]))


def test_bad_tensors_are_named():
    parts, _ = _fp8(64, 64)
    with pytest.raises(FormatError, match=r"p.weight: expected shape \[32, 64\], got \[64, 64\]"):
        make_linear(_keyed("p", parts), "p", 64, 32)
    bad = dict(parts, scale=mx.array(np.full((2, 2), 255, np.uint8)))
    with pytest.raises(FormatError, match="p.weight: E8M0 scale byte 255"):
        make_linear(_keyed("p", bad), "p", 64, 64)
    wq, scales = fp8_block_to_mxfp8(parts["weight"], parts["scale"])
    with pytest.raises(FormatError, match=r"affine-quantized weights \(.biases\)"):
        make_linear({"p.weight": wq, "p.scales": scales, "p.biases": scales}, "p", 64, 64)
    with pytest.raises(FormatError, match=r"p.weight: expected uint32 \[..., 8\] \(mxfp4\) or \[..., 16\]"):
        make_linear({"p.weight": wq[:, :12], "p.scales": scales}, "p", 64, 64)
    with pytest.raises(FormatError, match=r"p.scales: expected uint8 \[64, 2\]"):
        make_linear({"p.weight": wq, "p.scales": scales[:, :1]}, "p", 64, 64)
    with pytest.raises(FormatError, match="a grouped linear is stored dense, as official FP8"):
        make_grouped_linear({"g.weight": wq, "g.scales": scales}, "g", 2, 64, 32)
    tensors, _ = _expert_tensors(_fp4)
    tensors["e.4.w2.weight"] = mx.zeros((D, INTER), mx.bfloat16)
    del tensors["e.4.w2.scale"]
    with pytest.raises(FormatError, match="e.4.w2: stored as dense, expected an MX format"):
        make_experts(tensors, "e", N, D, INTER, 10.0)
    w4, s4 = fp4_to_mxfp4(*(_fp4(INTER, D)[0][k] for k in ("weight", "scale")))
    with pytest.raises(FormatError, match="w1 mixes modes"):
        MXExperts.from_parts(
            {
                "w1": [
                    (w4, s4, "mxfp4"),
                    (*fp8_block_to_mxfp8(*(_fp8(INTER, D)[0][k] for k in ("weight", "scale"))), "mxfp8"),
                ],
                "w3": [],
                "w2": [],
            },
            2,
            D,
            INTER,
            10.0,
        )


def test_dense_fp16_linear_keeps_the_activation_dtype():
    # exllamav3 stores unquantized linears (e.g. Engram wkv, a 16-bit head) in fp16.
    w = mx.random.normal((6, 8)).astype(mx.float16)
    lin = make_linear({"p.weight": w}, "p", 8, 6)
    x = mx.random.normal((3, 8))
    assert lin(x.astype(mx.bfloat16)).dtype == mx.bfloat16
    y = lin(x)
    assert y.dtype == mx.float32
    assert mx.allclose(y, x @ w.astype(mx.float32).T, rtol=1e-5, atol=1e-5)
