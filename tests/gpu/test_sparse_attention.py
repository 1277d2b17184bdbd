"""Sparse attention kernels on the GPU (run by `bash benchmarks/gpu_run.sh`; skipped on the CPU).

- parallel == serial byte for byte over 60 shapes (key counts 0..640 across tile edges, rows 1..17,
  heads 1..64, B 1..2, -1 indices, duplicates, q/kv dtypes), and both against float64;
- nonfinite classes (NaN, +inf, -inf in q, keys and sinks; -inf across tile boundaries) match
  float64 NaN for NaN, with the two variants still byte-identical;
- outputs poisoned before launch: the kernel writes exactly its region, the guard stays intact;
- five repeats identical; exact sums at 640 keys where every step is exact;
- inputs that start off a 16-byte boundary (the element-load path) give the same bytes, and so
  does every tuning constant;
- dispatch: auto / serial / parallel through sparse_attention, counters, no refused pipeline.
"""

from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from test_sparse_attention import as_f64, assert_matches_f64, attention_f64, make_inputs, misaligned

from mlx_dsv41.kernels import sparse_attention as sa

pytestmark = pytest.mark.gpu
F32, BF16 = mx.float32, mx.bfloat16
KEY_COUNTS = (0, 1, 63, 64, 65, 127, 128, 129, 511, 640)
HEADS = (1, 2, 3, 5, 8, 13, 16, 32, 64)
DTYPES = ((F32, BF16), (BF16, BF16), (F32, F32))
WINDOWS = (128, 0, 37, 128)
POOLS = (300, 700, 0, 1)
RTOL, ATOL = 1e-4, 2e-5  # fp32 kernels vs float64, D = 512


def kernel_out(variant, inputs, scale) -> np.ndarray:
    out = sa._run(variant, *inputs, scale)
    mx.eval(out)
    return np.array(out)


def assert_same_bytes(a, b, what):
    a, b = np.ascontiguousarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32)
    diff = np.argwhere(a != b)
    assert diff.size == 0, f"{what}: {len(diff)} words differ, first at {diff[:3].tolist()}"


