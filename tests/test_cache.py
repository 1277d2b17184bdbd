"""Per-layer caches and the Engram history (docs/cache.md#decode-state, docs/cache.md#open-groups):
window ring, open compression groups, compressed entries, exact trim, and the mlx-lm cache contract
(save / load round trips).

Unit tests fill the caches with position-coded values (value = position + 1000 · batch row), so
what a cache returns or still holds can be read off the values themselves."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import (
    assert_rows_match,
    build_stack,
    make_caches,
    random_input,
    run_chunks,
    run_stack,
    tiny_args,
)

from mlx_dsv41.cache import (
    EngramHistory,
    LayerCache,
    make_layer_cache,
    register_with_mlx_lm,
    ring_slots,
    store_rows,
)


def _coded(first: int, n: int, batch: int = 2, width: int = 4) -> mx.array:
    pos = first + np.arange(n)
    vals = pos[None, :, None] + 1000 * np.arange(batch)[:, None, None] + np.zeros((1, 1, width))
    return mx.array(vals.astype(np.float32))


def _check_window(cache: LayerCache, S: int):
    o, W = cache.offset, cache.window_size
    window, rows = cache.update_window(_coded(o, S))
    window, rows = np.array(window), np.array(rows)
    assert rows.shape == (S, W)
    for s in range(S):
        for c in range(W):
            p = o + s - W + 1 + c
            if p < 0:
                assert rows[s, c] == -1
            else:
                assert np.all(window[:, rows[s, c], 0] == p + 1000 * np.arange(2)), (o, s, c)
    cache.advance(S)


def _held_ring_positions(cache: LayerCache) -> set[int]:
    ring = np.array(cache.ring)[0, :, 0]
    return {int(v) for v in ring if v < cache.offset and int(v) % cache.ring_size == list(ring).index(v)}


def test_window_ring_serves_every_query_its_window_across_wraps_and_big_chunks():
    cache = LayerCache(window=4, trim_slack=2)  # ring of 6 slots
    for S in [3, 1, 9, 2, 1, 7, 6, 1]:
        _check_window(cache, S)


def test_open_groups_are_carried_across_calls():
    cache = LayerCache(window=4, ratio=2, owns_kv=True, trim_slack=3)
    for S in [3, 1, 1, 4, 2, 5, 1]:
        o = cache.offset
        kv, gate = cache.group_inputs(_coded(o, S), -_coded(o, S))
        start = o - o % 2
        want = np.arange(start, o + S)
        assert np.array_equal(np.array(kv)[0, :, 0], want) and np.array_equal(np.array(gate)[0, :, 0], -want)
        cache.advance(S)
        ring = np.array(cache.raw_kv)[0, :, 0]  # fixed size; position p in slot p mod capacity
        Q = cache.raw_capacity
        assert ring.shape == (Q,) and cache.raw_from == max(0, cache.offset - Q)
        assert all(ring[p % Q] == p for p in range(cache.raw_from, cache.offset))


def test_compressed_entries_grow_in_steps_and_keep_their_values():
    cache = LayerCache(window=4, ratio=1, owns_kv=True)
    cache.step = 4
    capacities = []
    for n in [3, 3, 5, 1]:
        kv, keys = cache.append_compressed(_coded(cache.offset, n), _coded(cache.offset, n, width=2) * 2)
        cache.advance(n)
        capacities.append(cache.kv.shape[1])
        assert kv is cache.kv and kv.shape[1] == cache.capacity >= cache.offset  # the whole buffer
        assert np.array_equal(np.array(kv)[0, : cache.offset, 0], np.arange(cache.offset))
        assert np.array_equal(np.array(keys)[1, : cache.offset, 0], 2 * (np.arange(cache.offset) + 1000))
    assert capacities == [4, 8, 16, 16]  # doubled, in steps: few shapes for a compiled step
    assert cache.append_compressed(None, None)[0].shape[1] == 16
    assert LayerCache(window=4, ratio=2, owns_kv=True).append_compressed(None, None) == (None, None)


def _exact_trim_limit(cache: LayerCache) -> int:
    """The largest n whose trimmed cache still holds what the next token needs, read from the
    position-coded contents: window positions o'-W+1 .. o'-1 and the open group's raw rows."""
    held = _held_ring_positions(cache)
    raw = set() if cache.raw_kv is None else {int(v) for v in np.array(cache.raw_kv)[0, :, 0]}
    n = 0
    while n < cache.offset:
        o = cache.offset - (n + 1)
        needs_window = set(range(max(0, o - cache.window_size + 1), o))
        needs_raw = set(range(o - o % cache.ratio, o)) if cache.raw_capacity else set()
        if not (needs_window <= held and needs_raw <= raw):
            break
        n += 1
    return n


