"""EXL3 kernels on the GPU (run by `bash benchmarks/gpu_run.sh tests`; skipped on the CPU).

- exl3_reconstruct bit-exact to the plain-MLX reference (run on the CPU stream) for K = 1..8 x
  every codebook and K = 1.5/2.5/3.5 (MUL1);
- exl3_gemv (+ exl3_gemv_out) for every K x codebook, m = 1..8, fused and k-split, every launch
  shape (launch.Tuning), against float64 (independent numpy decoder) and against the reference path;
- the fused expert kernels (mixed K and codebooks, a partial expert range, padded dims) against a
  float64 per-expert reference; the many-slot path; the public ops' dispatch;
- outputs poisoned before launch (init_value NaN) with guard rows past the shape left untouched;
  five repeats byte-identical.
"""

import math

import exl3_numpy
import mlx.core as mx
import numpy as np
import pytest
from exl3_numpy import rel_err
from test_exl3_kernels_sim import expert_chain
from test_exl3_layers import experts_f64

from mlx_dsv41.exl3 import EXL3Experts, EXL3Linear, ops, reference
from mlx_dsv41.exl3.synthetic import random_experts_tensors, random_linear_tensors
from mlx_dsv41.kernels import exl3 as launch

BITS = (1, 2, 3, 4, 5, 6, 7, 8)
CODEBOOKS = ("3inst", "mcg", "mul1")
NAN = float("nan")


