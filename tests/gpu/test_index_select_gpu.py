"""index_scores / index_select on the GPU with the kernel contract (docs/design.md#index-select): the
scores within their float64 bound, the selection the bytes of the plain-MLX selection on those scores
(ties, -0, NaN and inf, rows past the visible count, every mode), outputs poisoned before launch with
guard rows untouched, five repeats byte-identical, the counters back at 0, the one launch (CUDA) the
bytes of index_scores then index_select, and the model's indexer on the kernel picking what its
reference path picks."""

import mlx.core as mx
import numpy as np
import pytest
from test_index_select_sim import (
    CASES,
    GUARD,
    MODES,
    POISON,
    _fp4,
    float64_scores,
    indexer_picks,
    indexer_steps,
    inputs,
)

from mlx_dsv41.kernels import grid_finish
from mlx_dsv41.kernels import index_select as ix
from mlx_dsv41.model import indexer as ref

pytestmark = pytest.mark.gpu


def _launch(name, mode, counters, finish=True):
    q, w, keys, pos, scale, common = inputs(name, mode)
    call = ix.scores_args(
        q, w, keys, pos, counters, scale=scale, finish=finish, init_value=POISON, guard=GUARD, **common
    )
    outs = ix.SCORES(**call)
    mx.eval(outs)
    return [np.array(o) for o in outs]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_contract(name, mode):
    q, w, keys, pos, scale, common = inputs(name, mode)
    B, S = q.shape[:2]
    R, T = B * S, keys.shape[1]
    counters = grid_finish.split_counters(R)
    runs = [_launch(name, mode, counters) for _ in range(5)]
    assert np.all(np.array(counters) == 0)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    scores, topk, blocks, _ = runs[0]
    assert np.all(scores[R:] == POISON) and np.all(topk[R:] == POISON)
    got = scores[:R].reshape(B, S, T)
    want, size, seen = float64_scores(name, mode)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert np.all(np.abs(got[finite] - want[finite]) <= 2**-21 * size[finite] + 1e-30)
    assert np.all(got[~seen] == -np.inf)
    with mx.stream(mx.cpu):
        ks = mx.array(np.where(np.isnan(got), np.float32(np.nan), got))
        visible = ref.visible_counts(pos, S, common["ratio"])
        if mode == "inside":
            ks = ref.apply_candidate_blocks(ks, common["candidates"], common["block"])
        want_topk = np.array(ref.select_topk(ks, common["k"], visible))
        want_blocks = np.array(ref.select_candidate_blocks(ks, visible, common["block"], common["keep"]))
    assert np.array_equal(topk[:R].reshape(want_topk.shape), want_topk)
    if mode == "build":
        assert np.all(blocks[R:] == bool(POISON))
        assert np.array_equal(blocks[:R].reshape(want_blocks.shape), want_blocks)
    # index_scores then index_select (Metal's two launches) give the same bytes
    two = _launch(name, mode, grid_finish.no_counters(), finish=False)[0]
    assert np.array_equal(two[:R].view(np.uint32), scores[:R].view(np.uint32))
    call = ix.select_args(mx.array(two[:R]), pos, S, init_value=POISON, guard=GUARD, **common)
    topk2, blocks2, _ = (np.array(o) for o in ix.SELECT(**call))
    assert np.array_equal(topk2, topk)
    if mode == "build":
        assert np.array_equal(blocks2, blocks)


def test_the_model_indexer_on_the_kernel_picks_what_its_reference_picks(monkeypatch):
    """Flash's indexer shape (32 heads of 128, k 512, blocks of 8) at a decode row and a verify's 5
    rows against 1,500 entries, FP4 keys, in the three roles: the kernel's picks and block masks are
    the reference path's (its GEMM's sums differ only in order; no two scores here are that close)."""
    from mlx_dsv41.model.indexer import Indexer
    from mlx_dsv41.synthetic import tiny_args

    args = tiny_args(
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        candidate_block_size=8,
        candidate_topk_blocks=64,
        hidden_size=256,
        q_lora_rank=128,
        qk_rope_head_dim=64,
    )
    mx.random.seed(3)
    indexer = Indexer(args, 2)
    mx.eval(indexer.parameters())
    rng = np.random.default_rng(4)
    T = 1500
    keys = mx.array(_fp4(rng.standard_normal((1, T, 128)))).astype(mx.bfloat16)
    steps = indexer_steps(rng, args, 1, ((1, 2950), (5, 2900)))
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(ix, "ENABLED", enabled)
        results[enabled] = indexer_picks(indexer, keys, steps)
    assert results[False][0][0].shape[-1] == 512 and np.sum(results[False][0][1]) == 64  # real selections
    for got, want in zip(results[True], results[False]):
        for g, w in zip(got, want):
            assert np.array_equal(g, w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["flash_decode", "verify_rows", "flash_all_picked"])
def test_the_index_list_on_the_device(name, mode):
    """docs/design.md#index-list on the device: with the attention's window rows (Flash's 128 of a
    160-slot ring, the first two before the start) the one launch and index_select write the
    list [B, S, W + k] = the rows, then the picks plus R with the -1s kept (model/attention.py's
    index_list of the same picks), five launches byte-identical, the guard row untouched, the
    counters back at 0, the picks as without the list."""
    from mlx_dsv41.model.attention import index_list

    q, w, keys, pos, scale, common = inputs(name, mode)
    B, S = q.shape[:2]
    rows = np.random.default_rng(5).integers(0, 160, (S, 128)).astype(np.int32)
    rows[:, :2] = -1
    rows = mx.array(rows)
    counters = grid_finish.split_counters(B * S)
    listed = dict(common, window=(rows, 160))
    call = ix.scores_args(q, w, keys, pos, counters, scale=scale, init_value=POISON, guard=GUARD, **listed)
    runs = []
    for _ in range(5):
        outs = ix.SCORES(**call)
        mx.eval(outs)
        runs.append([np.array(o) for o in outs])
    assert all(np.array_equal(r[3], runs[0][3]) and np.array_equal(r[1], runs[0][1]) for r in runs[1:])
    assert np.all(np.array(counters) == 0)
    scores, topk, _, got = runs[0]
    plain = ix.scores_args(q, w, keys, pos, counters, scale=scale, init_value=POISON, guard=GUARD, **common)
    assert np.array_equal(np.array(ix.SCORES(**plain)[1]), topk)
    want = np.array(index_list(rows, mx.array(topk[: B * S]).reshape(B, S, -1), 160)).reshape(B * S, -1)
    assert np.array_equal(got[: B * S], want) and np.all(got[B * S :] == POISON)
    select = ix.select_args(mx.array(scores[: B * S]), pos, S, init_value=POISON, guard=GUARD, **listed)
    assert np.array_equal(np.array(ix.SELECT(**select)[2]), got)