@pytest.mark.parametrize("ratio", [0, 1, 2])
def test_max_trim_is_exactly_what_the_held_rows_allow(ratio):
    cache = LayerCache(window=4, ratio=ratio, owns_kv=ratio > 0, trim_slack=3)
    for S in [1, 2, 1, 5, 1, 1, 3, 1, 1, 1, 8, 1]:
        o = cache.offset
        cache.update_window(_coded(o, S))
        if cache.raw_capacity:
            cache.group_inputs(_coded(o, S), _coded(o, S))
        cache.advance(S)
        assert cache.max_trim() == _exact_trim_limit(cache) >= min(cache.offset, cache.trim_slack)


def test_trim_beyond_the_slack_is_an_error_and_small_trims_are_exact():
    cache = LayerCache(window=4, ratio=2, owns_kv=True, trim_slack=3)
    cache.update_window(_coded(0, 20)), cache.group_inputs(_coded(0, 20), _coded(0, 20)), cache.advance(20)
    limit = cache.max_trim()
    with pytest.raises(ValueError, match=rf"LayerCache.trim\({limit + 1}\): only the last {limit} tokens"):
        cache.trim(limit + 1)
    assert cache.offset == 20 and cache.trim(0) == 0
    assert cache.trim(3) == 3 and cache.offset == 17
    kv, _ = cache.group_inputs(_coded(17, 1), _coded(17, 1))  # reopened group 8: positions 16, 17
    assert np.array(kv)[0, :, 0].tolist() == [16, 17]
    fresh = LayerCache(window=4)
    assert fresh.trim(5) == 0 and fresh.is_trimmable()


def test_state_round_trips_through_from_state():
    cache = LayerCache(window=4, ratio=2, owns_kv=True, trim_slack=3)
    cache.update_window(_coded(0, 7))
    cache.group_inputs(_coded(0, 7), _coded(0, 7))
    cache.append_compressed(_coded(0, 3), _coded(0, 3, width=2))
    cache.advance(7)
    copy = LayerCache.from_state(cache.state)
    for a, b in zip(copy.state, cache.state):
        assert (a is None and b is None) or (mx.array_equal(a, b) if isinstance(a, mx.array) else a == b)
    assert copy.kv.shape[1] == 3 and copy.nbytes > 0 and copy.size() == 7 and not copy.empty()
    with pytest.raises(ValueError, match="expected 12 entries"):
        LayerCache.from_state(cache.state[:5])
    bad = list(cache.state)
    bad[5] = 9  # offset 9 would need 4 compressed entries
    with pytest.raises(ValueError, match="3 compressed entries for offset 9 and ratio 2"):
        LayerCache.from_state(bad)


def test_make_layer_cache_follows_the_roles():
    args = tiny_args()
    caches = make_caches(args, trim_slack=5)
    assert [(c.ratio, c.owns_kv) for c in caches] == [
        (0, False),
        (2, True),
        (2, False),
        (1, True),
        (1, False),
        (1, False),
        (1, False),
    ]
    assert caches[1].raw_capacity == 6 and caches[3].raw_capacity == 0 and caches[0].ring_size == 8 + 5
    with pytest.raises(ValueError, match="layer 7 is not in 0..6"):
        make_layer_cache(args, 7)


# ---------------------------------------------------------------- Engram history


def test_engram_history_returns_the_ids_before_each_call():
    h = EngramHistory(3, trim_slack=2)
    ids = np.arange(20, dtype=np.int64).reshape(2, 10) + 100
    assert h.update(ids[:, :2]).tolist() == [[-1, -1, -1], [-1, -1, -1]]
    assert h.update(ids[:, 2:3]).tolist() == [[-1, 100, 101], [-1, 110, 111]]
    assert h.update(ids[:, 3:8]).tolist() == [[100, 101, 102], [110, 111, 112]]
    # Holds positions 3..7 (length 3 + slack 2): a trim to offset 6 still has 3, 4, 5.
    assert h.ids.shape == (2, 5) and h.offset == 8 and h.max_trim() == 2
    assert h.trim(2) == 2
    assert h.update(ids[:, 6:7] + 50).tolist() == [[103, 104, 105], [113, 114, 115]]  # as if never past 6
    assert h.update(ids[:, 7:8]).tolist() == [[104, 105, 156], [114, 115, 166]]
    with pytest.raises(ValueError, match=r"EngramHistory.trim\(3\): only the last 2 tokens"):
        h.trim(3)
    with pytest.raises(ValueError, match="batch 1, but this history holds batch 2"):
        h.update(ids[:1, :1])
    with pytest.raises(ValueError, match="integer array"):
        h.update(np.zeros((2, 1), np.float32))