def _shapes():
    """60 shapes: (B, S, H, W, T, N, q dtype, kv dtype, skip fraction, duplicates); rows are
    halved where the float64 oracle would get slow (B*S*H*N <= 150k)."""
    shapes = []
    for i in range(60):
        N = KEY_COUNTS[i % 10]
        S = 1 + (i * 5) % 17
        H = HEADS[(i * 4) % 9]
        B = 2 if i % 3 == 2 else 1
        while B * S * H * max(N, 1) > 150_000 and S > 1:
            S //= 2
        W, T = WINDOWS[i % 4], POOLS[(i // 4) % 4]
        q_dtype, kv_dtype = DTYPES[i % 3]
        shapes.append((B, S, H, W, T, N, q_dtype, kv_dtype, (0.0, 0.1, 0.5)[(i // 3) % 3], i % 7 == 3))
    return shapes


SHAPES = _shapes()


def test_shape_coverage():
    assert set(KEY_COUNTS) <= {s[5] for s in SHAPES}
    assert set(range(1, 18)) <= {s[1] for s in SHAPES}
    assert {1, 64} <= {s[2] for s in SHAPES} and {1, 2} == {s[0] for s in SHAPES}
    assert any(s[2] == 64 and s[5] == 640 for s in SHAPES)


@pytest.mark.parametrize("i", range(len(SHAPES)))
def test_parallel_equals_serial_and_float64(i):
    B, S, H, W, T, N, q_dtype, kv_dtype, skip, dup = SHAPES[i]
    inputs = make_inputs(100 + i, B, S, H, 512, W, T, N, q_dtype, kv_dtype, skip, dup)
    scale = 512**-0.5
    serial, parallel = kernel_out("serial", inputs, scale), kernel_out("parallel", inputs, scale)
    what = f"shape {SHAPES[i]}"
    assert_same_bytes(parallel, serial, what)
    expected = attention_f64(*as_f64(*inputs), scale)
    assert np.isfinite(expected).all()
    for out in (serial, parallel):
        assert_matches_f64(out, expected, RTOL, ATOL, what)


def test_mixed_key_dtypes():
    inputs = make_inputs(8, 2, 3, 8, 512, 128, 200, 200, BF16, (F32, BF16), 0.1)
    serial, parallel = kernel_out("serial", inputs, 512**-0.5), kernel_out("parallel", inputs, 512**-0.5)
    assert_same_bytes(parallel, serial, "mixed key dtypes")
    assert_matches_f64(serial, attention_f64(*as_f64(*inputs), 512**-0.5), RTOL, ATOL, "mixed")


@pytest.mark.parametrize("D", [256, 1024])
def test_other_head_dims(D):
    """The kernels also take D = 256 and 1024 (the model uses 512)."""
    inputs = make_inputs(7, 1, 3, 4, D, 20, 90, 100, F32, BF16, 0.1)
    serial, parallel = kernel_out("serial", inputs, D**-0.5), kernel_out("parallel", inputs, D**-0.5)
    assert_same_bytes(parallel, serial, f"D={D}")
    assert_matches_f64(serial, attention_f64(*as_f64(*inputs), D**-0.5), RTOL, ATOL, f"D={D}")


# --------------------------------------------------------------------------------------------
# nonfinite inputs: B=1, S=3, H=4, W=T=64, N=100 (two tiles); every row selects window rows
# 0..49 and pool rows 0..49 in order; window row 60 and pool row 60 are never selected.


def _selected_indices():
    return np.tile(np.concatenate([np.arange(50), 64 + np.arange(50)]).astype(np.int32), (1, 3, 1))


def _set(where, value, at):
    def mutate(q, window, pool, sinks, indices):
        {"q": q, "window": window, "pool": pool, "sinks": sinks}[where][at] = value

    return mutate


def _first_tile_all_skipped(q, window, pool, sinks, indices):
    sinks[:] = -np.inf
    indices[0, 1, :64] = -1


def _first_tile_minus_inf_logits(q, window, pool, sinks, indices):
    # q > 0 and -inf in dim 3 of all tile-0 keys (window rows 0..49, pool rows 0..13): with a -inf
    # sink the maximum stays -inf through tile 0; tile 1 is finite. Those keys' weights are 0,
    # and 0 * -inf makes output dim 3 NaN (float64 too); every other output is finite.
    q[:] = np.abs(q) + 0.25
    sinks[:] = -np.inf
    window[0, :50, 3] = -np.inf
    pool[0, :14, 3] = -np.inf


def _no_keys_minus_inf_sink(q, window, pool, sinks, indices):
    sinks[2] = -np.inf
    indices[0, 0, :] = -1


# (name, mutate, whether float64 has nonfinite outputs): a never-selected row (60) must change
# nothing; a -inf sink only drops the sink's term.
NONFINITE = [
    (
        f"{where}{at[1] if where in ('window', 'pool') else ''}_{name}",
        _set(where, v, at),
        not (at[1:2] == (60,) or (where == "sinks" and v == -np.inf)),
    )
    for where, at in (
        ("q", (0, 1, 2, 5)),
        ("window", (0, 7, 9)),
        ("pool", (0, 30, 400)),
        ("window", (0, 60, 9)),
        ("pool", (0, 60, 9)),
        ("sinks", (1,)),
    )
    for name, v in (("nan", np.nan), ("pinf", np.inf), ("ninf", -np.inf))
]
NONFINITE += [
    ("first_tile_all_skipped", _first_tile_all_skipped, False),
    ("first_tile_minus_inf_logits", _first_tile_minus_inf_logits, True),
    ("no_keys_minus_inf_sink", _no_keys_minus_inf_sink, True),
]


@pytest.mark.parametrize("name,mutate,nonfinite", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_nonfinite_matches_float64(name, mutate, nonfinite):
    q, window, pool, _, sinks = make_inputs(11, 1, 3, 4, 512, 64, 64, 100)
    q, window, pool, sinks = (np.array(a) for a in (q, window, pool, sinks))
    indices = _selected_indices()
    mutate(q, window, pool, sinks, indices)
    inputs = [mx.array(a) for a in (q, window, pool, indices, sinks)]
    serial, parallel = kernel_out("serial", inputs, 0.0625), kernel_out("parallel", inputs, 0.0625)
    assert_same_bytes(parallel, serial, name)
    expected = attention_f64(q, window, pool, indices, sinks, 0.0625)
    assert np.isfinite(expected).all() != nonfinite, f"{name}: the case does not test what it says"
    assert_matches_f64(serial, expected, RTOL, ATOL, name)


def test_invalid_indices_make_their_rows_nan():
    q, window, pool, indices, sinks = make_inputs(12, 2, 3, 4, 512, 10, 10, 70)
    idx = np.array(indices)
    idx[0, 1, 65] = -5
    idx[1, 2, 3] = 20  # == W + T
    inputs = [q, window, pool, mx.array(idx), sinks]
    serial, parallel = kernel_out("serial", inputs, 0.0625), kernel_out("parallel", inputs, 0.0625)
    assert_same_bytes(parallel, serial, "invalid indices")
    assert np.isnan(serial[0, 1]).all() and np.isnan(serial[1, 2]).all()
    assert_matches_f64(serial, attention_f64(*as_f64(*inputs), 0.0625), RTOL, ATOL, "invalid")


# --------------------------------------------------------------------------------------------
# poison and guard, repeats

POISON = -1.2345e37
GUARD = 4096


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("shape", [(1, 1, 64, 0, 300, 640), (2, 5, 3, 128, 0, 65), (1, 17, 2, 7, 9, 0)])
def test_poisoned_output_written_exactly_in_region(variant, shape):
    B, S, H, W, T, N = shape
    inputs = make_inputs(13, B, S, H, 512, W, T, N, BF16, BF16, 0.2)
    args = sa._launch_args(*inputs, 0.0625, variant)
    n = B * S * H * 512
    args.update(output_shapes=[(n + GUARD,)], init_value=POISON)
    out = sa._KERNELS[variant](**args)[0]
    mx.eval(out)
    out = np.array(out)
    guard = out[n:]
    assert np.array_equal(guard, np.full(GUARD, POISON, np.float32)), "kernel wrote past its region"
    assert not np.any(out[:n] == np.float32(POISON)), "kernel left part of its region unwritten"
    assert_same_bytes(out[:n].reshape(B, S, H, 512), kernel_out(variant, inputs, 0.0625), "poisoned run")


@pytest.mark.parametrize("variant", ["serial", "parallel"])
def test_five_repeats_identical(variant):
    inputs = make_inputs(14, 2, 9, 16, 512, 128, 500, 640, F32, BF16, 0.1)
    first = kernel_out(variant, inputs, 512**-0.5)
    for _ in range(4):
        assert_same_bytes(kernel_out(variant, inputs, 512**-0.5), first, f"{variant} repeat")


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "window", "pool"])
def test_misaligned_inputs_same_bytes(which):
    """A view that starts one element past a 16-byte boundary takes the element-load path: the
    same bytes as the aligned array, in both variants."""
    inputs = list(make_inputs(18, 1, 3, 8, 512, 37, 90, 130, BF16, BF16, 0.1))
    moved = list(inputs)
    moved[which] = misaligned(inputs[which])
    scale = 512**-0.5
    serial = kernel_out("serial", moved, scale)
    assert_same_bytes(serial, kernel_out("serial", inputs, scale), "serial, misaligned input")
    assert_same_bytes(kernel_out("parallel", moved, scale), serial, "parallel, misaligned input")
    assert_matches_f64(serial, attention_f64(*as_f64(*inputs), scale), RTOL, ATOL, "misaligned")


def test_tuning_never_changes_bytes(monkeypatch):
    monkeypatch.setattr(sa, "_TUNING", {v: dict(c) for v, c in sa._TUNING.items()})
    inputs = make_inputs(19, 1, 5, 16, 512, 128, 300, 640, BF16, BF16, 0.1)
    scale = 512**-0.5
    reference = kernel_out("serial", inputs, scale)
    for variant in ("serial", "parallel"):
        for name, values in sa.TUNABLE.items():
            for value in values:
                sa.set_tuning(variant, **{name: value})
                assert_same_bytes(kernel_out(variant, inputs, scale), reference, f"{variant} {name}={value}")


# --------------------------------------------------------------------------------------------
# exact arithmetic at 640 keys


def _nearest_f32(x: Fraction) -> np.float32:
    """The float32 nearest to x (ties to even), decided exactly."""
    f = np.float32(float(x))
    for g in (np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))):
        dg, df = abs(Fraction(float(g)) - x), abs(Fraction(float(f)) - x)
        if dg < df or (dg == df and int(g.view(np.uint32)) % 2 == 0):
            f = g
    return f


def test_exact_sums_at_640_keys():
    """Every key row is a permutation of one multiset of small integers and q is constant per head,
    so all logits of a head are equal and exact; every weight is exp(0) = 1, every sum an exact
    integer, and each output is one correctly rounded division: sum_j k_j[d] / (640 + e^{sink-L}),
    with sink = -inf (denominator 640) or sink = L (641)."""
    rng = np.random.default_rng(15)
    D, W, T, H, S, N = 512, 128, 1024, 8, 3, 640
    multiset = rng.choice([-4, -3, -2, -1, 1, 2, 3, 4], D)
    keys = np.stack([rng.permutation(multiset) for _ in range(W + T)]).astype(np.float32)
    c = np.array([1, -1, 2, -2, 1, 3, -1, 1], np.float32)  # q[h] = c[h] * ones
    scale = 2.0**-6
    q = np.broadcast_to(c[None, None, :, None], (1, S, H, D)).astype(np.float32)
    logit = c * float(multiset.sum()) * scale  # exact in float32
    sinks = np.where(np.arange(H) % 2 == 0, -np.inf, logit).astype(np.float32)
    # Realistic selection: the whole window in order, then 512 distinct pool rows, per row.
    indices = np.stack([np.concatenate([np.arange(W), W + rng.choice(T, N - W, replace=False)]) for _ in range(S)])[
        None
    ].astype(np.int32)
    inputs = [
        mx.array(q),
        mx.array(keys[None, :W]).astype(BF16),
        mx.array(keys[None, W:]).astype(BF16),
        mx.array(indices),
        mx.array(sinks),
    ]
    sums = keys[indices[0]].astype(np.int64).sum(axis=1)  # [S, D] exact integer value sums
    expected = np.empty((1, S, H, D), np.float32)
    for h in range(H):
        denom = N if h % 2 == 0 else N + 1
        for s in range(S):
            expected[0, s, h] = [_nearest_f32(Fraction(int(v), denom)) for v in sums[s]]
    for variant in ("serial", "parallel"):
        assert_same_bytes(kernel_out(variant, inputs, scale), expected, f"{variant} exact sums")


# --------------------------------------------------------------------------------------------
# dispatch through sparse_attention


def test_dispatch_counts_and_auto(clean_selection, monkeypatch):
    inputs = make_inputs(16, 1, 1, 64, 512, 128, 512, 640, BF16, BF16)
    scale = 512**-0.5
    outs = {v: np.array(sa.sparse_attention(*inputs, scale, variant=v)) for v in ("serial", "parallel")}
    outs["auto"] = np.array(sa.sparse_attention(*inputs, scale))
    assert_same_bytes(outs["parallel"], outs["serial"], "dispatch parallel")
    assert_same_bytes(outs["auto"], outs["serial"], "dispatch auto")
    counts = sa.variant_counts()
    assert counts["reference"] == 0 and counts["serial"] + counts["parallel"] == 3
    assert min(counts["serial"], counts["parallel"]) >= 1
    choices = sa.auto_choices()
    assert choices and set(choices.values()) <= {"serial", "parallel"}
    assert all(t["serial"] > 0 and t["parallel"] > 0 for t in sa.auto_timings().values())
    assert not any(sa.parallel_refusals().values()), sa.parallel_refusals()
    monkeypatch.setenv(sa.ENV_VAR, "serial")  # read at call time
    before = sa.variant_counts()["serial"]
    mx.eval(sa.sparse_attention(*inputs, scale))
    assert sa.variant_counts()["serial"] == before + 1
    # Head dims the kernels do not take run the reference, and say why.
    mx.eval(sa.sparse_attention(*make_inputs(17, 1, 2, 2, 64, 4, 4, 5), 0.125))
    assert sa.variant_counts()["reference"] == 1
    assert any("head dim 64" in r for r in sa.reference_reasons())
