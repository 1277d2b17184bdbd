"""Arrays a step reads that do not depend on its inputs are evaluated once, when made: a lazy view of
a constant (a weight with a new axis, a bf16 fill viewed from its bits) would otherwise be a graph
node that every compiled step replays, host time per token for nothing (docs/design.md#constant-views).
Each check here failed before its fix: the shared expert's nine views a layer, the NaN fills of the
attention's empty key sets, the indexer's position rows."""

import sys

import mlx.core as mx
import numpy as np
from demo_helpers import REPO, cache_dir, demo_checkpoint

from mlx_dsv41 import graph_constants
from mlx_dsv41.exl3.linear import EXL3Linear
from mlx_dsv41.exl3.synthetic import random_linear_tensors
from mlx_dsv41.model import indexer

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_graph  # noqa: E402


def _constant_nodes(fn, *inputs) -> list[str]:
    """The primitives of fn's compiled replay that depend on none of its inputs: work every replay
    repeats though its result never changes."""
    compiled = mx.compile(fn)
    mx.eval(compiled(*inputs))  # the trace
    out = compiled(*inputs)
    return sorted(gpu_graph.constant_nodes(list(out) if isinstance(out, (list, tuple)) else [out], inputs).elements())


def _primitives(*arrays) -> list[str]:
    """The primitives evaluating `arrays` would run (none for arrays that hold their values)."""
    return sorted(gpu_graph.primitives(*arrays).elements())


def test_the_shared_experts_single_expert_views_hold_their_values_and_share_the_weights():
    lin = EXL3Linear.from_stored(random_linear_tensors(256, 128, 3, seed=4, prefix="p"), "p")
    proj = lin.as_single_expert()
    views = [proj.groups[0].trellis, proj.suh, proj.svh]
    assert _primitives(*views) == []
    assert np.array_equal(np.array(views[0][0]), np.array(lin.trellis))
    assert proj is lin.as_single_expert()  # made once


def test_made_inside_a_compiled_trace_they_are_constants_of_the_trace():
    lin = EXL3Linear.from_stored(random_linear_tensors(256, 128, 3, seed=5, prefix="p"), "p")

    def step(x):  # the views first made here, inside the trace
        proj = lin.as_single_expert()
        return x.astype(mx.float16) + proj.suh, x.astype(mx.float16)[:, :128] * proj.svh

    assert _constant_nodes(step, mx.ones((1, 256))) == []  # before the fix: two ExpandDims
    assert _primitives(lin.as_single_expert().groups[0].trellis) == []


def test_a_bf16_fill_holds_its_values():
    nan = graph_constants.full((1, 1, 64), float("nan"), mx.bfloat16)
    assert _primitives(nan) == [] and np.all(np.isnan(np.array(nan.astype(mx.float32))))


def test_the_indexers_masks_read_the_position_rows_without_a_view():
    scores = mx.array(np.random.default_rng(1).standard_normal((1, 2, 40)).astype(np.float32))
    visible = mx.array([17, 18], mx.int32)
    q, w = mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4))
    keys = mx.ones((1, 40, 8))
    assert _constant_nodes(indexer.index_scores, q, w, keys, visible) == []
    assert _constant_nodes(lambda s, v: indexer.select_candidate_blocks(s, v, 8, 2), scores, visible) == []
    got = np.array(indexer.index_scores(q, w, keys, visible))
    assert np.all(np.isinf(got[0, 0, 17:])) and np.all(np.isfinite(got[0, 0, :17]))
    assert np.all(np.isfinite(got[0, 1, :18])) and np.all(np.isinf(got[0, 1, 18:]))


def test_the_cpu_reference_linears_replay_no_work_on_their_weights():
    """The CPU path of an EXL3 linear, a grouped linear (wo_a) and the gathered experts: W̃, suh and
    svh (float32) and each group's slices are held once made, and gather_mm's row indices are a
    constant, so a compiled replay evaluates nothing that no input reaches (before: a cast of suh
    and of svh per call, three slices per group, an arange per gather_mm)."""
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.exl3.experts import EXL3ExpertProjection
    from mlx_dsv41.exl3.stored import linear_tensors

    lin = EXL3Linear.from_stored(random_linear_tensors(256, 128, 3, seed=6, prefix="p"), "p")
    x = mx.array(np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)).astype(mx.bfloat16)
    want = lin(x)  # eager: holds W̃, suh, svh
    assert _constant_nodes(lin, x) == []
    assert np.array_equal(np.array(mx.compile(lin)(x).astype(mx.float32)), np.array(want.astype(mx.float32)))
    slices = [random_linear_tensors(128, 64, 2 + g, seed=10 + g, prefix="p") for g in range(3)]
    proj = EXL3ExpertProjection.from_experts([linear_tensors(t, "p") for t in slices], 128, 64)
    xg = mx.array(np.random.default_rng(3).standard_normal((2, 3, 128)).astype(np.float32)).astype(mx.bfloat16)
    want = ops.grouped(xg, proj)
    assert _constant_nodes(lambda v: ops.grouped(v, proj), xg) == []
    assert np.array_equal(np.array(ops.grouped(xg, proj).astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_the_demos_gpu_step_replays_almost_nothing_that_no_input_reaches(tmp_path_factory, monkeypatch):
    """The whole compiled decode step as a GPU builds it (benchmarks/gpu_graph.py: kernels as
    stand-ins, on this CPU): no view of a constant, and no more constant-only nodes than the 8
    known (weight transposes before matmuls, a cast and an add of index constants). Before the
    fixes: the shared expert's 9 views a layer, the fills' bf16 views, the open compression
    group's row gather rebuilding its index (an arange and casts) at every step."""
    from mlx_dsv41.demo import CACHE_ENV

    demo_checkpoint(tmp_path_factory)
    monkeypatch.setenv(CACHE_ENV, str(cache_dir(tmp_path_factory)))
    monkeypatch.setenv("MLX_DSV41_COMPILE", "1")  # count() sets it; restored after the test
    r = gpu_graph.count(3, 12, True, False, demo=True)
    assert r["kernels"] > 100  # the GPU path was counted
    constant = r["constant_nodes"]
    assert not {"ExpandDims", "View bfloat16", "Broadcast"} & set(constant), constant
    assert sum(constant.values()) <= 8, constant


def test_a_grouped_linear_reshapes_its_rows_once_each_way_on_a_gpu():
    """wo_a's GPU path (benchmarks/gpu_graph.py's stand-in kernels): x [B, S, G, in] becomes the
    kernels' rows [B·S·G, in] and their output [..., G, out] in one Reshape each (before: four, by
    way of [T, G, in] and back), each a graph node a decode step evaluates."""
    from mlx_dsv41.exl3.experts import EXL3ExpertProjection, EXL3GroupedLinear
    from mlx_dsv41.exl3.stored import linear_tensors

    slices = [random_linear_tensors(128, 64, 2 + g, seed=30 + g, prefix="p") for g in range(3)]
    layer = EXL3GroupedLinear(EXL3ExpertProjection.from_experts([linear_tensors(t, "p") for t in slices], 128, 64))
    x = mx.array(np.random.default_rng(4).standard_normal((1, 2, 3, 128)).astype(np.float32)).astype(mx.bfloat16)
    with gpu_graph.gpu_graph_on_cpu(gpu_graph.Recorder()):
        y = layer(x)
    assert y.shape == (1, 2, 3, 64) and gpu_graph.primitives(y)["Reshape"] == 2
