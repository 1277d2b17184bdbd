"""The rows sparse-attention kernel on the GPU (tensor cores; docs/model.md#attention-rows), with
the kernel contract: the simulator's cases against float64 (random bf16 data, partial key tiles,
-1 and invalid indices, window- and pool-only calls, no keys, NaN / inf in q, keys and sinks);
at Flash's prefill shape (64 heads, dim 512, 128 window keys and 512 picked from an 8,192-row
pool) against float64 and the serial kernel, within the stated bound; five repeats byte-identical;
the launch limit declared; the dispatch taking it when asked or, under auto, from ROWS_AUTO_MIN
query rows on, and falling back to serial where it does not apply."""

import mlx.core as mx
import numpy as np
import pytest
from attention_rows_cases import BOUND, CASES, float64_attention, make_case

from mlx_dsv41.kernels import sparse_attention as sa

pytestmark = pytest.mark.gpu


def _bound_ok(got, want):
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    if finite.any():
        err = np.abs(got[finite] - want[finite]).max() / max(np.abs(want[finite]).max(), 1e-30)
        assert err <= BOUND, err


@pytest.mark.parametrize("name", list(CASES))
def test_cases_against_float64(name):
    inputs = make_case(*CASES[name])
    assert sa.rows_refusal(*inputs[:3]) is None
    runs = [np.array(sa._run("rows", *inputs, 0.0625)) for _ in range(5)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    _bound_ok(runs[0], float64_attention(*inputs, 0.0625))


def test_flash_prefill_shape_against_float64_and_serial():
    rng = np.random.default_rng(11)
    S, H, D, W, T = 24, 64, 512, 128, 8192
    window_part = np.arange(W)
    indices = np.stack([np.concatenate([window_part, W + rng.choice(T, 512, replace=False)]) for _ in range(S)])
    inputs = make_case(3, 1, S, H, D, W, T, 1)
    inputs[3] = mx.array(indices.astype(np.int32)[None])
    scale = D**-0.5
    got = np.array(sa._run("rows", *inputs, scale))
    _bound_ok(got, float64_attention(*inputs, scale))
    serial = np.array(sa._run("serial", *inputs, scale))
    assert np.abs(got - serial).max() <= BOUND * np.abs(serial).max()
    with pytest.raises(ValueError, match="declared limit"):
        sa.ROWS(**dict(sa._launch_args(*inputs, scale, "rows"), threadgroup=(256, 1, 1)))


def test_dispatch_takes_rows_when_asked_and_where_it_applies():
    inputs = make_case(*CASES["dim256-heads32-batch2"])
    sa.reset_variant_counts()
    mx.eval(sa.sparse_attention(*inputs, 0.0625, variant="rows"))
    mx.eval(sa.sparse_attention(inputs[0].astype(mx.float32), *inputs[1:], 0.0625, variant="rows"))  # fp32 q
    mx.eval(sa.sparse_attention(*inputs, 0.0625, variant="auto"))
    counts = sa.variant_counts()
    assert counts["rows"] == 1 and counts["reference"] == 0 and counts["serial"] + counts["parallel"] == 2


def test_auto_takes_rows_from_its_row_count_on():
    """auto: the rows kernel's own bytes from ROWS_AUTO_MIN query rows on, the timed serial /
    parallel choice (serial's bytes) below it."""
    many = make_case(6, 1, sa.ROWS_AUTO_MIN, 16, 512, 16, 64, 40)
    few = [a[:, : sa.ROWS_AUTO_MIN - 1] if i in (0, 3) else a for i, a in enumerate(many)]
    sa.reset_variant_counts()
    got = np.array(sa.sparse_attention(*many, 0.0625, variant="auto"))
    assert sa.variant_counts()["rows"] == 1
    assert np.array_equal(got.view(np.uint32), np.array(sa._run("rows", *many, 0.0625)).view(np.uint32))
    got = np.array(sa.sparse_attention(*few, 0.0625, variant="auto"))
    assert sa.variant_counts()["rows"] == 1
    assert np.array_equal(got.view(np.uint32), np.array(sa._run("serial", *few, 0.0625)).view(np.uint32))
