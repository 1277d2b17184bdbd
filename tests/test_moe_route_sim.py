"""The moe_route kernel body (mlx_dsv41/metal_ext/moe_route.metal) on the CPU simulator: the same choice and
weights as the plain-MLX router (docs/model.md#moe) on Flash's 384 experts top-6 and on small cases,
with a temperature, ties (the lower expert id wins), NaN logits that never win, and untouched
guards. tests/gpu/test_moe_route_gpu.py repeats this on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import moe_route as mr

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

CASES = [  # T, E, k, temperature, scale
    (4, 384, 6, 1.0, 1.5),
    (3, 16, 2, 0.5, 1.0),
    (2, 128, 3, 2.0, 1.5),
]


def _inputs(i, T, E):
    rng = np.random.default_rng(i)
    logits = rng.standard_normal((T, E)).astype(np.float32) * 3
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32)
    return mx.array(logits), mx.array(bias)


@pytest.fixture(scope="module")
def runs():
    specs = [
        (mr.ROUTE, mr.route_args(*_inputs(i, T, E), k, temp, scale, guard=1))
        for i, (T, E, k, temp, scale) in enumerate(CASES)
    ]
    program = exl3_sim.build(specs, mma=True)
    return program, specs


@pytest.mark.parametrize("i", range(len(CASES)))
def test_route_matches_the_reference(runs, i):
    program, specs = runs
    T, E, k, temp, scale = CASES[i]
    idx, wts = program.run(i)
    assert np.all(idx[-1] == -1) and np.all(np.isnan(wts[-1]))  # guard rows: the 0xFF poison
    ref_idx, ref_wts = mr.route_reference(*_inputs(i, T, E), k, temp, scale)
    assert np.array_equal(idx[:-1], np.array(ref_idx))
    np.testing.assert_allclose(wts[:-1], np.array(ref_wts), rtol=2e-6)


def test_ties_go_to_the_lower_id_and_nan_never_wins(runs):
    program, specs = runs
    logits = np.zeros((2, 16), np.float32)
    logits[0, [3, 9, 12]] = 2.0  # a three-way tie for two places: experts 3 and 9
    logits[1, :] = np.nan
    logits[1, [5, 7]] = [1.0, 0.5]
    call = mr.route_args(mx.array(logits), mx.zeros((16,)), 2, 1.0, 1.0, guard=1)
    idx, wts = program.run(1, dict(call, template=specs[1][1]["template"]))
    assert idx[0].tolist() == [3, 9] and np.allclose(wts[0], [0.5, 0.5])
    assert idx[1].tolist() == [5, 7] and np.isfinite(wts[1]).all()
