"""Every linear sums in fp32 and rounds once to its output dtype (issue 15; quant/accumulation.py).

Each stored format the seam loads (official FP8 / FP4, converted mxfp8, dense bf16 / fp16 / fp32,
grouped `wo_a` dense, FP8-dequantized and as EXL3 slices, EXL3 at several K and codebooks), the
routed-experts formats (MX, dense, EXL3) and the shared expert are run on random non-zero bf16
activations at K = 5120 and compared with float64 `x @ W`, W decoded exactly from the stored
codes (numpy decoders, independent of MLX), rounded once. EXL3 rounds its input side to fp16 by
definition of the format (xh = fp16(H(fp16(x * suh))), docs/exl3.md#forward), so its reference
applies those two roundings, then the product, the output transform and svh in float64.
Bound: relative L2 error <= 0.3 %; one rounding to bf16 costs ~0.16 % and MLX's CPU quantized
kernels, which sum in bf16 for bf16 x, 1.5-8 % (the canary below pins that). Linear outputs must
also mostly equal the float64 result rounded once: at least 97 % of them bit for bit (fp32 sums
move a value across a bf16 rounding boundary rarely; bf16 sums do it for ~90 %).

tests/gpu/test_linear_arithmetic_gpu.py runs the same checks on the GPU with row counts that take
MLX's other kernels (qmv / qmm, GEMV / GEMM, the fused and per-expert EXL3 paths).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import rb
from exl3_numpy import hadamard_blocks
from exl3_numpy import reconstruct as exl3_reconstruct

from mlx_dsv41 import exl3
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.exl3.synthetic import random_experts_tensors, random_linear_tensors
from mlx_dsv41.model.moe import SharedExpert
from mlx_dsv41.quant import accumulation, make_experts, make_grouped_linear, make_linear, module_tensors
from mlx_dsv41.synthetic_checkpoints import decode_fp4, decode_fp8, quantize_fp4, quantize_fp8

K, N = 5120, 256
BOUND = 3e-3  # relative L2 error of a bf16 output against float64 rounded once
SAME = 0.97  # fraction of outputs equal to the float64 result rounded once (non-EXL3 formats)
ROWS = (1, 4)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def activations(rows: int, width: int = K, seed: int = 0) -> mx.array:
    x = np.random.default_rng(seed).standard_normal((rows, width))
    return mx.array(x.astype(np.float32)).astype(mx.bfloat16)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


# ------------------------------------------------------------------------------- linears


def _weights(out, inp, seed):
    return np.random.default_rng(seed).standard_normal((out, inp)) / np.sqrt(inp)


def _official(fmt, out=N, inp=K, seed=1):
    w = _weights(out, inp, seed)
    if fmt == "fp8":
        codes, scale = quantize_fp8(w)
        return {"p.weight": mx.array(codes), "p.scale": mx.array(scale)}, decode_fp8(codes, scale)
    packed, scale = quantize_fp4(w)
    return {"p.weight": mx.array(packed), "p.scale": mx.array(scale)}, decode_fp4(packed, scale)


def _dense(dtype, seed=2):
    w = mx.array(_weights(N, K, seed).astype(np.float32)).astype(dtype)
    return {"p.weight": w}, f64(w)


class Exl3Reference:
    """The EXL3 linear stored in `t` under `prefix`, as a float64 function of x [m, in]."""

    def __init__(self, t: dict, prefix: str, in_features: int, out_features: int, codebook: str):
        self.w = exl3_reconstruct(t[f"{prefix}.trellis"], codebook).astype(np.float64)
        self.suh = t[f"{prefix}.suh"].astype(np.float32)
        self.svh = t[f"{prefix}.svh"].astype(np.float64)
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: np.ndarray) -> np.ndarray:
        xs = np.zeros((*x.shape[:-1], self.suh.shape[0]), np.float32)
        xs[..., : self.in_features] = x
        xs = (xs * self.suh).astype(np.float16).astype(np.float64)  # exact product in fp32, then fp16
        xh = hadamard_blocks(xs, -1).astype(np.float16).astype(np.float64)
        return (hadamard_blocks(xh @ self.w, -1) * self.svh)[..., : self.out_features]


def _exl3(bits, codebook, seed=3):
    t = random_linear_tensors(K, N, bits, codebook, seed=seed, prefix="p")
    return {k: mx.array(v) for k, v in t.items()}, Exl3Reference(t, "p", K, N, codebook)


LINEARS = {
    "official fp8 -> mxfp8": lambda: _official("fp8"),
    "official fp4 -> mxfp4": lambda: _official("fp4"),
    "dense bf16": lambda: _dense(mx.bfloat16),
    "dense fp16": lambda: _dense(mx.float16),
    "exl3 K=3 mul1": lambda: _exl3(3, "mul1"),
    "exl3 K=5 mul1": lambda: _exl3(5, "mul1"),
    "exl3 K=4 mcg": lambda: _exl3(4, "mcg"),
}


@pytest.fixture(scope="module", params=sorted(LINEARS))
def linear(request):
    tensors, w = LINEARS[request.param]()
    return request.param, make_linear(tensors, "p", K, N), w


def check_linear(name, layer, w, rows):
    x = activations(rows)
    y = layer(x)
    assert y.dtype == mx.bfloat16, name
    want = w(f64(x)) if callable(w) else f64(x) @ w.T
    err = rel_err(f64(y), want)
    assert err <= BOUND, f"{name}, {rows} rows: relative error {err:.2e} > {BOUND:.0e}"
    same = float(np.mean(f64(y) == rb(want)))
    assert same >= SAME, f"{name}, {rows} rows: only {same:.1%} of outputs are the float64 value rounded once"
    return err


@pytest.mark.parametrize("rows", ROWS)
def test_linear_sums_in_fp32_and_rounds_once(linear, rows):
    check_linear(*linear, rows)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_the_converted_mx_layout_sums_the_same(fmt):
    tensors, _ = _official(fmt)
    layer = make_linear(tensors, "p", K, N)
    again = make_linear(module_tensors(layer, "q"), "q", K, N)
    x = activations(2)
    assert mx.array_equal(again(x), layer(x)).item()


def test_fp32_weights_and_activations_stay_fp32():
    """The compressor's ratio-2 projections and the head: fp32 weights, fp32 x, fp32 out."""
    w = mx.array(_weights(N, K, 4).astype(np.float32))
    layer = make_linear({"p.weight": w}, "p", K, N)
    x = activations(3).astype(mx.float32)
    y = layer(x)
    assert y.dtype == mx.float32
    assert rel_err(f64(y), f64(x) @ f64(w).T) <= 1e-5


