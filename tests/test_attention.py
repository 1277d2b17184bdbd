"""CSA2 attention (docs/model.md#attention): norms, compressor, indexer and selection, and a stack
of layers with every attention role, against the float64 numpy reference in attention_stack.py.

Tolerances. The reference rounds to bf16 where the model does and computes the rest in float64;
the model computes the rest in fp32. An fp32 result rarely lands on the other side of a bf16
rounding boundary than the float64 one; such a flip moves one intermediate value by one bf16 ulp.
Teacher-forced (each reference layer fed the model's input), measured over 12 seeds: every layer
within 0.27% of its output scale, every published FP8/FP4 value, top-k and candidate block
identical; asserted: 2^-7 and identical (attention_stack.check_against_reference). End to end the
flips compound and can flip an FP4 value or a top-k pick downstream, so the whole stack is held to
a rounding-level bound (attention_stack.assert_rounding_level).

Decode, chunked prefill and batching change only how rows are grouped; every row's arithmetic is
the same (same key order, -1 padding in the same columns, deterministic top-k ties), so with
MLX's Linux CPU backend they agree bit for bit, which is asserted there. Elsewhere (e.g. Metal,
whose GEMMs change with the row count) they are held to a rounding-level bound
(attention_stack.assert_rows_match).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.utils
import numpy as np
import pytest
from attention_stack import (
    ReferenceStack,
    assert_rows_match,
    build_stack,
    check_against_reference,
    f64,
    make_caches,
    random_input,
    rb,
    ref_candidate_blocks,
    ref_select_topk,
    run_chunks,
    run_stack,
    tiny_args,
)

from mlx_dsv41.cache import LayerCache, make_layer_cache
from mlx_dsv41.model import indexer as indexer_module
from mlx_dsv41.model.attention import Attention
from mlx_dsv41.model.compressor import Compressor, pool_groups
from mlx_dsv41.model.indexer import (
    apply_candidate_blocks,
    index_scores,
    select_candidate_blocks,
    select_topk,
)
from mlx_dsv41.model.norm import RMSNorm

SEQ = 24  # > 2 · window; ratio-2 pools reach 12 entries, ratio-1 pools 24 (index_topk is 4)


@pytest.fixture(scope="module")
def args():
    return tiny_args()


@pytest.fixture(scope="module")
def stack(args):
    return build_stack(args, seed=0)


# ---------------------------------------------------------------- norm


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rms_norm_is_fp32_with_eps_1e20(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[1] *= 1e-15  # mean(x²) ~ 1e-30 << 1e-20: eps decides this row (1e-6 would flatten it)
    norm = RMSNorm(64, 1e-20)
    norm.weight = mx.array(1 + 0.3 * rng.standard_normal(64).astype(np.float32)).astype(mx.bfloat16)
    xin = mx.array(x).astype(dtype)
    got = norm(xin)
    assert got.dtype == dtype
    xd, wd = f64(xin), f64(norm.weight)
    want = xd / np.sqrt(np.mean(xd * xd, axis=-1, keepdims=True) + 1e-20) * wd
    if dtype == mx.bfloat16:
        assert np.abs(f64(got) - rb(want)).max() <= 2.0**-8 * np.abs(want).max()
    else:
        assert np.allclose(f64(got), want, rtol=2e-6, atol=0)


# ---------------------------------------------------------------- compressor


def test_pool_groups_is_a_per_channel_softmax_over_each_group():
    rng = np.random.default_rng(1)
    kv, gate = rng.standard_normal((2, 3, 12, 8)).astype(np.float32) * [[[[1.0]]], [[[4.0]]]]
    got = f64(pool_groups(mx.array(kv), mx.array(gate), 2))
    a, g = kv.astype(np.float64).reshape(3, 6, 2, 8), gate.astype(np.float64).reshape(3, 6, 2, 8)
    p = np.exp(g) / np.exp(g).sum(2, keepdims=True)
    assert np.allclose(got, (a * p).sum(2), rtol=1e-5, atol=1e-6)


def _compress_in_calls(comp: Compressor, cache: LayerCache, x: mx.array, sizes):
    latents, s0 = [], 0
    for n in sizes:
        lat, first = comp(x[:, s0 : s0 + n], cache)
        assert first == cache.offset // comp.ratio
        expected = (cache.offset + n) // comp.ratio - first
        assert (0 if lat is None else lat.shape[1]) == expected
        if lat is not None:
            latents.append(lat)
        cache.advance(n)
        s0 += n
    return mx.concatenate(latents, axis=1)


@pytest.mark.parametrize("layer", [1, 3], ids=["ratio2", "ratio1"])
def test_compressor_matches_float64_and_carries_pending_groups(args, stack, layer):
    comp = stack[layer].compressor
    x = random_input(args, 2, 11, seed=5)
    one = _compress_in_calls(comp, make_layer_cache(args, layer), x, [11])
    split = _compress_in_calls(comp, make_layer_cache(args, layer), x, [3, 1, 1, 4, 2])
    assert mx.array_equal(one, split)  # odd chunks leave open groups that the next call closes
    ref = ReferenceStack(args, stack)
    for b in range(2):
        want = ref.latents(ref.w[layer], f64(x)[b], comp.ratio)
        assert np.abs(f64(one)[b] - want).max() <= 2.0**-7 * np.abs(want).max()


# ---------------------------------------------------------------- indexer


def _tied_scores(rng, shape, visible):
    """Scores on a coarse grid (many exact ties, as ReLU + FP4 produce), -inf past `visible`."""
    s = np.round(rng.standard_normal(shape) * 2) / 2
    s[rng.random(shape) < 0.3] = 0.0
    T = shape[-1]
    return np.where(np.arange(T)[None, None, :] < visible[None, :, None], s, -np.inf).astype(np.float32)


def test_index_scores_match_float64():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 5, 3, 32)).astype(np.float32)
    w = rng.standard_normal((2, 5, 3)).astype(np.float32)
    keys = rng.standard_normal((2, 9, 32)).astype(np.float32)
    visible = np.array([0, 2, 5, 9, 9])
    got = f64(index_scores(mx.array(q), mx.array(w), mx.array(keys), visible))
    want = np.einsum("bsh,bshj->bsj", w.astype(np.float64), np.maximum(np.einsum("bshd,bjd->bshj", q, keys), 0))
    seen = np.arange(9)[None, None, :] < visible[None, :, None]
    assert np.all(got[~np.broadcast_to(seen, got.shape)] == -np.inf)
    assert np.allclose(
        got[np.broadcast_to(seen, got.shape)], want[np.broadcast_to(seen, want.shape)], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("T, k", [(13, 4), (13, 13), (5, 5), (1, 1)])
def test_select_topk_ties_by_lower_index_ascending_and_drops_invisible(T, k):
    rng = np.random.default_rng(T + k)
    visible = np.array([0, 1, 3, T, T, T])
    scores = _tied_scores(rng, (2, 6, T), visible)
    scores[1, 4, : T // 2] = -np.inf  # visible but masked (candidate blocks): still pickable
    got = np.array(select_topk(mx.array(scores), k, visible))
    for b in range(2):
        for s in range(6):
            assert got[b, s].tolist() == ref_select_topk(scores[b, s].tolist(), k, visible[s]), (b, s)
    if k > T - T // 2:
        assert 0 in got[1, 4]  # a masked visible entry filled the top-k, as in the reference
    assert np.all(got[:, 0] == -1)  # nothing visible yet


def test_candidate_blocks_pin_the_newest_block_and_drop_invisible_ones():
    rng = np.random.default_rng(3)
    T, block, keep = 11, 2, 3
    visible = np.array([0, 1, 2, 3, 5, 8, 11, 11])
    scores = _tied_scores(rng, (2, 8, T), visible)
    scores[0, 6, 10] = -50.0  # newest (partial) block scores worst but must be kept
    got = np.array(select_candidate_blocks(mx.array(scores), visible, block, keep))
    assert got.shape == (2, 8, 6)
    for b in range(2):
        for s in range(8):
            assert set(np.flatnonzero(got[b, s])) == ref_candidate_blocks(
                scores[b, s].tolist(), visible[s], block, keep
            )
    assert got[0, 6, 5] and not got[:, 0].any() and got[:, 1].sum(-1).tolist() == [1, 1]
    masked = np.array(apply_candidate_blocks(mx.array(scores), mx.array(got), block))
    inside = np.repeat(got, block, axis=-1)[..., :T]
    assert np.array_equal(masked, np.where(inside, scores, -np.inf))


def test_indexer_row_chunks_do_not_change_the_selection(args, stack, monkeypatch):
    x = random_input(args, 2, SEQ, seed=7)
    whole = run_stack(stack, make_caches(args), x)
    monkeypatch.setattr(indexer_module, "_SCORE_CHUNK_ELEMENTS", 1)  # one query row per chunk
    assert mx.array_equal(run_stack(stack, make_caches(args), x), whole)


# ---------------------------------------------------------------- the stack vs float64


@pytest.mark.parametrize("seed", [0, 2, 10])
def test_stack_matches_float64_reference(args, seed):
    check_against_reference(args, build_stack(args, seed), random_input(args, 1, SEQ, seed))


def test_config_exercises_every_selection_stage(args, stack):
    _, shared = ReferenceStack(args, stack)(f64(random_input(args, 1, SEQ, 0))[0])
    assert len(shared["kv.1"]) == SEQ // 2 > args.index_topk and len(shared["kv.3"]) == SEQ
    # The candidate source keeps 3 of up to 12 blocks: rows late in the sequence are filtered ...
    assert min(len(b) for b in shared["candidates.3"][-8:]) == args.candidate_topk_blocks
    # ... and the Reindex layer's top-k differs from what it would pick without the mask.
    unmasked = [
        ref_select_topk([s if j < t + 1 else -np.inf for j, s in enumerate(row)], args.index_topk, t + 1)
        for t, row in enumerate(shared["scores.5"])
    ]
    assert unmasked != shared["topk.5"]
    # Ties at zero happen (ReLU + FP4) and are broken by index.
    assert (shared["scores.1"] == 0).sum() > 0


# ---------------------------------------------------------------- decode, chunks, batch


def test_decode_one_token_at_a_time_equals_prefill(args, stack):
    x = random_input(args, 2, SEQ, seed=11)
    prefill = run_stack(stack, make_caches(args), x)
    decode = run_chunks(stack, make_caches(args), x, [1] * SEQ)
    assert_rows_match(decode, prefill, "decode vs prefill")


@pytest.mark.parametrize("chunk", range(1, 2 * 8 + 1))
def test_chunked_prefill_equals_one_prefill(args, stack, chunk):
    x = random_input(args, 1, SEQ, seed=12)
    whole = run_stack(stack, make_caches(args), x)
    sizes = [chunk] * (SEQ // chunk) + ([SEQ % chunk] if SEQ % chunk else [])
    assert_rows_match(run_chunks(stack, make_caches(args), x, sizes), whole, f"chunks of {chunk}")


def test_batched_equals_each_sequence_alone(args, stack):
    x = random_input(args, 2, SEQ, seed=13)
    both = run_chunks(stack, make_caches(args), x, [10, 1, 1, 12])
    for b in range(2):
        alone = run_chunks(stack, make_caches(args), x[b : b + 1], [10, 1, 1, 12])
        assert_rows_match(both[b : b + 1], alone, f"batch row {b}")


# ---------------------------------------------------------------- shared state


def test_disabling_the_compressed_path_changes_the_output(args, stack):
    x = random_input(args, 1, SEQ, seed=14)
    with_pool = f64(run_stack(stack, make_caches(args), x))
    for layer in stack:
        layer.attend_compressed = False
    try:
        window_only = f64(run_stack(stack, make_caches(args), x))
    finally:
        for layer in stack:
            layer.attend_compressed = True
    # Every row changes clearly (ratio-1 layers see an entry from position 0 on: j < (t+1)//1).
    diff = np.abs(with_pool - window_only).max(-1)[0]
    assert (diff > 0.05 * np.abs(with_pool).max()).all(), diff


def test_an_index_list_from_the_indexer_is_what_every_layer_of_its_source_attends_to(args, stack, monkeypatch):
    """docs/design.md#index-list: where a scoring layer's indexer returns the attention's index list
    (the GPU kernel; here the Indexer wrapped to return index_list of its own picks, made apart),
    that layer and every Reuse layer of the same source attend to it (none builds its own), and the
    stack's output bytes are the same as with each layer building the list, over decode steps and
    a chunk."""
    from mlx_dsv41.model import attention as attention_module
    from mlx_dsv41.model.indexer import Indexer

    x = random_input(args, 2, SEQ, seed=15)
    want = run_chunks(stack, make_caches(args), x, [10, 1, 1, 12])
    built, plain_call, plain_list = [], Indexer.__call__, attention_module.index_list

    def with_list(self, *a, window=None, **kw):
        topk, blocks, _ = plain_call(self, *a, window=window, **kw)
        rows, R = window
        return topk, blocks, plain_list(rows, topk + 0, R)

    def counted(*a):
        built.append(1)
        return plain_list(*a)

    monkeypatch.setattr(Indexer, "__call__", with_list)
    got = run_chunks(stack, make_caches(args), x, [10, 1, 1, 12])
    assert np.array_equal(np.array(got.view(mx.uint16)), np.array(want.view(mx.uint16)))
    monkeypatch.setattr(attention_module, "index_list", counted)
    run_stack(stack, make_caches(args), x[:, :3])
    assert built == []  # every compressed layer read its source's list


def test_owners_publish_their_running_index_keys_every_step(args, stack):
    def first_two(x, caches):  # layers 0 and 1 as run_stack runs them; layer 1's published state
        shared: dict = {}
        h = x + stack[0](x, caches[0], shared)
        stack[1](h, caches[1], shared)
        return shared

    x = random_input(args, 1, 6, seed=15)
    whole = first_two(x, make_caches(args))["index_keys.1"]  # entries 0..2
    for done in (5, 4):  # the 6th token closes group 2; the 5th opens it (no new key)
        caches = make_caches(args)
        first_two(x[:, :done], caches)
        published = first_two(x[:, done : done + 1], caches)["index_keys.1"]
        assert published is caches[1].index_keys  # published on every call
        n = (done + 1) // 2
        assert mx.array_equal(published[:, :n], whole[:, :n])


def test_reading_a_source_that_has_not_run_is_a_clear_error(args, stack):
    with pytest.raises(KeyError, match="layer 2 reads 'kv.1', but layer 1 has not run in this forward pass"):
        stack[2](random_input(args, 1, 3, seed=0), make_layer_cache(args, 2), {})


def test_wrong_inputs_are_clear_errors(args, stack):
    with pytest.raises(ValueError, match=r"Attention 1: its cache must come from make_layer_cache\(args, 1\)"):
        stack[1](random_input(args, 1, 3, seed=0), make_layer_cache(args, 2), {})
    with pytest.raises(ValueError, match=r"Attention 0: x must be \[B, S, 64\]"):
        stack[0](mx.zeros((1, 3, 32), mx.bfloat16), make_layer_cache(args, 0), {})


def test_attention_module_names_are_the_checkpoint_names(args, stack):
    names = {k for k, _ in mlx.utils.tree_flatten(stack[3].parameters())}
    assert names == {
        "wq_a.weight",
        "q_norm.weight",
        "wq_b.weight",
        "wkv.weight",
        "kv_norm.weight",
        "wo_a.weight",
        "wo_b.weight",
        "attn_sink",
        "compressor.wkv.weight",
        "compressor.norm.weight",
        "indexer.wq_b.weight",
        "indexer.weights_proj.weight",
        "indexer.wk.weight",
        "indexer.k_norm.weight",
    }
    assert "compressor.wgate.weight" in dict(mlx.utils.tree_flatten(stack[1].parameters()))
    reindex = {k for k, _ in mlx.utils.tree_flatten(stack[5].parameters())}
    assert {k for k in reindex if "indexer" in k} == {"indexer.wq_b.weight", "indexer.weights_proj.weight"}
    assert not any("compressor" in k or "indexer" in k for k, _ in mlx.utils.tree_flatten(stack[2].parameters()))
    assert isinstance(Attention(args, 0).rope.frequencies, np.ndarray)
