"""moe_route on the GPU (issue 16), with the kernel contract: the reference router's choice and
weights at Flash's 384 experts top-6 (and small cases, a temperature); nonfinite logits (NaN never
wins, +inf does); outputs poisoned before launch with guard rows untouched; five repeats
byte-identical; a token's result does not depend on the other tokens."""

import mlx.core as mx
import numpy as np
import pytest
from test_moe_route_sim import CASES, _inputs

from mlx_dsv41.kernels import moe_route as mr

pytestmark = pytest.mark.gpu


def _kernel(logits, bias, k, temp, scale, guard=0):
    idx, wts = mr.ROUTE(**mr.route_args(logits, bias, k, temp, scale, init_value=-1.0, guard=guard))
    return np.array(idx), np.array(wts)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_route_matches_the_reference_on_the_gpu(i):
    T, E, k, temp, scale = CASES[i]
    logits, bias = _inputs(100 + i, 9, E)
    idx, wts = mr.route(logits, bias, k, temp, scale)
    ref_idx, ref_wts = mr.route_reference(logits, bias, k, temp, scale)
    assert np.array_equal(np.array(idx), np.array(ref_idx))
    np.testing.assert_allclose(np.array(wts), np.array(ref_wts), rtol=3e-6)


def test_route_contract():
    logits, bias = _inputs(7, 6, 384)
    runs = [_kernel(logits, bias, 6, 1.0, 1.5, guard=2) for _ in range(5)]
    for idx, wts in runs:
        assert np.array_equal(idx, runs[0][0]) and np.array_equal(wts.view(np.uint32), runs[0][1].view(np.uint32))
    assert np.all(runs[0][0][6:] == -1) and np.all(runs[0][1][6:] == -1.0)
    solo = _kernel(logits[3:4], bias, 6, 1.0, 1.5)
    assert np.array_equal(solo[0], runs[0][0][3:4]) and np.array_equal(solo[1], runs[0][1][3:4])
    raw = np.array(logits)
    raw[0, 10], raw[0, 20], raw[1, :] = np.nan, np.inf, np.nan
    raw[1, [1, 2]] = [0.0, 1.0]
    idx, wts = _kernel(mx.array(raw), mx.zeros((384,)), 6, 1.0, 1.5)
    assert 20 in idx[0] and 10 not in idx[0]
    assert {1, 2} <= set(idx[1].tolist())