def test_prompt_cache_files_round_trip_through_mlx_lm(tmp_path):
    from mlx_lm.models import cache as mlx_lm_cache

    assert register_with_mlx_lm() and mlx_lm_cache.LayerCache is LayerCache
    args = tiny_args()
    stack = build_stack(args, seed=1)
    caches = make_caches(args, trim_slack=4)
    history = EngramHistory(3, trim_slack=4)
    x = random_input(args, 1, 19, seed=3)
    run_stack(stack, caches, x[:, :13])  # odd offset: layer 1 carries an open group
    history.update(np.arange(13, dtype=np.int64)[None] + 7)
    path = str(tmp_path / "prompt.safetensors")
    mlx_lm_cache.save_prompt_cache(path, caches + [history], {"note": "tiny"})
    loaded, meta = mlx_lm_cache.load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "tiny"} and [type(c) for c in loaded] == [LayerCache] * 7 + [EngramHistory]
    assert loaded[1].raw_kv.shape[1] == 5 and loaded[0].kv is None
    assert np.array_equal(loaded[-1].update(np.array([[99]])), history.update(np.array([[99]])))
    resumed = run_chunks(stack, loaded[:-1], x[:, 13:], [1] * 6)
    original = run_chunks(stack, caches, x[:, 13:], [1] * 6)
    assert mx.array_equal(resumed, original)  # the same computation on the same state
    assert all(a.offset == b.offset == 19 for a, b in zip(loaded, caches))


# ---------------------------------------------------------------- trim at the stack level


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_trim_then_decode_equals_never_decoded(n):
    """Prefill 14, decode 6 (offset 20), trim n (odd n lands inside a ratio-2 group), then decode 4
    different tokens: the outputs must be those of a fresh run over the kept prefix + new tokens."""
    args = tiny_args()
    stack = build_stack(args, seed=2)
    x = random_input(args, 1, 20, seed=4)
    y = random_input(args, 1, 4, seed=5)
    caches = make_caches(args, trim_slack=5)
    run_chunks(stack, caches, x, [14] + [1] * 6)
    assert min(c.max_trim() for c in caches) >= 5
    assert all(c.trim(n) == n for c in caches)
    after = run_chunks(stack, caches, y, [1, 1, 1, 1])
    fresh = run_stack(stack, make_caches(args), mx.concatenate([x[:, : 20 - n], y], axis=1))
    assert_rows_match(after, fresh[:, 20 - n :], f"trim {n}")


def test_repeated_trims_after_a_chunk_larger_than_the_ring():
    args = tiny_args()
    stack = build_stack(args, seed=3)
    x = random_input(args, 1, 30, seed=6)
    caches = make_caches(args, trim_slack=3)  # ring of 11 < the 17-token chunk
    run_chunks(stack, caches, x[:, :17], [17])
    [c.trim(3) for c in caches]
    run_chunks(stack, caches, x[:, 14:16], [2])
    [c.trim(1) for c in caches]
    out = run_chunks(stack, caches, x[:, 15:30], [3, 1, 11])
    fresh = run_stack(stack, make_caches(args), x)
    assert_rows_match(out, fresh[:, 15:], "repeated trims")


def test_store_rows_one_row_and_many_write_the_same_slots():
    """cache.store_rows: a row that cannot wrap goes through one dynamic slice update, several rows
    through a scatter at their ring slots; both put every row where the indexed write puts it."""
    rng = np.random.default_rng(3)
    buf = mx.array(rng.standard_normal((2, 7, 5)).astype(np.float32))
    for first, n, ring in [(0, 1, 7), (6, 1, 7), (13, 1, 7), (5, 3, 7), (2, 4, None)]:
        rows = mx.array(rng.standard_normal((2, n, 5)).astype(np.float32))
        want = np.array(buf)
        slots = np.array(ring_slots(mx.array(first, mx.int32), 0, n, ring)) if ring else np.arange(first, first + n)
        want[:, slots] = np.array(rows)
        got = store_rows(mx.array(np.array(buf)), rows, mx.array(first, mx.int32), ring)
        assert np.array_equal(np.array(got), want), (first, n, ring)