def to_np(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def on_cpu(fn, *args, **kwargs):
    with mx.stream(mx.cpu):
        out = fn(*args, **kwargs)
        mx.eval(out)
    return out


def same_bytes(arrays):
    first = np.ascontiguousarray(arrays[0]).view(np.uint8)
    return all(np.array_equal(first, np.ascontiguousarray(a).view(np.uint8)) for a in arrays[1:])


def linear_tensors_mx(t):
    return mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"])


# ----------------------------------------------------------------------------------- reconstruct

RECONSTRUCT_CASES = [(b, c) for b in BITS for c in CODEBOOKS] + [(b, "mul1") for b in (1.5, 2.5, 3.5)]


@pytest.mark.parametrize("bits,codebook", RECONSTRUCT_CASES)
def test_reconstruct_bit_exact(bits, codebook):
    t = random_linear_tensors(512, 1024, bits, codebook, seed=int(bits * 10) + len(codebook))
    trellis = mx.array(t["trellis"])
    want = np.array(on_cpu(reference.reconstruct, trellis, codebook)).view(np.uint16)
    outs = []
    for _ in range(5):
        out = launch.RECONSTRUCT(**launch.reconstruct_args(trellis, codebook, guard_rows=4, init_value=NAN))[0]
        mx.eval(out)
        outs.append(np.array(out))
    got = outs[0]
    assert np.array_equal(got[:512].view(np.uint16), want)
    assert np.all(np.isnan(got[512:]))  # guard rows untouched
    assert same_bytes(outs)
    assert np.array_equal(np.array(ops.reconstruct(trellis, codebook)).view(np.uint16), want)  # public op


# ------------------------------------------------------------------------------------------ GEMV


def gemv_run(x, trellis, suh, svh, codebook, bias, out_dtype, splits, tuning, guard_rows=2):
    """exl3_gemv (+ exl3_gemv_out) with poisoned, guard-padded outputs; returns (y, partial)."""
    calls = launch.gemv_args(
        x,
        trellis,
        suh,
        svh,
        codebook,
        bias,
        out_dtype,
        splits=splits,
        tuning=tuning,
        guard_rows=guard_rows,
        init_value=NAN,
    )
    out = launch.GEMV(**calls[0])[0]
    partial = None
    if len(calls) == 2:
        partial = out
        calls[1]["inputs"][0] = partial[: partial.shape[0] - guard_rows]
        out = launch.GEMV_OUT(**calls[1])[0]
    mx.eval(out)
    return to_np(out), (None if partial is None else to_np(partial))


def check_gemv(m, in_f, out_f, bits, codebook, dtype, out_dtype, splits, tuning, bias, seed):
    t = random_linear_tensors(in_f, out_f, bits, codebook, seed=seed, bias=bias)
    trellis, suh, svh = linear_tensors_mx(t)
    b = mx.array(t["bias"]) if bias else None
    x = (mx.random.normal((m, in_f), key=mx.random.key(seed)) * 2).astype(dtype)
    runs = [gemv_run(x, trellis, suh, svh, codebook, b, out_dtype, splits, tuning) for _ in range(5)]
    y, partial = runs[0]
    assert same_bytes([r[0] for r in runs])
    assert np.all(np.isnan(y[m:])) and not np.any(np.isnan(y[:m]))
    if partial is not None:
        assert np.all(np.isnan(partial[-2:])) and not np.any(np.isnan(partial[:-2]))
    y = y[:m, :out_f]
    x64 = to_np(x).astype(np.float64)
    w64 = exl3_numpy.dequantize(t["trellis"], t["suh"], t["svh"], codebook)[:in_f, :out_f]
    y64 = x64 @ w64 + (t["bias"][:out_f].astype(np.float64) if bias else 0.0)
    out_eps = {mx.float32: 0.0, mx.float16: 2**-11, mx.bfloat16: 2**-8}[out_dtype]
    # fp16 xh (docs/exl3.md#forward), MMA fp32 accumulation
    assert rel_err(y, y64) < 1.5e-3 + out_eps
    want = to_np(on_cpu(reference.linear, x, trellis, suh, svh, codebook, b, out_f, out_dtype))
    assert rel_err(y, want) < 2e-4 + out_eps


T = launch.Tuning


@pytest.mark.parametrize("bits,codebook", [(b, c) for b in BITS for c in CODEBOOKS] + [(2.5, "mul1")])
def test_gemv_every_k_and_codebook(bits, codebook):
    # One fused launch; MUL1 with the default launch shape, the others with 16 SIMD groups x 2 tile
    # columns (more k groups).
    check_gemv(
        1,
        1024,
        768,
        bits,
        codebook,
        mx.bfloat16,
        mx.float32,
        1,
        None if codebook == "mul1" else T(warps=16, nc=2),
        False,
        seed=int(bits * 4) + len(codebook),
    )


@pytest.mark.parametrize(
    "m,in_f,out_f,bits,dtype,out_dtype,splits,tuning,bias",
    [
        (1, 2048, 512, 3, mx.bfloat16, mx.bfloat16, None, None, False),  # planned: split k
        (1, 2048, 2048, 4, mx.bfloat16, mx.bfloat16, None, T(dense_single_blocks=16), False),  # planned: fused
        (2, 1000, 640, 4, mx.float16, mx.float16, 3, T(nc=8), True),  # padded input, bias
        (5, 1536, 1024, 5, mx.bfloat16, mx.bfloat16, 1, T(warps=16, nc=4), True),
        (8, 1024, 384, 2, mx.float32, mx.float32, 4, T(nc=2), False),
        (8, 640, 1100, 3.5, mx.bfloat16, mx.bfloat16, None, T(ring_words=1), True),  # padded output, half K, 2 stages
        (3, 1024, 256, 6, mx.bfloat16, mx.float16, 1, T(ring_words=3 * 256 * 12), False),  # 3 stages
        (4, 1024, 512, 4, mx.float16, mx.float32, 2, None, False),
        (8, 3072, 256, 3, mx.bfloat16, mx.bfloat16, 1, T(warps=4), True),  # 3 chunks of xh, 4 SIMD groups
    ],
)
def test_gemv_rows_and_splits(m, in_f, out_f, bits, dtype, out_dtype, splits, tuning, bias):
    check_gemv(m, in_f, out_f, bits, "mul1", dtype, out_dtype, splits, tuning, bias, seed=m * 31 + in_f + out_f)


@pytest.mark.parametrize("m", [1, 7, 20, 70])
def test_linear_dispatch(m):
    # Through EXL3Linear: m <= 8 takes exl3_gemv, more rows reconstruct + f16_gemm (fp32 sums).
    t = random_linear_tensors(1000, 900, 4, "mul1", seed=m, bias=True, prefix="p")
    lin = EXL3Linear.from_stored({k: mx.array(v) for k, v in t.items()}, "p", 1000, 900)
    x = (mx.random.normal((m, 1000), key=mx.random.key(m)) * 2).astype(mx.bfloat16)
    y = to_np(lin(x))
    assert y.shape == (m, 900)
    w64 = exl3_numpy.dequantize(t["p.trellis"], t["p.suh"], t["p.svh"], "mul1")[:1000, :900]
    y64 = to_np(x).astype(np.float64) @ w64 + t["p.bias"][:900].astype(np.float64)
    assert rel_err(y, y64) < 1.5e-3 + 2**-8


# --------------------------------------------------------------------------------------- experts

EXPERT_CASES = [
    # n_experts, hidden, inter, bits, codebook, expert_range, T, top_k
    (8, 1024, 768, {"w1": 3, "w3": 3, "w2": (3, 2)}, "mul1", None, 1, 6),
    (8, 1024, 768, {"w1": (4, 3), "w3": 3, "w2": 5}, "mul1", (2, 7), 4, 6),
    (6, 640, 700, {"w1": 2.5, "w3": 2.5, "w2": 4}, {"w1": "mul1", "w3": "mul1", "w2": ("mcg", "3inst")}, None, 2, 3),
    # many tokens (> FUSED_MAX_TOKENS): experts_sorted, grouped GEMMs over decoded W̃
    (8, 512, 384, 3, "mul1", (1, 8), 12, 6),
    (8, 1024, 768, {"w1": (4, 3), "w3": 3, "w2": (3, 2)}, "mul1", (2, 7), 40, 6),
    (6, 640, 700, {"w1": 2.5, "w3": 2.5, "w2": 4}, {"w1": "mul1", "w3": "mul1", "w2": ("mcg", "3inst")}, None, 16, 3),
]


def make_experts(case, seed):
    n_experts, hidden, inter, bits, codebook, expert_range, T, top_k = case
    tensors = random_experts_tensors(n_experts, hidden, inter, bits, codebook, seed=seed, prefix="e")
    ex = EXL3Experts.from_tensors(
        {k: mx.array(v) for k, v in tensors.items()}, "e", n_experts, expert_range, hidden, inter
    )
    rng = np.random.default_rng(seed)
    x = mx.array(rng.normal(0, 2, (T, hidden)).astype(np.float32)).astype(mx.bfloat16)
    indices = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (T, top_k)).astype(np.float32)
    return tensors, ex, x, indices, weights