def _grouped(kind, groups=8, inp=K // 8, out=64):
    if kind == "exl3 slices":
        tensors, ws = {}, []
        for g in range(groups):
            t = random_linear_tensors(inp, out, 5, "mul1", seed=10 + g, prefix=f"p.slice.{g}")
            tensors.update({k: mx.array(v) for k, v in t.items()})
            ws.append(Exl3Reference(t, f"p.slice.{g}", inp, out, "mul1"))
        return tensors, ws
    if kind == "fp8":
        tensors, w = _official("fp8", groups * out, inp, seed=5)
    else:
        weight = mx.array(_weights(groups * out, inp, 6).astype(np.float32)).astype(mx.bfloat16)
        tensors, w = {"p.weight": weight}, f64(weight)
    return tensors, w.reshape(groups, out, inp)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "exl3 slices"])
@pytest.mark.parametrize("rows", ROWS)
def test_grouped_linear_sums_in_fp32(kind, rows):
    """wo_a: 8 groups of K / 8 inputs (dense, FP8 dequantized to bf16, EXL3 slices)."""
    groups, inp, out = 8, K // 8, 64
    tensors, w = _grouped(kind, groups, inp, out)
    layer = make_grouped_linear(tensors, "p", groups, inp, out)
    x = activations(rows, groups * inp).reshape(rows, groups, inp)
    y = layer(x)
    assert y.dtype == mx.bfloat16 and y.shape == (rows, groups, out)
    if kind == "exl3 slices":
        want = np.stack([w[g](f64(x)[:, g]) for g in range(groups)], axis=1)
    else:
        want = np.einsum("rgi,goi->rgo", f64(x), w)
    assert rel_err(f64(y), want) <= BOUND
    assert np.mean(f64(y) == rb(want)) >= SAME


