"""Sparse attention on the CPU: the plain-MLX reference against a float64 oracle (finite and
nonfinite inputs, -1 / invalid indices, empty selections), the input checks, variant selection and
the kernels' launch geometry. The kernels themselves run in tests/gpu/test_sparse_attention.py
(which imports the oracle and input builder from here); their sources compile in
tests/test_kernel_sources.py."""

import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import sparse_attention as sa

# --------------------------------------------------------------------------------------------
# float64 oracle and inputs (shared with the GPU tests)


def attention_f64(q, window, pool, indices, sinks, scale):
    """The docs/model.md#attention formula in float64, one (b, s) at a time, with IEEE nonfinite
    semantics: the maximum over logits and sink propagates NaN; a -1 index is no key at all; any
    other index outside [0, W + T) makes the (b, s) outputs NaN (the kernels' documented contract).
    einsum (not BLAS) so that 0 * inf is NaN exactly as IEEE says."""
    q, window, pool, sinks = (np.asarray(a, np.float64) for a in (q, window, pool, sinks))
    indices = np.asarray(indices)
    B, S, H, D = q.shape
    W, T = window.shape[1], pool.shape[1]
    out = np.empty((B, S, H, D))
    with np.errstate(all="ignore"):
        for b in range(B):
            kv_all = np.concatenate([window[b], pool[b]])
            for s in range(S):
                idx = indices[b, s]
                if np.any((idx < -1) | (idx >= W + T)):
                    out[b, s] = np.nan
                    continue
                kv = kv_all[idx[idx >= 0]]  # [n, D]
                logits = np.einsum("hd,nd->hn", q[b, s], kv) * scale
                m = np.max(np.concatenate([logits, sinks[:, None]], axis=1), axis=1, keepdims=True)
                p = np.exp(logits - m)
                denom = p.sum(axis=1, keepdims=True) + np.exp(sinks[:, None] - m)
                out[b, s] = np.einsum("hn,nd->hd", p, kv) / denom
    return out