@pytest.mark.parametrize("case", range(len(EXPERT_CASES)))
def test_experts_vs_float64(case):
    n_experts, hidden, inter, *_ = EXPERT_CASES[case]
    tensors, ex, x, indices, weights = make_experts(EXPERT_CASES[case], seed=40 + case)
    outs = [to_np(ex(x, mx.array(indices), mx.array(weights))) for _ in range(5)]
    assert same_bytes(outs)
    y = outs[0]
    lo, hi = ex.expert_range
    y64 = experts_f64(tensors, "e", to_np(x).astype(np.float64), indices, weights, hidden, inter, 10.0, lo, hi)
    outside = (indices < lo) | (indices >= hi)
    assert np.all(y[outside] == 0) and not np.any(np.signbit(y[outside]))
    # bf16 g, u, h, y on both sides: a boundary flip moves one element by 2^-8 (see the CPU test)
    assert rel_err(y[~outside], y64[~outside]) < 2.5e-3 + 2**-8
    for t, s in zip(*np.nonzero(~outside)):  # per slot: bf16 flips of h weigh more on one row
        assert rel_err(y[t, s], y64[t, s]) < 1e-2 + 2**-8
    want = to_np(
        on_cpu(
            reference.experts_by_expert,
            x,
            mx.array(indices),
            mx.array(weights),
            ex.w1,
            ex.w3,
            ex.w2,
            ex.expert_range,
            ex.swiglu_limit,
            reference.linear,
        )
    )
    # The CPU's expert-at-a-time path: the same roundings, other fp32 summation orders.
    assert rel_err(y, want) < 1e-3 + 2**-8


def test_many_token_experts_in_batches_and_the_decoded_stack(monkeypatch):
    """experts_sorted decoding its experts a few at a time (each batch its own f16_gemm launches)
    gives the bytes of one batch (a row's f16_gemm bytes do not depend on the other rows), and
    decoded_stack is each expert's own W̃, bit for bit, on the GPU."""
    _, ex, x, indices, weights = make_experts(EXPERT_CASES[4], seed=77)
    one = to_np(ex(x, mx.array(indices), mx.array(weights)))
    monkeypatch.setattr(ops, "EXPERT_GEMM_BYTES", 2 * 2 * ex.w1.k * ex.w1.n)  # two experts a batch
    batched = to_np(ex(x, mx.array(indices), mx.array(weights)))
    assert np.array_equal(batched, one)
    for proj in (ex.w1, ex.w2):  # w2 holds two (K, codebook) groups
        picked = [4, 0, 3] if proj is ex.w1 else [0, 1, 3, 4]
        stack = to_np(ops.decoded_stack(proj, sorted(picked)))
        for i, e in enumerate(sorted(picked)):
            trellis, _, _, codebook = proj.expert(e)
            want = to_np(ops.reconstruct(trellis, codebook))
            assert np.array_equal(stack[i].astype(np.float32), want.astype(np.float32))


XH_POISON = 0x7E007E00  # two fp16 NaNs: no finite input makes this xh word


@pytest.mark.parametrize(
    "case,tuning",
    [
        (0, None),
        (1, None),
        (2, None),
        (0, T(gate_up_warps=16, down_warps=16, nc=2)),
        (1, T(nc=8, gate_up_warps=4, down_warps=4, gate_up_split_warps=32, down_split_warps=32)),
    ],
)
def test_expert_kernels_poisoned_and_guarded(case, tuning):
    tensors, ex, x, indices, weights = make_experts(EXPERT_CASES[case], seed=40 + case)
    indices, weights = mx.array(indices), mx.array(weights)
    lo = ex.expert_range[0]
    gu = None
    for key in launch.gate_up_keys(ex.w1, ex.w3):
        out = launch.EXPERT_GATE_UP(
            **launch.gate_up_args(x, indices, ex.w1, ex.w3, key, lo, prev=gu, tuning=tuning, guard=1, init_value=NAN)
        )[0]
        o = to_np(out)
        assert np.all(np.isnan(o[-1])) and not np.any(np.isnan(o[:-1]))
        gu = out[:-1]
    out = launch.EXPERT_SWIGLU(
        **launch.swiglu_args(
            gu, weights, indices, ex.w1, ex.w3, ex.w2, lo, ex.swiglu_limit, guard=1, init_value=float(XH_POISON)
        )
    )[0]
    o = to_np(out)
    assert np.all(o[-1] == XH_POISON) and not np.any(o[:-1] == XH_POISON)  # guard untouched; all written
    xh = out[:-1]
    partial = None
    for group in ex.w2.groups:
        out = launch.EXPERT_DOWN(
            **launch.down_args(xh, indices, ex.w2, group, lo, prev=partial, tuning=tuning, guard=1, init_value=NAN)
        )[0]
        o = to_np(out)
        assert np.all(np.isnan(o[-1])) and not np.any(np.isnan(o[:-1]))
        partial = out[:-1]
    out = launch.EXPERT_DOWN_FINISH(**launch.down_finish_args(partial, indices, ex.w2, lo, guard=1, init_value=NAN))[0]
    o = to_np(out)
    assert np.all(np.isnan(o[-1])) and not np.any(np.isnan(o[:-1]))
    y = out[:-1]
    T, top_k = indices.shape
    fused = to_np(y)[:, : ex.w2.out_features].reshape(T, top_k, -1)
    public = to_np(ex(x, indices, weights))
    if tuning is None:  # the launches the public op makes: the same bytes
        assert np.array_equal(fused, public)
    else:  # other launch shapes (k groups, k splits): other summation order only
        assert rel_err(fused, public) < 1e-4 + 2**-8  # + one bf16 ulp where y crosses a boundary
    assert math.isfinite(float(np.abs(fused).sum()))