# ------------------------------------------------------------------------------- experts

E, TOPK, INTER, LIMIT = 4, 2, 256, 10.0


def _silu(v):
    return v / (1 + np.exp(-v))


def _apply(w, e, v):
    """Expert e's projection of v: a float64 matrix stack, or a list of EXL3 references."""
    return w[e](v[None])[0] if isinstance(w, list) else w[e] @ v


def experts_reference(x, idx, wts, w1, w3, w2):
    """Per-slot outputs in float64 with the reference's bf16 roundings (g, u, w2's input, y)."""
    out = np.zeros((*idx.shape, x.shape[-1]))
    for t, s in np.ndindex(*idx.shape):
        e = idx[t, s]
        g, u = rb(_apply(w1, e, x[t])), rb(_apply(w3, e, x[t]))
        h = rb(wts[t, s] * _silu(np.minimum(g, LIMIT)) * np.clip(u, -LIMIT, LIMIT))
        out[t, s] = rb(_apply(w2, e, h))
    return out


def _expert_weights(fmt):
    """(stored tensors under "e", float64 w1 [E, I, K], w3, w2 [E, K, I])."""
    if fmt == "exl3":
        t = random_experts_tensors(E, K, INTER, bits={"w1": 3, "w3": 3, "w2": (2, 3)}, seed=7, prefix="e")
        dims = {"w1": (K, INTER), "w3": (K, INTER), "w2": (INTER, K)}
        ws = {p: [Exl3Reference(t, f"e.{e}.{p}", *dims[p], "mul1") for e in range(E)] for p in dims}
        return {k: mx.array(v) for k, v in t.items()}, ws["w1"], ws["w3"], ws["w2"]
    tensors, ws = {}, {}
    for p, (out, inp) in (("w1", (INTER, K)), ("w3", (INTER, K)), ("w2", (K, INTER))):
        per = []
        for e in range(E):
            seed = 20 + 3 * e + ("w1", "w3", "w2").index(p)
            if fmt == "dense":
                w = mx.array(_weights(out, inp, seed).astype(np.float32)).astype(mx.bfloat16)
                tensors[f"e.{e}.{p}.weight"], dec = w, f64(w)
            else:
                parts, dec = _official(fmt, out, inp, seed)
                tensors.update({f"e.{e}.{p}.{k[2:]}": v for k, v in parts.items()})
            per.append(dec)
        ws[p] = np.stack(per)
    return tensors, ws["w1"], ws["w3"], ws["w2"]


@pytest.fixture(scope="module", params=["fp4", "fp8", "dense", "exl3"])
def experts(request):
    tensors, w1, w3, w2 = _expert_weights(request.param)
    return request.param, make_experts(tensors, "e", E, K, INTER, LIMIT), (w1, w3, w2)


def check_experts(fmt, module, ws, tokens, seed=8):
    rng = np.random.default_rng(seed + tokens)
    x = activations(tokens, seed=seed) * 2.0  # pushes some g, u past the +-10 clamp
    idx = np.sort(rng.permuted(np.tile(np.arange(E), (tokens, 1)), axis=1)[:, :TOPK], axis=1).astype(np.int32)
    wts = rng.uniform(0.2, 1.5, (tokens, TOPK)).astype(np.float32)
    y = module(x, mx.array(idx), mx.array(wts))
    assert y.dtype == mx.float32 and y.shape == (tokens, TOPK, K)
    want = experts_reference(f64(x), idx, wts.astype(np.float64), *ws)
    err = rel_err(np.array(y), want)
    assert err <= BOUND, f"{fmt} experts, {tokens} tokens: relative error {err:.2e}"
    return err