def make_inputs(seed, B, S, H, D, W, T, N, q_dtype=mx.float32, kv_dtype=mx.float32, skip=0.0, duplicates=False):
    """Random non-zero inputs as MLX arrays. ``kv_dtype``: one dtype or (window, pool) dtypes;
    ``skip``: fraction of -1 indices; ``duplicates``: every row repeats some of its keys. Values are
    N(0, 1) rounded to the given dtypes."""
    rng = np.random.default_rng(seed)

    def arr(shape, dtype):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    window_dtype, pool_dtype = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    q = arr((B, S, H, D), q_dtype)
    window, pool = arr((B, W, D), window_dtype), arr((B, T, D), pool_dtype)
    if W + T:
        idx = rng.integers(0, W + T, (B, S, N))
        if duplicates and N >= 2:
            idx[..., N // 2 :] = idx[..., : N - N // 2]
        idx = np.where(rng.random((B, S, N)) < skip, -1, idx)
    else:
        idx = np.full((B, S, N), -1)
    sinks = mx.array(rng.standard_normal(H).astype(np.float32))
    return q, window, pool, mx.array(idx.astype(np.int32)), sinks


def misaligned(x: mx.array) -> mx.array:
    """x's values in a row-contiguous view that starts one element past x's own start (so not
    16-byte aligned): the kernels' element-load path (a view MLX passes on without a copy)."""
    flat = mx.concatenate([mx.zeros((1,), x.dtype), x.reshape(-1)])
    return flat[1:].reshape(x.shape)


def as_f64(*arrays):
    return [np.array(a.astype(mx.float32)).astype(np.float64) if a.dtype != mx.int32 else np.array(a) for a in arrays]


def assert_matches_f64(out, expected, rtol=2e-5, atol=2e-5, what=""):
    """NaN exactly where float64 has NaN, infinities equal, finite values close."""
    out = np.asarray(out, np.float64)
    nan_out, nan_exp = np.isnan(out), np.isnan(expected)
    assert np.array_equal(nan_out, nan_exp), (
        f"{what}: NaN at {np.argwhere(nan_out != nan_exp)[:5].tolist()} differs from float64 "
        f"({nan_out.sum()} NaN vs {nan_exp.sum()} expected)"
    )
    inf_exp = np.isinf(expected)
    assert np.array_equal(np.isinf(out), inf_exp), f"{what}: infinities differ from float64"
    assert np.array_equal(out[inf_exp], expected[inf_exp]), f"{what}: infinities differ in sign"
    fin = ~(nan_exp | inf_exp)
    np.testing.assert_allclose(out[fin], expected[fin], rtol=rtol, atol=atol, err_msg=what)


# --------------------------------------------------------------------------------------------
# reference vs float64

# (name, B, S, H, D, W, T, N, q dtype, kv dtype, skip fraction, duplicates)
CASES = [
    ("plain", 2, 3, 4, 64, 8, 12, 10, mx.float32, mx.float32, 0.0, False),
    ("minus_one", 1, 4, 3, 64, 8, 12, 16, mx.float32, mx.float32, 0.4, False),
    ("empty_n0", 2, 3, 2, 64, 8, 12, 0, mx.float32, mx.float32, 0.0, False),
    ("all_skipped", 1, 3, 2, 64, 8, 12, 9, mx.float32, mx.float32, 1.0, False),
    ("pool_empty", 1, 3, 2, 64, 8, 0, 7, mx.float32, mx.float32, 0.2, False),
    ("window_empty", 2, 2, 2, 64, 0, 9, 7, mx.float32, mx.float32, 0.2, False),
    ("no_keys_at_all", 1, 2, 2, 64, 0, 0, 5, mx.float32, mx.float32, 0.0, False),
    ("duplicates", 1, 3, 3, 64, 4, 4, 12, mx.float32, mx.float32, 0.0, True),
    ("bf16_q_and_kv", 1, 3, 4, 64, 8, 12, 10, mx.bfloat16, mx.bfloat16, 0.2, False),
    ("bf16_kv", 2, 2, 3, 64, 8, 12, 10, mx.float32, mx.bfloat16, 0.0, False),
    ("mixed_kv", 1, 2, 3, 64, 8, 12, 10, mx.bfloat16, (mx.float32, mx.bfloat16), 0.1, False),
    ("two_tiles", 1, 2, 2, 64, 70, 90, 130, mx.float32, mx.bfloat16, 0.1, False),
    ("model_dim", 1, 2, 3, 512, 6, 6, 9, mx.bfloat16, mx.bfloat16, 0.2, False),
    ("row_chunks", 1, 70, 1, 32, 5, 5, 4, mx.float32, mx.float32, 0.2, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_float64(case):
    name, B, S, H, D, W, T, N, q_dtype, kv_dtype, skip, dup = case
    inputs = make_inputs(CASES.index(case), B, S, H, D, W, T, N, q_dtype, kv_dtype, skip, dup)
    scale = D**-0.5
    out = sa.sparse_attention(*inputs, scale)
    assert out.shape == (B, S, H, D) and out.dtype == mx.float32
    expected = attention_f64(*as_f64(*inputs), scale)
    assert np.isfinite(expected).all()
    assert_matches_f64(np.array(out), expected, what=name)


def test_empty_selection_is_zero_and_sink_only_in_denominator():
    q, window, pool, indices, sinks = make_inputs(1, 1, 2, 3, 64, 4, 4, 0)
    out = np.array(sa.sparse_attention(q, window, pool, indices, sinks, 0.125))
    assert np.array_equal(out, np.zeros_like(out))
    # One key: out = kv * e^l / (e^l + e^sink) exactly as the formula says.
    idx = mx.array(np.full((1, 2, 1), 2, np.int32))
    out = np.array(sa.sparse_attention(q, window, pool, idx, sinks, 0.125))
    qf, kv, sk = (np.array(a).astype(np.float64) for a in (q, window[0, 2], sinks))
    logit = qf[0] @ kv * 0.125  # [S, H]
    weight = 1.0 / (1.0 + np.exp(sk[None] - logit))
    np.testing.assert_allclose(out[0], weight[..., None] * kv, rtol=1e-5, atol=1e-6)


def _nonfinite_cases():
    """(name, mutate(q, window, pool, sinks) on numpy copies). Shapes: B=1, S=3, H=4, D, W=6,
    T=6, N=8, indices fixed so that every row selects key rows 1, 2, 3, 4, 6, 7 (3 twice) and skips
    one slot; rows 0 and 11 are never selected."""

    def q_at(value, s=1, h=2, d=5):
        def f(q, window, pool, sinks):
            q[0, s, h, d] = value

        return f

    def key_at(value, row, d=7):
        def f(q, window, pool, sinks):
            (window if row < 6 else pool)[0, row % 6, d] = value

        return f

    def sink_at(value, h=1):
        def f(q, window, pool, sinks):
            sinks[h] = value

        return f

    classes = (("nan", np.nan), ("pinf", np.inf), ("ninf", -np.inf))
    cases = [(f"q_{n}", q_at(v)) for n, v in classes]
    cases += [(f"key_{n}", key_at(v, 3)) for n, v in classes]
    cases += [
        (f"unselected_key_{n}_{r}", key_at(v, r)) for n, v in (("nan", np.nan), ("pinf", np.inf)) for r in (0, 11)
    ]
    cases += [(f"sink_{n}", sink_at(v)) for n, v in classes]
    return cases


NONFINITE = _nonfinite_cases()


def _nonfinite_inputs(mutate, D):
    q, window, pool, _, sinks = make_inputs(5, 1, 3, 4, D, 6, 6, 8)
    q, window, pool, sinks = (np.array(a) for a in (q, window, pool, sinks))
    mutate(q, window, pool, sinks)
    indices = np.tile(np.array([1, 2, 3, 4, 6, 7, -1, 3], np.int32), (1, 3, 1))
    return q, window, pool, indices, sinks


@pytest.mark.parametrize("name,mutate", NONFINITE, ids=[n for n, _ in NONFINITE])
def test_reference_nonfinite_matches_float64(name, mutate):
    q, window, pool, indices, sinks = _nonfinite_inputs(mutate, 64)
    args = [mx.array(a) for a in (q, window, pool, indices, sinks)]
    out = np.array(sa.sparse_attention(*args, 0.125))
    expected = attention_f64(q, window, pool, indices, sinks, 0.125)
    assert not np.isfinite(expected).all() or name.startswith(("unselected", "sink_ninf"))
    assert_matches_f64(out, expected, what=name)


def test_reference_negative_infinity_edges():
    """-inf sink with no key or only -inf logits: NaN (0/0) as in float64; -inf logits with a
    finite sink: weight 0, and 0 * inf in that key's value is NaN only in that dimension."""
    q, window, pool, _, sinks = make_inputs(8, 1, 3, 2, 64, 4, 4, 3)
    q, window, pool, sinks = (np.array(a) for a in (q, window, pool, sinks))
    q = np.abs(q) + 0.5  # positive q: a -inf in key dim d makes that key's logit -inf
    window[0, 1, 9] = -np.inf
    sinks[0] = -np.inf
    indices = np.array([[[-1, -1, -1], [1, -1, 1], [1, 2, 0]]], np.int32)
    args = [mx.array(a) for a in (q, window, pool, indices, sinks)]
    out = np.array(sa.sparse_attention(*args, 0.125))
    expected = attention_f64(q, window, pool, indices, sinks, 0.125)
    assert np.isnan(expected[0, 0, 0]).all() and np.isnan(expected[0, 1, 0]).all()
    assert np.isnan(expected[0, 2, :, 9]).all() and np.isfinite(np.delete(expected[0, 2], 9, -1)).all()
    assert_matches_f64(out, expected, what="-inf edges")


def test_invalid_index_makes_its_row_nan():
    q, window, pool, indices, sinks = make_inputs(3, 2, 3, 2, 64, 4, 5, 6)
    idx = np.array(indices)
    idx[0, 1, 2] = -2
    idx[1, 2, 5] = 9  # == W + T
    out = np.array(sa.sparse_attention(q, window, pool, mx.array(idx), sinks, 0.125))
    expected = attention_f64(*as_f64(q, window, pool), idx, np.array(sinks), 0.125)
    assert np.isnan(out[0, 1]).all() and np.isnan(out[1, 2]).all()
    assert_matches_f64(out, expected, what="invalid indices")


def test_misaligned_view_is_a_view_off_16_bytes():
    x = mx.random.normal((1, 3, 256)).astype(mx.bfloat16)
    v = misaligned(x)
    mx.eval(v)
    assert np.array_equal(np.array(v.astype(mx.float32)), np.array(x.astype(mx.float32)))
    assert np.array(v.view(mx.uint16), copy=False).ctypes.data % 16 != 0


# --------------------------------------------------------------------------------------------
# input checks


def _good(**over):
    q, window, pool, indices, sinks = make_inputs(0, 1, 2, 3, 64, 4, 4, 5)
    args = dict(q=q, window=window, pool=pool, indices=indices, sinks=sinks, scale=0.125)
    args.update(over)
    return args


BAD_INPUTS = [
    (dict(q=mx.ones((2, 3, 64))), "q must be [B, S, H, D]"),
    (dict(window=mx.ones((1, 4, 32))), "window must be [B=1, W, D=64]"),
    (dict(window=mx.ones((2, 4, 64))), "window must be [B=1, W, D=64]"),
    (dict(pool=mx.ones((4, 64))), "pool must be [B=1, T, D=64]"),
    (dict(indices=mx.zeros((1, 3, 5), mx.int32)), "indices must be [B=1, S=2, N]"),
    (dict(indices=mx.zeros((1, 2, 5), mx.int64)), "indices must be int32"),
    (dict(sinks=mx.ones((2,))), "sinks must be [H=3]"),
    (dict(sinks=mx.ones((3,), mx.bfloat16)), "sinks must be float32"),
    (dict(q=mx.ones((1, 2, 3, 64), mx.float16)), "q must be float32 or bfloat16"),
    (dict(pool=mx.ones((1, 4, 64), mx.float16)), "window and pool must be float32 or bfloat16"),
    (dict(window=mx.ones((1, 4, 64), mx.int32)), "window and pool must be float32 or bfloat16"),
    (dict(scale=float("nan")), "scale must be a finite, non-negative Python float"),
    (dict(scale=mx.array(0.1)), "scale must be a finite, non-negative Python float"),
    (dict(scale=-0.125), "scale must be a finite, non-negative Python float"),
]


@pytest.mark.parametrize("over,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_input_checks(over, message):
    with pytest.raises(ValueError, match="sparse_attention: " + re.escape(message)):
        sa.sparse_attention(**_good(**over))


# --------------------------------------------------------------------------------------------
# variant selection and statistics


def test_parse_variant():
    parsed = [sa.parse_variant(v) for v in ("serial", " Parallel ", "AUTO")]
    assert parsed == ["serial", "parallel", "auto"]
    for bad in ("", "fast", "serial,parallel", "reference"):
        with pytest.raises(ValueError, match="variant must be one of serial, parallel, rows, auto"):
            sa.parse_variant(bad)


def test_default_variant_precedence(clean_selection, monkeypatch):
    assert sa.default_variant() == "auto"
    monkeypatch.setenv(sa.ENV_VAR, "parallel")
    assert sa.default_variant() == "parallel"  # read at call time
    monkeypatch.setenv(sa.ENV_VAR, " ")
    assert sa.default_variant() == "auto"
    monkeypatch.setenv(sa.ENV_VAR, "serial")
    sa.set_default_variant("parallel")  # the CLI option wins over the environment
    assert sa.default_variant() == "parallel"
    sa.set_default_variant(None)
    assert sa.default_variant() == "serial"
    with pytest.raises(ValueError, match="variant must be one of"):
        sa.set_default_variant("quick")


def test_bad_variant_errors_at_call(clean_selection, monkeypatch):
    monkeypatch.setenv(sa.ENV_VAR, "turbo")
    message = f"{sa.ENV_VAR} must be one of serial, parallel, rows, auto; got 'turbo'"
    with pytest.raises(ValueError, match=message):
        sa.sparse_attention(**_good())
    with pytest.raises(ValueError, match="variant must be one of"):
        sa.sparse_attention(**_good(), variant="paralel")
    assert sa.variant_counts() == {"serial": 0, "parallel": 0, "rows": 0, "reference": 0}


def test_cpu_runs_reference_for_every_variant_and_counts(clean_selection):
    expected = np.array(sa.sparse_attention_reference(**_good()))
    for variant in ("serial", "parallel", "rows", "auto", None):
        out = np.array(sa.sparse_attention(**_good(), variant=variant))
        assert np.array_equal(out, expected)
    assert sa.variant_counts() == {"serial": 0, "parallel": 0, "rows": 0, "reference": 5}
    assert sa.reference_reasons() == {"cpu backend": 5}
    sa.reset_variant_counts()
    assert sa.variant_counts() == {"serial": 0, "parallel": 0, "rows": 0, "reference": 0}


def test_kernel_availability_reasons(monkeypatch):
    monkeypatch.setattr(sa, "backend", lambda: "cuda")
    ok = mx.zeros((1, 1, 64, 512))
    assert sa._kernel_unavailable(ok) is None
    assert sa._kernel_unavailable(mx.zeros((1, 1, 2, 1024))) is None
    assert sa._kernel_unavailable(mx.zeros((1, 1, 2, 256))) is None
    assert "head dim 64" in sa._kernel_unavailable(mx.zeros((1, 1, 2, 64)))
    assert "head dim 768: the kernels take 256, 512, 1024" in sa._kernel_unavailable(mx.zeros((1, 1, 2, 768)))
    assert "head dim 2048" in sa._kernel_unavailable(mx.zeros((1, 1, 2, 2048)))
    assert sa._kernel_unavailable(mx.zeros((1, 0, 2, 512))) == "empty output"


def _fake_gpu(monkeypatch, refuse_with=None):
    """Pretend to be on Metal with kernels that record their launches (parallel optionally
    refused the way Metal refuses a pipeline); returns the launch log."""
    monkeypatch.setattr(sa, "backend", lambda: "metal")
    monkeypatch.setattr(sa, "_parallel_refusals", {})
    monkeypatch.setattr(sa, "_auto_choices", {})
    monkeypatch.setattr(sa, "_auto_timings", {})
    ran = []

    def run(variant, q, *rest):
        ran.append(variant)
        if variant == "parallel" and refuse_with is not None:
            raise refuse_with
        return mx.zeros(q.shape, mx.float32)

    monkeypatch.setattr(sa, "_run", run)
    return ran


METAL_REFUSAL = ValueError(
    "[metal::Device] Thread group size (256) is greater than the maximum allowed threads per threadgroup (192)."
)


def test_refused_parallel_pipeline_falls_back_to_serial(clean_selection, monkeypatch):
    ran = _fake_gpu(monkeypatch, METAL_REFUSAL)
    inputs = make_inputs(0, 1, 1, 4, 512, 4, 4, 5)
    sa.sparse_attention(*inputs, 0.125, variant="parallel")
    assert ran == ["parallel", "serial"]  # the probe, then the call
    assert sa.variant_counts() == {"serial": 1, "parallel": 0, "rows": 0, "reference": 0}
    (why,) = sa.parallel_refusals().values()
    assert why.startswith("metal refused the 256-thread parallel kernel") and "(192)" in why
    ran.clear()
    sa.sparse_attention(*inputs, 0.125)  # auto: only serial is timed, and it runs
    assert set(ran) == {"serial"} and set(sa.auto_choices().values()) == {"serial"}


def test_other_kernel_errors_are_not_taken_for_refusals(clean_selection, monkeypatch):
    _fake_gpu(monkeypatch, RuntimeError("NVRTC compile error: something else"))
    with pytest.raises(RuntimeError, match="something else"):
        sa.sparse_attention(*make_inputs(0, 1, 1, 4, 512, 4, 4, 5), 0.125, variant="parallel")


def test_auto_times_each_shape_class_once(clean_selection, monkeypatch):
    ran = _fake_gpu(monkeypatch)
    # Timed chains of exactly _AUTO_MAX_CALLS launches, however fast the fake kernels are.
    monkeypatch.setattr(sa, "_AUTO_MAX_CALLS", 6)
    monkeypatch.setattr(sa, "_AUTO_CHAIN_SECONDS", 1e6)
    for rows in (1, 1, 2, 3):  # classes: rows 1, then rows in (2] and (2, 4]
        sa.sparse_attention(*make_inputs(0, 1, rows, 4, 512, 4, 4, 70), 0.125)
    assert len(sa.auto_choices()) == 3 and sa.auto_timings().keys() == sa.auto_choices().keys()
    per_variant = sa._AUTO_WARMUP_CALLS + sa._AUTO_PROBE_CALLS + (1 + sa._AUTO_ROUNDS) * 6
    assert len(ran) == 1 + 3 * 2 * per_variant + 4  # parallel probe, three classes, four calls
    assert sum(sa.variant_counts().values()) == 4 and sa.variant_counts()["reference"] == 0


def test_auto_takes_rows_for_many_rows_where_it_runs(clean_selection, monkeypatch):
    """auto's rows rule: from ROWS_AUTO_MIN query rows (B·S) on, on CUDA with bf16 inputs, the rows
    kernel runs untimed; fewer rows, or inputs it refuses, go to the timed serial / parallel choice."""
    ran = _fake_gpu(monkeypatch)
    monkeypatch.setattr(sa, "backend", lambda: "cuda")
    bf16 = mx.bfloat16
    few, many = sa.ROWS_AUTO_MIN - 1, sa.ROWS_AUTO_MIN
    sa.sparse_attention(*make_inputs(0, 1, many, 16, 256, 4, 4, 5, bf16, bf16), 0.0625)
    sa.sparse_attention(*make_inputs(0, 2, many // 2, 16, 256, 4, 4, 5, bf16, bf16), 0.0625)  # B·S counts
    assert ran == ["rows", "rows"] and not sa.auto_choices()
    ran.clear()
    sa.sparse_attention(*make_inputs(0, 1, few, 16, 256, 4, 4, 5, bf16, bf16), 0.0625)
    sa.sparse_attention(*make_inputs(0, 1, many, 16, 256, 4, 4, 5), 0.0625)  # fp32: rows refuses
    sa.sparse_attention(*make_inputs(0, 1, many, 8, 256, 4, 4, 5, bf16, bf16), 0.0625)  # 8 heads
    assert "rows" not in ran and len(sa.auto_choices()) == 3
    assert sa.variant_counts()["rows"] == 2
    ran.clear()
    sa.sparse_attention(*make_inputs(0, 1, many, 16, 256, 4, 4, 5, bf16, bf16), 0.0625, variant="parallel")
    assert ran == ["parallel"]  # a named variant is not overridden
    monkeypatch.setattr(sa, "backend", lambda: "metal")
    ran.clear()
    sa.sparse_attention(*make_inputs(0, 1, many, 16, 256, 4, 4, 5, bf16, bf16), 0.0625)
    assert "rows" not in ran  # no tensor-core MMA in the Metal bodies


def _fake_timing(monkeypatch, seconds):
    """Chains that take seconds[variant] per call; records (variant, args, calls) per chain."""
    chains = []

    def chain(variant, args, calls):
        chains.append((variant, args, calls))
        return seconds[variant]

    monkeypatch.setattr(sa, "_chain_seconds", chain)
    return chains


@pytest.mark.parametrize(
    "serial_s,parallel_s,choice",
    [
        (1.0, 2.0, "serial"),  # serial clearly faster
        (1.0, 1.04, "parallel"),  # within the margin: parallel
        (2.0, 1.0, "parallel"),
    ],
)
def test_auto_decision_rule(clean_selection, monkeypatch, serial_s, parallel_s, choice):
    _fake_gpu(monkeypatch)
    _fake_timing(monkeypatch, {"serial": serial_s, "parallel": parallel_s})
    inputs = make_inputs(0, 1, 1, 4, 512, 4, 4, 70)
    assert sa._auto_variant(inputs[0], inputs[1], inputs[2], inputs[3]) == choice
    (timings,) = sa.auto_timings().values()
    assert timings == {"serial": serial_s, "parallel": parallel_s}


def test_auto_protocol(clean_selection, monkeypatch):
    """Warm-up and probe chains for both variants before any timed chain; timed chains alternate
    in order and come in equal numbers; the synthetic call has the shape class's own shape."""
    _fake_gpu(monkeypatch)
    chains = _fake_timing(monkeypatch, {"serial": 1e-4, "parallel": 2e-4})
    q, window, pool, indices, _ = make_inputs(0, 2, 3, 4, 512, 5, 7, 70)  # rows 6 -> 8, 2 tiles
    sa._auto_variant(q, window, pool, indices)
    calls = [c for _, _, c in chains]
    warm, probe = sa._AUTO_WARMUP_CALLS, sa._AUTO_PROBE_CALLS
    assert calls[:4] == [warm, warm, probe, probe]
    sized = math.ceil(sa._AUTO_CHAIN_SECONDS / 1e-4)
    assert calls[4:] == [sized] * (2 + 2 * sa._AUTO_ROUNDS)
    timed = [v for v, _, _ in chains[6:]]
    assert timed == ["parallel", "serial", "serial", "parallel"] * (sa._AUTO_ROUNDS // 2) + (
        ["parallel", "serial"] if sa._AUTO_ROUNDS % 2 else []
    )
    sq, sw, sp, si, ss, scale = chains[0][1]
    assert sq.shape == (1, 8, 4, 512) and sq.dtype == q.dtype and si.shape == (1, 8, 128)
    assert sw.shape == (1, 5, 512) and sp.shape == (1, 7, 512) and ss.shape == (4,)
    assert scale == 512**-0.5


def test_auto_chain_feeds_each_output_to_the_next_call(monkeypatch):
    """_chain_seconds launches dependent calls: call i + 1's q is call i's output (in q's dtype)."""
    seen = []

    def run(variant, q, *rest):
        seen.append(q)
        return q.astype(mx.float32) + 1.0

    monkeypatch.setattr(sa, "_run", run)
    q = mx.zeros((1, 1, 2, 8), mx.bfloat16)
    assert sa._chain_seconds("serial", (q, None, None, None, None, 1.0), 3) >= 0
    assert [a.dtype for a in seen] == [mx.bfloat16] * 3
    assert [float(a[0, 0, 0, 0]) for a in seen] == [0.0, 1.0, 2.0]


def test_tuning_constants(clean_selection, monkeypatch):
    monkeypatch.setattr(sa, "_TUNING", {v: dict(c) for v, c in sa._TUNING.items()})
    monkeypatch.setattr(sa, "_auto_choices", {("some", "class"): "serial"})
    sa.set_tuning("serial", PREFETCH=1)
    assert sa.tuning()["serial"] == {"PREFETCH": 1} and not sa.auto_choices()
    args = sa._launch_args(*make_inputs(0, 1, 1, 1, 512, 1, 1, 1), 1.0, "serial")
    assert args["template"][:2] == [("DIM", 512), ("PREFETCH", 1)]
    # Sizes and scale travel as template values and shapes, never as small host arrays.
    assert dict(args["template"][2:]) == {
        "HAS_WINDOW": True,
        "HAS_POOL": True,
        "HAS_INDICES": True,
        "SCALE_BITS": 0x3F800000,
    }
    assert len(args["inputs"]) == 5
    with pytest.raises(ValueError, match="tuning PREFETCH=2 is not one of"):
        sa.set_tuning("parallel", PREFETCH=2)
    with pytest.raises(ValueError, match="tuning UNROLL=1 is not one of"):
        sa.set_tuning("parallel", UNROLL=1)
    with pytest.raises(ValueError, match="tuning is per kernel, serial or parallel; got 'auto'"):
        sa.set_tuning("auto", PREFETCH=0)


def test_shape_class_buckets():
    assert [sa._bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 640)] == [0, 1, 2, 4, 4, 8, 8, 16, 1024]


def test_benchmark_clock_kernel_compiles(tmp_path):
    """benchmarks/bench_sparse_attention.py times chains on the device with its own clock stamp
    kernel (CUDA only): its source compiles the way MLX would build it."""
    import importlib.util
    import shutil
    import subprocess

    import kernel_source_check as source_check

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sparse_attention.py"
    spec = importlib.util.spec_from_file_location("bench_sparse_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    source = (
        '#include "mlx/backend/cuda/device/utils.cuh"\nnamespace mlx::core::cu {\n'
        "__global__ void bench_gpu_clock(const float* x, const int32_t* n, float* y, uint64_t* ns) {"
        f"{bench.STAMP_SOURCE}}}\n}}\n"
    )
    (tmp_path / "k.cu").write_text(source)
    r = subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "-arch=sm_90",
            "-ptx",
            "-I",
            str(source_check.STUBS),
            "-o",
            str(tmp_path / "k.ptx"),
            str(tmp_path / "k.cu"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[:2000]
    assert "%globaltimer" in (tmp_path / "k.ptx").read_text()


# --------------------------------------------------------------------------------------------
# launch geometry (the kernels run on the GPU)


@pytest.mark.parametrize("variant,threads", [("serial", 32), ("parallel", 256)])
def test_launch_geometry_and_limit(variant, threads):
    q, window, pool, indices, sinks = make_inputs(0, 2, 3, 5, 512, 4, 4, 7, mx.bfloat16, mx.bfloat16)
    args = sa._launch_args(q, window, pool, indices, sinks, 0.5, variant)
    assert args["threadgroup"] == (threads, 1, 1)
    assert args["grid"] == (2 * 3 * 5 * threads, 1, 1)
    assert args["output_shapes"] == [(2, 3, 5, 512)] and args["output_dtypes"] == [mx.float32]
    assert args["template"] == [
        ("DIM", 512),
        ("PREFETCH", sa.tuning()[variant]["PREFETCH"]),
        ("HAS_WINDOW", True),
        ("HAS_POOL", True),
        ("HAS_INDICES", True),
        ("SCALE_BITS", 0x3F000000),
    ]
    # W, T, N, H, S come from the shapes of window, pool, indices and q.
    assert [a.shape for a in args["inputs"]] == [(2, 3, 5, 512), (2, 4, 512), (2, 4, 512), (2, 3, 7), (5,)]
    kernel = sa._KERNELS[variant]
    assert kernel.max_threads == threads
    too_many = dict(args, threadgroup=(2 * threads, 1, 1))
    with pytest.raises(ValueError, match=f"over its declared limit of {threads}"):
        kernel(**too_many, backend_name="cuda")


def test_launch_mixed_key_dtypes_promote_exactly():
    inputs = make_inputs(0, 1, 2, 2, 512, 3, 4, 5, mx.float32, (mx.bfloat16, mx.float32))
    _, w, p, *_ = sa._launch_args(*inputs, 0.5, "serial")["inputs"]
    assert w.dtype == p.dtype == mx.float32
    assert np.array_equal(np.array(w), np.array(inputs[1].astype(mx.float32)))
    assert np.array_equal(np.array(p), np.array(inputs[2]))


def test_launch_stand_ins_for_empty_inputs():
    q, window, pool, indices, sinks = make_inputs(0, 1, 2, 2, 512, 0, 0, 0)
    args = sa._launch_args(q, window, pool, indices, sinks, 0.5, "parallel")
    _, w, p, idx, _ = args["inputs"]
    assert w.shape == (1, 1, 512) and p.shape == (1, 1, 512) and idx.shape == (1,)
    assert np.isnan(np.array(w)).all() and np.isnan(np.array(p)).all() and idx.tolist() == [-1]
    flags = {k: v for k, v in args["template"] if k.startswith("HAS_")}
    assert flags == {"HAS_WINDOW": False, "HAS_POOL": False, "HAS_INDICES": False}  # sizes 0, never read


def test_bodies_share_one_implementation():
    """Both kernels are sa_kernel from one header, differing only in the SIMD-group count."""
    from mlx_dsv41 import metal_ext

    serial = metal_ext.body("sparse_attention_serial")
    parallel = metal_ext.body("sparse_attention_parallel")
    assert "constexpr int GROUPS = 1;" in serial and "constexpr int GROUPS = 8;" in parallel

    def strip(body):
        return [line for line in body.splitlines() if not line.startswith("//")]

    assert [line.replace("GROUPS = 8", "GROUPS = 1") for line in strip(parallel)] == strip(serial)
    assert sa.SERIAL.includes == sa.PARALLEL.includes == ("float_bits.h", "sparse_attention.h")
    launch = sa._launch_args(*make_inputs(0, 1, 1, 1, 512, 1, 1, 1), 1.0, "parallel")
    assert math.prod(launch["threadgroup"]) == sa.PARALLEL.max_threads == 256


# --------------------------------------------------------------------------------------------
# The kernels' shared header, executed on the CPU: the KX_* macros it uses are emulated with one
# OS thread per GPU thread (std::barrier for threadgroup and SIMD-group barriers, a per-SIMD-group
# buffer for the shuffles), compiled by g++ without fp contraction. This runs the real sa_attend
# text for both SIMD-group counts, both PREFETCH settings, vector and element loads, and bf16 and
# fp32 keys, before a GPU sees it; tests/gpu/ runs the real kernels.

_EMULATION = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
struct uint4 { u32 x, y, z, w; };
struct float4 { float x, y, z, w; };
struct bf16 { u16 bits; };  // storage only: the header reads keys and q through their bits
#define KX_SIM 1  // float_bits.h's plain operations (built without contraction)
#define KX_INLINE inline
#define KX_THREADGROUP
#define KX_DEVICE
#define KX_ALIGNED16(p) true
#define KX_ISNAN(x) std::isnan(x)
#define KX_INF_F32 (std::numeric_limits<float>::infinity())
#define KX_NAN_F32 (std::numeric_limits<float>::quiet_NaN())
#define KX_FMA(a, b, c) std::fma((float)(a), (float)(b), (float)(c))
#define KX_EXP(x) std::exp((float)(x))
#define KX_FMAX(a, b) std::fmax((float)(a), (float)(b))
static float emulated_bits_f32(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
#define KX_BITS_F32(u) emulated_bits_f32((u32)(u))
static u32 emulated_f32_bits(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
#define KX_F32_BITS(f) emulated_f32_bits((float)(f))
struct SimdGroup { std::barrier<> sync{32}; u32 lanes[32]; };
thread_local SimdGroup* tl_group;
thread_local std::barrier<>* tl_block;
thread_local u32 tl_lane;
template <typename V> static V emulated_shuffle(V v, u32 from) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  std::memcpy(&tl_group->lanes[tl_lane], &v, 4);
  tl_group->sync.arrive_and_wait();
  V r;
  std::memcpy(&r, &tl_group->lanes[from % 32], 4);
  tl_group->sync.arrive_and_wait();
  return r;
}
#define KX_SHUFFLE_XOR(v, m) emulated_shuffle((v), tl_lane ^ (u32)(m))
#define KX_SHUFFLE(v, l) emulated_shuffle((v), (u32)(l))
#define KX_BARRIER() tl_block->arrive_and_wait()
#define KX_SIMD_BARRIER() tl_group->sync.arrive_and_wait()
@HEADER@
template <int GROUPS, int PREFETCH, bool VEC, typename K>
static void run(const float* q, const K* window, const K* pool, const int* indices,
                const float* sinks, const float* scale, const int* dims, float* out, int blocks) {
  for (int block = 0; block < blocks; ++block) {
    std::barrier<> sync(GROUPS * 32);
    std::unique_ptr<SimdGroup[]> groups(new SimdGroup[GROUPS]);
    sa_shared<GROUPS> memory;
    std::vector<std::thread> threads;
    for (u32 t = 0; t < GROUPS * 32; ++t)
      threads.emplace_back([&, t] {
        tl_group = &groups[t / 32];
        tl_block = &sync;
        tl_lane = t % 32;
        const sa_dims d = {dims[0], dims[1], dims[2], dims[3], dims[4], scale[0]};
        sa_attend<EMULATED_DIM, GROUPS, PREFETCH, VEC>(q, window, pool, indices, sinks, d, out, &memory,
                                                       (u32)block, t % 32, t / 32);
      });
    for (auto& th : threads) th.join();
  }
}
template <typename K>
static void dispatch(int groups, int prefetch, int vec, const float* q, const void* window,
                     const void* pool, const int* indices, const float* sinks, const float* scale,
                     const int* dims, float* out, int blocks) {
  const K* w = (const K*)window;
  const K* p = (const K*)pool;
#define SA_RUN(G, P, V) if (groups == G && prefetch == P && vec == V) \
    return run<G, P, V, K>(q, w, p, indices, sinks, scale, dims, out, blocks);
  SA_RUN(1, 0, 1) SA_RUN(1, 1, 1) SA_RUN(8, 0, 1) SA_RUN(8, 1, 1)
  SA_RUN(1, 0, 0) SA_RUN(1, 1, 0) SA_RUN(8, 0, 0) SA_RUN(8, 1, 0)
}
extern "C" void sa_emulated(int groups, int prefetch, int vec, int kv_bf16, const float* q,
                            const void* window, const void* pool, const int* indices,
                            const float* sinks, const float* scale, const int* dims, float* out,
                            int blocks) {
  if (kv_bf16) dispatch<bf16>(groups, prefetch, vec, q, window, pool, indices, sinks, scale, dims, out, blocks);
  else dispatch<float>(groups, prefetch, vec, q, window, pool, indices, sinks, scale, dims, out, blocks);
}
"""
EMULATED_DIMS = (256, 512, 1024)  # every head dim the kernels take (512 is the model's)
# (SIMD groups, PREFETCH, vector loads): every configuration must give the same bytes.
EMULATED_CONFIGS = ((1, 0, 1), (8, 1, 1), (1, 1, 0), (8, 0, 0))


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float values that are bf16 numbers -> their bf16 bit patterns (uint16)."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    assert not np.any(bits & 0xFFFF), "values must be bf16 numbers"
    return (bits >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """(groups, prefetch, vec), numpy inputs, scale, kv_bf16 -> output of sa_attend on the CPU
    (D from q's shape; one library per D, built on first use)."""
    import ctypes
    import shutil
    import subprocess

    from mlx_dsv41 import metal_ext

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not installed")
    tmp = tmp_path_factory.mktemp("sa_emulated")
    (tmp / "sa.cpp").write_text(_EMULATION.replace("@HEADER@", "".join(metal_ext.read(h) for h in sa.SERIAL.includes)))
    libs = {}

    def lib_for(D):
        if D not in libs:
            so = tmp / f"sa{D}.so"
            r = subprocess.run(
                [
                    cxx,
                    "-std=c++20",
                    "-O1",
                    "-ffp-contract=off",
                    "-fno-fast-math",
                    "-shared",
                    "-fPIC",
                    "-pthread",
                    f"-DEMULATED_DIM={D}",
                    "-o",
                    str(so),
                    str(tmp / "sa.cpp"),
                ],
                capture_output=True,
                text=True,
            )
            assert r.returncode == 0, r.stderr[:4000]
            libs[D] = ctypes.CDLL(str(so))
        return libs[D]

    def run(config, q, window, pool, indices, sinks, scale, kv_bf16=True):
        groups, prefetch, vec = config
        B, S, H, D = q.shape
        W, T, N = window.shape[1], pool.shape[1], indices.shape[2]
        keys = _bf16_bits if kv_bf16 else (lambda a: np.ascontiguousarray(a, np.float32))
        bufs = [np.ascontiguousarray(q, np.float32), keys(window), keys(pool)]
        bufs += [
            np.ascontiguousarray(indices, np.int32).reshape(-1) if N else np.full(1, -1, np.int32),
            np.ascontiguousarray(sinks, np.float32),
            np.array([scale], np.float32),
            np.array([W, T, N, H, S], np.int32),
        ]
        out = np.full((B, S, H, D), np.nan, np.float32)
        ptrs = [b.ctypes.data_as(ctypes.c_void_p) for b in bufs + [out]]
        lib_for(D).sa_emulated(
            *(ctypes.c_int(v) for v in (groups, prefetch, vec, int(kv_bf16))), *ptrs, ctypes.c_int(B * S * H)
        )
        return out

    return run


def _same_bits_nan_as_nan(a, b) -> bool:
    """Equal bits everywhere, except that any NaN equals any NaN: which NaN payload an operation
    returns is not something C++ fixes (x86 passes an operand's payload on and g++ may commute
    a + b), while CUDA returns one canonical NaN, so tests/gpu compares NaNs bit for bit too."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return np.array_equal(nan_a, nan_b) and np.array_equal(a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b])


def _emulate_all(emulated, inputs, scale, what, kv_bf16=True, configs=EMULATED_CONFIGS):
    """Each configuration's output, asserted identical (_same_bits_nan_as_nan); returns it."""
    outs = [emulated(c, *inputs, scale, kv_bf16) for c in configs]
    for config, out in zip(configs[1:], outs[1:]):
        assert _same_bits_nan_as_nan(outs[0], out), (
            f"{what}: (groups, prefetch, vec) {config} differs from {configs[0]}"
        )
    return outs[0]


# (name, D, B, S, H, W, T, N, skip fraction, duplicates, kv dtype): tile edges, empty parts, -1,
# duplicates, fp32 keys, every head dim.
EMULATED_CASES = [
    ("one_key", 512, 1, 2, 2, 4, 4, 1, 0.0, False, mx.bfloat16),
    ("tile_edge_64", 512, 1, 1, 3, 40, 40, 64, 0.0, False, mx.bfloat16),
    ("three_tiles", 512, 1, 2, 1, 70, 90, 130, 0.1, True, mx.bfloat16),
    ("no_keys", 512, 2, 1, 2, 4, 4, 0, 0.0, False, mx.bfloat16),
    ("all_skipped", 512, 1, 2, 2, 4, 4, 9, 1.0, False, mx.bfloat16),
    ("window_only", 512, 1, 1, 2, 20, 0, 70, 0.3, False, mx.bfloat16),
    ("pool_only", 512, 2, 1, 1, 0, 30, 65, 0.3, False, mx.bfloat16),
    ("fp32_keys", 512, 1, 2, 1, 50, 60, 100, 0.2, False, mx.float32),
    ("dim_256", 256, 1, 2, 2, 70, 90, 130, 0.1, True, mx.bfloat16),
    ("dim_256_fp32_keys", 256, 1, 1, 2, 30, 30, 40, 0.2, False, mx.float32),
    ("dim_1024", 1024, 1, 2, 1, 70, 90, 130, 0.1, True, mx.bfloat16),
    ("dim_1024_fp32_keys", 1024, 1, 1, 1, 30, 30, 70, 0.2, False, mx.float32),
]


@pytest.mark.parametrize("case", EMULATED_CASES, ids=[c[0] for c in EMULATED_CASES])
def test_emulated_kernels_match_float64_and_each_other(emulated, case):
    name, D, B, S, H, W, T, N, skip, dup, kv_dtype = case
    inputs = as_f64(*make_inputs(50 + EMULATED_CASES.index(case), B, S, H, D, W, T, N, mx.float32, kv_dtype, skip, dup))
    out = _emulate_all(emulated, inputs, D**-0.5, name, kv_dtype == mx.bfloat16)
    assert_matches_f64(out, attention_f64(*inputs, D**-0.5), what=name)


@pytest.mark.parametrize("name,mutate", NONFINITE, ids=[n for n, _ in NONFINITE])
def test_emulated_kernels_nonfinite(emulated, name, mutate):
    q, window, pool, indices, sinks = _nonfinite_inputs(mutate, 512)
    window, pool = (np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32)) for a in (window, pool))
    inputs = (q, window, pool, indices, sinks)
    out = _emulate_all(emulated, inputs, 0.0625, name, configs=EMULATED_CONFIGS[:2])
    assert_matches_f64(out, attention_f64(*inputs, 0.0625), what=name)


def test_emulated_kernels_across_tiles_and_invalid_indices(emulated):
    """-inf sink while tile 0 is all skipped (row 0) or all -inf logits (row 1), finite keys
    after; an invalid index (row 2) makes its row NaN; no keys with a -inf sink: NaN (head 1)."""
    q, window, pool, indices, sinks = as_f64(*make_inputs(60, 1, 4, 2, 512, 64, 64, 100, mx.float32, mx.bfloat16))
    q = np.abs(q) + 0.25
    sinks[:] = [-np.inf, 0.5]
    indices[0, 0, :64] = -1
    window[0, :, 3] = -np.inf
    indices[0, 1] = np.concatenate([np.arange(64), 64 + np.arange(36)])
    indices[0, 2, 70] = 128
    indices[0, 3] = -1
    out = _emulate_all(emulated, (q, window, pool, indices, sinks), 0.0625, "across tiles")
    expected = attention_f64(q, window, pool, indices, sinks, 0.0625)
    assert np.isnan(expected[0, 1, :, 3]).all() and np.isfinite(np.delete(expected[0, 1], 3, -1)).all()
    assert np.isnan(expected[0, 2]).all() and np.isnan(expected[0, 3, 0]).all()
    assert_matches_f64(out, expected, what="across tiles")