@pytest.mark.parametrize("case", [0, 1, 3])
def test_expert_slot_bytes_do_not_depend_on_the_batch(case):
    """A slot's output is the same bytes whether its token runs alone, with other tokens, or with
    only some of its slots (the expert-parallel slot split): batched == solo. Calls of more than
    FUSED_MAX_TOKENS tokens (case 3) take the many-token path (experts_sorted on f16_gemm, whose
    rows do not see each other), so there the comparison is the slot split at the same token
    count."""
    tensors, ex, x, indices, weights = make_experts(EXPERT_CASES[case], seed=60 + case)
    T = indices.shape[0]
    whole = to_np(ex(x, mx.array(indices), mx.array(weights)))
    if T > ops.FUSED_MAX_TOKENS:
        for r in range(2):
            part = to_np(ex(x, mx.array(indices[:, r::2]), mx.array(weights[:, r::2])))
            assert np.array_equal(part, whole[:, r::2]), r
        return
    for t in range(T):
        alone = to_np(ex(x[t : t + 1], mx.array(indices[t : t + 1]), mx.array(weights[t : t + 1])))
        assert np.array_equal(alone[0], whole[t]), t
        half = to_np(ex(x[t : t + 1], mx.array(indices[t : t + 1, ::2]), mx.array(weights[t : t + 1, ::2])))
        assert np.array_equal(half[0], whole[t, ::2]), t
    y = whole[(indices >= ex.expert_range[0]) & (indices < ex.expert_range[1])]
    assert np.array_equal(y, y.astype(np.float32).view(np.uint32).__and__(0xFFFF0000).view(np.float32))  # bf16-valued