@pytest.mark.parametrize("tokens", [1, 3])
def test_routed_experts_sum_in_fp32(experts, tokens):
    check_experts(*experts, tokens)


def test_shared_expert_sums_in_fp32():
    args = ModelArgs(hidden_size=K, moe_intermediate_size=INTER)
    module = SharedExpert(args)
    tensors, ws = {}, {}
    for p, (out, inp) in (("w1", (INTER, K)), ("w3", (INTER, K)), ("w2", (K, INTER))):
        parts, ws[p] = _official("fp8", out, inp, seed=40 + len(ws))
        tensors.update({f"{p}.{k[2:]}": v for k, v in parts.items()})
    for p, (out, inp) in (("w1", (INTER, K)), ("w3", (INTER, K)), ("w2", (K, INTER))):
        setattr(module, p, make_linear(tensors, p, inp, out))
    x = activations(2, seed=9)
    y = module(x)
    want = experts_reference(
        f64(x), np.zeros((2, 1), np.int64), np.ones((2, 1)), ws["w1"][None], ws["w3"][None], ws["w2"][None]
    )[:, 0]
    assert y.dtype == mx.bfloat16 and rel_err(f64(y), want) <= BOUND


# ------------------------------------------------------------------------------- the finding


def test_mlx_cpu_quantized_kernels_sum_in_the_activation_dtype():
    """The canary behind quant/accumulation.py: on the CPU, MLX's quantized_matmul with bf16 x
    keeps its running sums in bf16 (every multiply-add rounded); with fp32 x it sums in fp32.
    If MLX changes this, the policy can drop the cast (and this test says so)."""
    tensors, w = _official("fp8")
    layer = make_linear(tensors, "p", K, N)
    x = activations(2, seed=11)
    with mx.stream(mx.cpu):
        raw = mx.quantized_matmul(x, layer.weight, layer.scales, transpose=True, group_size=32, bits=8, mode="mxfp8")
        fp32 = mx.quantized_matmul(
            x.astype(mx.float32), layer.weight, layer.scales, transpose=True, group_size=32, bits=8, mode="mxfp8"
        )
    want = f64(x) @ w.T
    assert rel_err(f64(raw), want) > 5e-3
    assert rel_err(f64(fp32), want) <= 1e-5
    assert accumulation.needs_fp32_activations("quantized_matmul", 8, 1, "cpu")
    assert accumulation.needs_fp32_activations("gather_qmm", 4, 12, "cpu")


@pytest.mark.parametrize(
    "backend_name,op,bits,rows,want",
    [
        ("cuda", "quantized_matmul", 4, 1, True),  # qmv: bf16 partial sums under 8 bits
        ("cuda", "gather_qmm", 4, 6, True),
        ("cuda", "quantized_matmul", 8, 1, False),  # qmv sums 8-bit weights in fp32
        ("cuda", "quantized_matmul", 4, 8, False),  # qmm: fp32
        ("metal", "quantized_matmul", 4, 1, False),  # qmv: fp32
        ("metal", "quantized_matmul", 8, 6, True),  # qmm_splitk: bf16 partials
        ("metal", "gather_qmm", 4, 64, False),  # the gather kernels never split k
    ],
)
def test_the_policy_table(backend_name, op, bits, rows, want):
    assert accumulation.needs_fp32_activations(op, bits, rows, backend_name) is want


def test_the_policy_keeps_fp32_and_integer_inputs():
    x = mx.ones((2, 4), mx.float32)
    assert accumulation.quantized_input(x, "quantized_matmul", 4, 2) is x
    with pytest.raises(ValueError, match="op must be one of"):
        accumulation.needs_fp32_activations("matmul", 4, 1)


def test_exl3_module_is_the_one_the_seam_builds():
    tensors, _ = _exl3(3, "mul1")
    assert isinstance(make_linear(tensors, "p", K, N), exl3.EXL3Linear)
