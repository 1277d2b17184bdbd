"""Scratch outputs held by the caller (docs/design.md#held-scratch) on the device: at Flash's shapes
the expand-site, the site and the router that finish themselves, and k-split EXL3 linears (plain,
normed, paired) of a module, give the same bytes with their part sums written into held buffers
as with MLX's outputs, five times over the same buffers (a launch that read part sums it had not
written this time would read the last launch's); the launches are built with the held inputs."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import kernels
from mlx_dsv41.exl3 import ops
from mlx_dsv41.exl3.synthetic import random_linear_tensors
from mlx_dsv41.kernels import exl3 as launch
from mlx_dsv41.kernels import grid_finish
from mlx_dsv41.kernels import hyper_connections as hc
from mlx_dsv41.kernels import moe_route as mr
from tests.gpu.test_grid_finish_gpu import EPS, HC, HC_EPS, ITERS, NORM_EPS, D, _bytes, _site_inputs

pytestmark = pytest.mark.gpu
SITE_KW = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)


def _flash_steps(scratch):
    """An expand-site, a site and the router at Flash's shapes (one token), with ``scratch``."""
    streams, fn, base, scale, prev, weight = _site_inputs(1, 7)
    rng = np.random.default_rng(8)
    y = mx.array(rng.standard_normal((1, D)).astype(np.float32)).astype(mx.bfloat16)
    m = mx.array(rng.uniform(0.2, 1.0, (1, (2 + HC) * HC)).astype(np.float32))
    w = mx.array((rng.standard_normal((384, D)) / 64).astype(np.float32)).astype(mx.bfloat16)
    bias = mx.array(rng.standard_normal(384).astype(np.float32) / 10)
    site = (prev, weight, EPS, fn, base, scale)
    counters = grid_finish.split_counters(1)
    new, x, out = hc.expand_site(y, streams, m, *site, **SITE_KW, counters=counters, scratch=scratch)
    x2, out2 = hc.site(new, *site, **SITE_KW, counters=counters, scratch=scratch)
    idx, wts = mr.gate(x2, w, bias, 6, 1.0, 2.5, counters=counters, scratch=scratch)
    return _bytes([new, x, out, x2, out2, idx, wts])


def test_the_site_launches_give_the_same_bytes_with_their_scratch_held():
    assert kernels.HOLDS_SCRATCH and kernels.backend() == "cuda"
    plain = _flash_steps(None)
    scratch = grid_finish.Scratch(SimpleNamespace(), "site")
    for _ in range(5):
        assert _flash_steps(scratch) == plain
    held = scratch.owner._finish_scratch
    assert {k[0] for k in held} == {"site.mm", "site.parts", "site.logits"}


@pytest.mark.parametrize("m, k, n, bits", [(1, 4096, 1024, 3), (3, 2048, 512, 4)])
def test_a_modules_k_split_linears_give_the_same_bytes_with_their_scratch_held(m, k, n, bits):
    """ops.linear, normed_linear and paired_linear with an owner (held part sums) and without."""
    t1, t2 = (random_linear_tensors(k, n, bits, "mul1", seed=90 + m + i) for i in range(2))
    first = (mx.array(t1["trellis"]), mx.array(t1["suh"]), mx.array(t1["svh"]), "mul1")
    second = (mx.array(t2["trellis"]), mx.array(t2["suh"]), mx.array(t2["svh"]), "mul1")
    rng = np.random.default_rng(m)
    x = mx.array(rng.normal(0, 1, (m, k)).astype(np.float32)).astype(mx.bfloat16)
    weight = mx.array(rng.normal(1, 0.5, n).astype(np.float32)).astype(mx.bfloat16)
    assert launch.normed_gemv_fits(x, first[0]) and launch.paired_gemv_fits(x, (*first, None), (*second, None))

    def run(owner):
        y = ops.linear(x, *first, owner=owner)
        yn = ops.normed_linear(x, *first, weight, 1e-6, owner=owner)
        ya, yb = ops.paired_linear(x, (*first, None, None), (*second, None, None), owner=owner)
        return _bytes([y, yn, ya, yb])

    plain, owner = run(None), SimpleNamespace()
    for _ in range(5):
        assert run(owner) == plain
    assert {key[0] for key in owner._finish_scratch} == {".out", "pair.out"}