@pytest.mark.parametrize("shape,bits", [((1280, 16384), 3), ((4096, 1024), 4)])  # one launch; k split
def test_gemv_row_bytes_do_not_depend_on_the_other_rows(shape, bits):
    k, n = shape
    t = random_linear_tensors(k, n, bits, "mul1", seed=k + bits)
    args = (mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"]), "mul1")
    x = (mx.random.normal((8, k), key=mx.random.key(bits)) * 2).astype(mx.bfloat16)
    rows = to_np(ops.linear(x, *args))
    for m in (1, 3):
        for i in range(0, 8, m):
            assert np.array_equal(to_np(ops.linear(x[i : i + m], *args)), rows[i : i + m]), (m, i)


# ------------------------------------------------------------------------------ grouped linear (wo_a)


def test_many_token_grouped_linear_matches_each_group():
    """wo_a in a prefill (more than FUSED_MAX_TOKENS tokens): the groups' W̃ decoded once and one
    f16_gemm over the groups' rows; each group's output is its own linear's up to summation order,
    and a token's bytes do not depend on the other tokens of a many-token call."""
    from mlx_dsv41.exl3 import EXL3GroupedLinear
    from mlx_dsv41.exl3.stored import linear_tensors

    groups, d_in, d_out = 8, 4096, 1024
    slices = [
        linear_tensors(
            {k: mx.array(v) for k, v in random_linear_tensors(d_in, d_out, 5, "mul1", seed=80 + g, prefix="s").items()},
            "s",
        )
        for g in range(groups)
    ]
    layer = EXL3GroupedLinear.from_slices(slices, d_in, d_out)
    T = 3 * ops.FUSED_MAX_TOKENS
    x = (mx.random.normal((T, groups, d_in), key=mx.random.key(5)) * 2).astype(mx.bfloat16)
    y = to_np(layer(x))
    for g in range(groups):
        lin = EXL3Linear(
            *(slices[g][k] for k in ("trellis", "suh", "svh", "codebook")), in_features=d_in, out_features=d_out
        )
        assert rel_err(y[:, g], to_np(lin(x[:, g]))) < 1e-3 + 2**-8, g
    part = to_np(layer(x[5 : 5 + ops.FUSED_MAX_TOKENS + 1]))
    assert np.array_equal(part, y[5 : 5 + ops.FUSED_MAX_TOKENS + 1])


def test_grouped_linear_on_the_gpu_matches_each_group_and_its_contract():
    """wo_a at Flash shape (8 groups of 4096 -> 1024, K = 5) and a mixed-K case: every group's
    output is its own linear's (the GEMV's) up to summation order; poisoned outputs with guards
    untouched, five repeats byte-identical, a token's bytes independent of the other tokens."""
    from mlx_dsv41.exl3 import EXL3GroupedLinear
    from mlx_dsv41.exl3.stored import linear_tensors

    for groups, d_in, d_out, bits in ((8, 4096, 1024, (5,) * 8), (3, 300, 200, (2, 3, 4))):
        slices = [
            linear_tensors(
                {
                    k: mx.array(v)
                    for k, v in random_linear_tensors(d_in, d_out, b, "mul1", seed=60 + g, prefix="s").items()
                },
                "s",
            )
            for g, b in enumerate(bits)
        ]
        layer = EXL3GroupedLinear.from_slices(slices, d_in, d_out)
        x = (mx.random.normal((4, groups, d_in), key=mx.random.key(groups)) * 2).astype(mx.bfloat16)
        y = to_np(layer(x))
        assert y.shape == (4, groups, d_out)
        for g in range(groups):
            want = to_np(
                EXL3Linear(
                    *(slices[g][k] for k in ("trellis", "suh", "svh", "codebook")), in_features=d_in, out_features=d_out
                )(x[:, g])
            )
            assert rel_err(y[:, g], want) < 1e-3 + 2**-8, g
        runs = [to_np(layer(x)) for _ in range(5)]
        assert all(np.array_equal(r, runs[0]) for r in runs)
        assert np.array_equal(to_np(layer(x[1:2])), y[1:2])
        indices = mx.broadcast_to(mx.arange(groups, dtype=mx.int32), (4, groups))
        call = launch.down_args(  # each group's xh formed from x by the launch (STAGE_X)
            x.reshape(4 * groups, d_in), indices, layer.proj, layer.proj.groups[0], 0, guard=2, init_value=NAN
        )
        partial = to_np(launch.EXPERT_DOWN(**call)[0])
        assert np.all(np.isnan(partial[4 * groups :])) and not np.any(np.isnan(partial[: 4 * groups]))


# ------------------------------------------------------------------------------ shared expert + MoE combine


@pytest.mark.parametrize("T", [1, 3])
def test_shared_expert_adds_the_routed_slots_in_the_moes_order(T):
    """The shared expert's last launch adding the routed slots (exl3_expert_down_finish with ADD) gives
    the bytes of the MoE's MLX combine on the same GPU (fp32 sum in slot order, + the shared output,
    one bf16 rounding: quant.combine_moe); poisoned guard rows stay untouched; five repeats agree."""
    from mlx_dsv41.quant.experts import combine_moe

    D, inter, k = 256, 384, 6
    lin = {
        name: EXL3Linear.from_stored(random_linear_tensors(i, o, 3, seed=s, prefix="p"), "p", i, o)
        for name, i, o, s in (("w1", D, inter, 1), ("w3", D, inter, 2), ("w2", inter, D, 3))
    }
    rng = np.random.default_rng(T)
    x = mx.array(rng.normal(0, 1, (T, D)).astype(np.float32)).astype(mx.bfloat16)
    routed = mx.array(rng.normal(0, 0.5, (T, k, D)).astype(np.float32)).astype(mx.bfloat16).astype(mx.float32)
    fused = ops.swiglu_mlp(x, lin["w1"], lin["w3"], lin["w2"], 10.0, routed)
    alone = ops.swiglu_mlp(x, lin["w1"], lin["w3"], lin["w2"], 10.0)
    want = combine_moe(routed, alone)
    assert fused.dtype == mx.bfloat16 and fused.shape == (T, D)
    assert same_bytes([to_np(fused), to_np(want)])
    assert np.count_nonzero(to_np(fused)) > fused.size // 2
    projections = [lin[n].as_single_expert() for n in ("w1", "w3", "w2")]
    one = mx.zeros((T, 1), mx.int32)
    gu = launch.EXPERT_GATE_UP(
        **launch.gate_up_args(
            x, one, projections[0], projections[1], launch.gate_up_keys(projections[0], projections[1])[0], 0
        )
    )[0]
    xh = launch.EXPERT_SWIGLU(**launch.swiglu_args(gu, mx.ones((T, 1)), one, *projections, 0, 10.0))[0]
    partial = None
    for group in projections[2].groups:
        partial = launch.EXPERT_DOWN(**launch.down_args(xh, one, projections[2], group, 0, prev=partial))[0]
    call = launch.down_finish_args(partial, one, projections[2], 0, 1, NAN, mx.bfloat16, add=routed)
    runs = [to_np(launch.EXPERT_DOWN_FINISH(**call)[0]) for _ in range(5)]
    assert same_bytes(runs) and np.all(np.isnan(runs[0][T:]))
    assert same_bytes([runs[0][:T], to_np(fused)])


# Routed experts (two w1 / w2 groups, a held range) with a shared expert of another K and codebook:
# (n_experts, hidden, inter, routed bits, expert range, T, top_k, shared K, shared codebook)
MOE_CASES = [
    (8, 1024, 768, {"w1": (3, 2), "w3": 3, "w2": (3, 2)}, (1, 8), 1, 6, 5, "mul1"),
    (8, 1024, 768, {"w1": 3, "w3": 3, "w2": 3}, None, 3, 6, 4, "mcg"),
]


@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_the_shared_expert_in_the_routed_launches_gives_the_bytes_of_the_two_apart(case):
    """ops.moe (launch.run_moe: the shared expert's slots in the routed experts' last gate/up and
    down launches, the slots added there) gives the bytes of the routed experts followed by the
    shared expert's own launches with ADD (the model's path without it), on the same GPU; five
    repeats on the same counters agree; the poisoned guard rows of y and of the MoE's output stay
    untouched."""
    n_experts, hidden, inter, bits, expert_range, T, top_k, shared_k, shared_cb = MOE_CASES[case]
    _, ex, x, indices, weights = make_experts(
        (n_experts, hidden, inter, bits, "mul1", expert_range, T, top_k), 70 + case
    )
    indices, weights = mx.array(indices), mx.array(weights)
    lin = [
        EXL3Linear.from_stored(random_linear_tensors(i, o, shared_k, shared_cb, seed=s, prefix="p"), "p", i, o)
        for i, o, s in ((hidden, inter, 81), (hidden, inter, 82), (inter, hidden, 83))
    ]
    assert launch.expert_finish() and ops.shared_fits(ex, *lin, ex.swiglu_limit, T, x.dtype)
    routed = ops.experts(x, indices, weights, ex.w1, ex.w3, ex.w2, ex.expert_range, ex.swiglu_limit)
    apart = ops.swiglu_mlp(x, *lin, ex.swiglu_limit, routed)
    fused = [ops.moe(x, indices, weights, ex, *lin) for _ in range(5)]
    assert fused[0].dtype == mx.bfloat16 and fused[0].shape == (T, hidden)
    assert same_bytes([to_np(f) for f in fused] + [to_np(apart)])
    assert np.count_nonzero(to_np(apart)) > apart.size // 2
    # x as the model holds it ([B, S, D]): read as it is, the output in its shape, the same bytes
    rows = ops.moe(x.reshape(1, T, hidden), indices, weights, ex, *lin)
    assert rows.shape == (1, T, hidden) and same_bytes([to_np(rows).reshape(T, hidden), to_np(apart)])
    # The launches themselves (the simulator test's chain) with a poisoned guard row on y and moe.
    shared = tuple(w.as_single_expert() for w in lin)
    chain = expert_chain(ex, x, indices, weights, None, finish=(mx.float32, None), shared=shared, init_value=NAN)
    gu_calls, _, down_calls, _ = chain
    gu = None
    for call in gu_calls:
        if gu is not None:
            call["inputs"][launch.EXPERT_GATE_UP.input_names.index("prev")] = gu
        gu, xh = launch.EXPERT_GATE_UP(**call)
        gu = gu[:-1]
    assert xh.shape[0] == indices.size + T + 1 and not np.isnan(to_np(gu)).any()
    partial = None
    for call in down_calls:
        call["inputs"][0] = xh[:-1]
        if partial is not None:
            call["inputs"][launch.EXPERT_DOWN.input_names.index("prev")] = partial
        partial, y, moe = launch.EXPERT_DOWN(**call)
        partial = partial[:-1]
    y_np, moe_np = to_np(y), to_np(moe.astype(mx.float32))
    assert np.all(np.isnan(y_np[-1])) and np.all(np.isnan(moe_np[-1])) and not np.isnan(moe_np[:-1]).any()
    assert same_bytes([to_np(moe[:-1]), to_np(apart)])
    assert same_bytes([y_np[: indices.size], to_np(routed.reshape(-1, hidden))])


# ------------------------------------------------------------------------------ expert launches that finish themselves


# Expert cases 0-2, and a launch plan that splits k 16 ways (gate/up) and 10 (down): more splits
# than a finishing threadgroup holds at once (EXL3_SPLIT_CHUNK).
FINISH_CASES = [*EXPERT_CASES[:3], (4, 2048, 1280, {"w1": 3, "w3": 3, "w2": 4}, "mul1", None, 2, 2)]


@pytest.mark.parametrize("case", range(len(FINISH_CASES)))
def test_expert_launches_that_finish_themselves_give_the_separate_bytes(case, monkeypatch):
    """FINISH on CUDA (launch.expert_finish): the last exl3_expert_gate_up launch gives
    exl3_expert_swiglu's xh and the last exl3_expert_down launch exl3_expert_down_finish's y, byte
    for byte, the partials unchanged; five launches on the same counters agree (a launch that left a
    counter nonzero would not finish the next, whose output would keep its poison); guard rows keep
    their poison; the counters read 0 afterwards. Cases 0 and 2 chain launches of two groups."""
    assert launch.expert_finish()
    _, ex, x, indices, weights = make_experts(FINISH_CASES[case], seed=40 + case)
    if case == 3:
        monkeypatch.setattr(launch, "TUNING", launch.Tuning(gate_up_split_warps=8 * 120 * 16, down_split_warps=8 * 960))
        assert launch.expert_plan(ex.w1) == (16, 1) and launch.down_plan(ex.w2) == (10, 1)
    indices, weights = mx.array(indices), mx.array(weights)
    lo, slots = ex.expert_range[0], indices.size
    keys, groups = launch.gate_up_keys(ex.w1, ex.w3), ex.w2.groups
    gus = [None]
    for key in keys:
        gus.append(launch.EXPERT_GATE_UP(**launch.gate_up_args(x, indices, ex.w1, ex.w3, key, lo, prev=gus[-1]))[0])
    xh = launch.EXPERT_SWIGLU(
        **launch.swiglu_args(gus[-1], weights, indices, ex.w1, ex.w3, ex.w2, lo, ex.swiglu_limit)
    )[0]
    partials = [None]
    for group in groups:
        partials.append(launch.EXPERT_DOWN(**launch.down_args(xh, indices, ex.w2, group, lo, prev=partials[-1]))[0])
    y = launch.EXPERT_DOWN_FINISH(**launch.down_finish_args(partials[-1], indices, ex.w2, lo))[0]

    counters = launch.split_counters(slots * ex.w1.n // 128)
    fin = (weights, ex.w2, ex.swiglu_limit, counters)
    call = launch.gate_up_args(
        x, indices, ex.w1, ex.w3, keys[-1], lo, prev=gus[-2], guard=1, init_value=float(XH_POISON), finish=fin
    )
    runs = [[to_np(o) for o in launch.EXPERT_GATE_UP(**call)] for _ in range(5)]
    assert all(same_bytes([r[i] for r in runs]) for i in range(2))
    assert np.all(runs[0][0][-1] == float(XH_POISON)) and np.all(runs[0][1][-1] == XH_POISON)
    assert same_bytes([runs[0][0][:-1], to_np(gus[-1])]) and same_bytes([runs[0][1][:-1], to_np(xh)])
    assert not np.array(counters).any()

    counters = launch.split_counters(slots * ex.w2.n // 128)
    call = launch.down_args(
        xh,
        indices,
        ex.w2,
        groups[-1],
        lo,
        prev=partials[-2],
        guard=1,
        init_value=NAN,
        finish=(mx.float32, None, counters),
    )
    runs = [[to_np(o) for o in launch.EXPERT_DOWN(**call) if o is not None] for _ in range(5)]  # moe: absent
    assert all(same_bytes([r[i] for r in runs]) for i in range(2))
    assert all(np.all(np.isnan(o[-1])) and not np.any(np.isnan(o[:-1])) for o in runs[0])
    assert same_bytes([runs[0][0][:-1], to_np(partials[-1])]) and same_bytes([runs[0][1][:-1], to_np(y)])
    assert not np.array(counters).any() and np.count_nonzero(runs[0][1][:-1]) > y.size // 4


# ------------------------------------------------------------------------------ k-split gemv in one launch


@pytest.mark.parametrize(
    "m, in_f, out_f, bits, bias", [(1, 4096, 1024, 3, False), (3, 4096, 512, 4, True), (8, 2048, 384, 2, False)]
)
def test_a_k_split_gemv_finishes_itself_with_the_two_launch_bytes(m, in_f, out_f, bits, bias):
    """exl3_gemv with FINISH (the last threadgroup of each column block adds the splits): y has the
    bytes of exl3_gemv + exl3_gemv_out; five launches with the same counters agree (each leaves them
    at 0: a launch that did not would never finish the next one, whose y would keep its NaN poison);
    guard rows keep the poison; the counters read 0 afterwards."""
    t = random_linear_tensors(in_f, out_f, bits, "mul1", seed=m, bias=bias)
    trellis, suh, svh = linear_tensors_mx(t)
    b = mx.array(t["bias"]).astype(mx.float16) if bias else None
    x = (mx.random.normal((m, in_f), key=mx.random.key(m)) * 2).astype(mx.bfloat16)
    two, _ = gemv_run(x, trellis, suh, svh, "mul1", b, mx.bfloat16, None, None, guard_rows=0)
    counters = launch.split_counters(trellis.shape[1] // 8)
    calls = launch.gemv_args(
        x, trellis, suh, svh, "mul1", b, mx.bfloat16, guard_rows=2, init_value=NAN, counters=counters
    )
    assert len(calls) == 1 and dict(calls[0]["template"])["FINISH"]
    runs = []
    for _ in range(5):
        y = launch.GEMV(**calls[0])[1]
        mx.eval(y)
        runs.append(to_np(y))
    assert same_bytes(runs) and np.all(np.isnan(runs[0][m:])) and not np.any(np.isnan(runs[0][:m]))
    assert same_bytes([runs[0][:m], two[:m]])
    assert not np.array(counters).any()
    lin = EXL3Linear.from_stored(random_linear_tensors(in_f, out_f, bits, "mul1", seed=m, bias=bias, prefix="p"), "p")
    assert same_bytes([to_np(lin(x)), to_np(ops.linear(x, trellis, suh, svh, "mul1", b, out_f))])


# ------------------------------------------------------------------------------- a normed k-split gemv


def rows_and_norm_weight(m: int, k: int, n: int, nan_column: int) -> tuple:
    """(x [m, k] bf16, with a NaN at (1, nan_column) where m > 1; an RMSNorm weight [n] bf16 around
    1), from seed m."""
    rng = np.random.default_rng(m)
    xs = rng.normal(0, 1, (m, k)).astype(np.float32)
    if m > 1:
        xs[1, nan_column] = np.nan
    x = mx.array(xs).astype(mx.bfloat16)
    return x, mx.array(rng.normal(1, 0.5, n).astype(np.float32)).astype(mx.bfloat16)


@pytest.mark.parametrize("m, in_f, out_f, bits", [(1, 4096, 1024, 3), (3, 1024, 384, 4), (8, 2048, 512, 2)])
def test_a_normed_gemv_gives_the_gemv_then_rms_norm_bytes(m, in_f, out_f, bits):
    """exl3_gemv with NORM (docs/design.md#normed-linear; q_norm after a 4,096-wide model's wq_a is
    the first case, Flash's own shape is in the paired test): y has the bytes of the k-split
    linear then rms_norm (hc_collapse_norm, two launches);
    five launches on the same counters agree and leave them at 0 (the NORM count included: a launch
    that did not would never norm the next one's rows); rows past m keep their NaN poison; a NaN in
    x's row 1 makes that row NaN and only it; against float64 (the norm of the launch's own linear
    output) within bf16's rounding; the op (EXL3Linear.normed, quant.normed_linear) gives the same
    bytes."""
    from mlx_dsv41.kernels.hyper_connections import rms_norm
    from mlx_dsv41.model.norm import RMSNorm
    from mlx_dsv41.quant import normed_linear

    t = random_linear_tensors(in_f, out_f, bits, "mul1", seed=40 + m)
    trellis, suh, svh = linear_tensors_mx(t)
    x, weight = rows_and_norm_weight(m, in_f, out_f, 5)
    eps = 1e-6
    assert launch.normed_gemv_fits(x, trellis)
    plain = ops.linear(x, trellis, suh, svh, "mul1")
    want = to_np(rms_norm(plain, weight, eps))
    counters = launch.split_counters(out_f // 128 + 1)
    poisoned = dict(guard_rows=2, init_value=NAN, counters=counters)
    calls = launch.gemv_args(x, trellis, suh, svh, "mul1", None, mx.bfloat16, norm=(weight, eps), **poisoned)
    assert len(calls) == 1 and dict(calls[0]["template"])["NORM"]
    runs = [to_np(launch.GEMV(**calls[0])[1]) for _ in range(5)]
    assert same_bytes(runs) and np.all(np.isnan(runs[0][m:]))
    assert same_bytes([runs[0][:m], want])
    assert not np.array(counters).any()
    finite = np.isfinite(runs[0][:m]).all(axis=1)
    assert list(finite) == [not (m > 1 and r == 1) for r in range(m)]
    assert m == 1 or np.isnan(runs[0][1]).all()
    y64 = to_np(plain).astype(np.float64)
    w64 = np.array(weight.astype(mx.float32)).astype(np.float64)
    ref = y64 / np.sqrt(np.mean(y64 * y64, axis=1, keepdims=True) + eps) * w64
    assert rel_err(runs[0][:m][finite], ref[finite]) < 2**-8
    lin = EXL3Linear.from_stored(random_linear_tensors(in_f, out_f, bits, "mul1", seed=40 + m, prefix="p"), "p")
    norm = RMSNorm(out_f, eps)
    norm.weight = weight
    assert same_bytes([to_np(normed_linear(lin, norm, x)), want])
    assert same_bytes([to_np(lin.normed(x, weight, eps)), want])


# ---------------------------------------------------------------------- two linears of one input


@pytest.mark.parametrize(
    "m, k, n1, n2, bits, norm",
    [
        (1, 5120, 1280, 512, 5, True),
        (1, 5120, 1280, 512, 5, False),
        (3, 2048, 384, 128, 3, True),
        (8, 1024, 512, 256, 4, False),
    ],
)
def test_two_linears_in_one_gemv_give_their_own_launches_bytes(m, k, n1, n2, bits, norm):
    """exl3_gemv with PAIR (docs/design.md#paired-linears; the first case is Flash's wq_a with
    q_norm and wkv, K = 5, whose plans differ: 20 splits of two 128-blocks and 40 of one): y and y2
    have the bytes of each linear's own launch (ops.linear, then rms_norm where asked); five
    launches on the same counters agree and leave them at 0; rows past m keep their NaN poison; a
    NaN in x's row 1 stays in row 1 of both; the op (quant.paired_linears on EXL3Linear) gives the
    same bytes."""
    from mlx_dsv41.kernels.hyper_connections import rms_norm
    from mlx_dsv41.model.norm import RMSNorm
    from mlx_dsv41.quant import paired_linears

    ts = [random_linear_tensors(k, n, bits, "mul1", seed=60 + m + i) for i, n in enumerate((n1, n2))]
    (t1, s1, v1), (t2, s2, v2) = [linear_tensors_mx(t) for t in ts]
    x, weight = rows_and_norm_weight(m, k, n1, 9)
    nrm = (weight, 1e-6) if norm else None
    assert launch.paired_gemv_fits(x, (t1, s1, v1, "mul1", None), (t2, s2, v2, "mul1", None))
    want = ops.linear(x, t1, s1, v1, "mul1")
    want = to_np(rms_norm(want, *nrm) if norm else want)
    want2 = to_np(ops.linear(x, t2, s2, v2, "mul1"))
    counters = launch.split_counters((n1 + n2) // 128 + 1)
    poisoned = dict(guard_rows=2, init_value=NAN, counters=counters)
    (call,) = launch.gemv_args(
        x, t1, s1, v1, "mul1", None, mx.bfloat16, norm=nrm, pair=(t2, s2, v2, "mul1"), **poisoned
    )
    runs = []
    for _ in range(5):
        _, y, y2, _ = launch.GEMV(**call)
        runs.append((to_np(y), to_np(y2)))
    assert all(same_bytes([r[i] for r in runs]) for i in (0, 1))
    y, y2 = runs[0]
    assert np.all(np.isnan(y[m:])) and np.all(np.isnan(y2[m:])) and not np.array(counters).any()
    assert same_bytes([y[:m], want]) and same_bytes([y2[:m], want2])
    for out in (y, y2):
        assert list(np.isfinite(out[:m]).all(axis=1)) == [not (m > 1 and r == 1) for r in range(m)]
    first, second = (
        EXL3Linear.from_stored(random_linear_tensors(k, n, bits, "mul1", seed=60 + m + i, prefix="p"), "p")
        for i, n in enumerate((n1, n2))
    )
    rms = None
    if norm:
        rms = RMSNorm(n1, 1e-6)
        rms.weight = weight
    got, got2 = paired_linears(first, second, x, rms)
    assert same_bytes([to_np(got), want]) and same_bytes([to_np(got2), want2])
