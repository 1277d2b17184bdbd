"""The assembled model on the tiny config (every layer role, two Engram layers, hc_mult 4, 8 experts
top-2): the docs/model.md#top-level/docs/model.md#mhc wiring against a float64 reference, and the
cache contract: decode == prefill, chunked prefill == prefill, trim + re-decode == never decoded,
batched == solo.

On this CPU the paths agree bit for bit (MLX's CPU matmuls give each row the same result whatever
the number of rows), and the tests assert exactly that: the same logit bytes. On a GPU backend,
where GEMMs change their arithmetic with the row count, the bound is 1e-3 of the logit scale and
identical greedy tokens. Any wiring error (history, positions, pending groups, shared state) moves
logits by O(1).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from attention_stack import ROWS_INDEPENDENT, rb, ref_rms_norm
from mlx.utils import tree_flatten
from test_hyper_connections import mixes_f64

from mlx_dsv41.model.deepseek_v41 import Model
from mlx_dsv41.model.engram import MemoryRowSource
from mlx_dsv41.synthetic import (
    random_engram_tables,
    random_weights,
    synthetic_token_map,
    tiny_args,
    tiny_model,
)

ml_dtypes = pytest.importorskip("ml_dtypes")
L = 24  # tokens: layer 4's pool (ratio 1) reaches 24 > index_topk 4; 12 candidate blocks > 2 kept


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def ids():
    return mx.array(np.random.default_rng(1).integers(0, 159, (2, L)))  # 159 = image id: not here


@pytest.fixture(scope="module")
def full(model, ids):
    return np.array(model(ids, model.make_cache()))


def _close(got, ref, what):
    """Bytes on the CPU (row-independent arithmetic); on a GPU within 1e-3 of the logit scale."""
    if ROWS_INDEPENDENT:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (
            f"{what}: max |Δ| {np.abs(got - ref).max():.3g} (expected the same bytes)"
        )
        return
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max()
    assert err <= 1e-3 * scale, f"{what}: max |Δ| {err:.3g} vs logit scale {scale:.3g}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1)), f"{what}: greedy tokens differ"


def test_tiny_config_covers_every_role():
    roles = tiny_args().roles
    assert [(r.ratio, r.mode, r.engram) for r in roles] == [
        (0, "window", False),
        (0, "window", True),
        (2, "full", True),
        (2, "reuse", False),
        (1, "full", False),
        (1, "reuse", False),
        (1, "reindex", False),
        (1, "reuse", False),
    ]
    assert roles[4].builds_candidates and roles[6].uses_candidates and roles[7].index_source == 6
    assert tiny_args().hc_mult == 4 and tiny_args().n_routed_experts == 8


def test_logits_shape_dtype_finite_and_varied(full):
    assert full.shape == (2, L, 160) and full.dtype == np.float32
    assert np.isfinite(full).all()
    assert 0.3 < full.std() < 30
    assert len(np.unique(full.argmax(-1))) > 5  # not a degenerate model


class _Spy(nn.Module):
    """Wraps an attention module and keeps the `shared` dict it saw."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen = None

    def __call__(self, x, cache, shared):
        self.seen = shared
        return self.inner(x, cache, shared)


def test_pool_exceeds_topk_and_candidate_blocks_filter(ids):
    model = tiny_model(seed=0)
    spy = _Spy(model.layers[7].attn)
    model.layers[7].attn = spy
    args, bs = model.args, model.args.candidate_block_size
    caches = model.make_cache()
    model(ids, caches)
    assert caches[4].offset // 1 == L > args.index_topk  # ratio-1 pool: valid entries
    assert caches[2].offset // 2 == L // 2 > args.index_topk  # ratio-2 pool
    assert spy.seen["kv.4"] is caches[4].kv and spy.seen["kv.2"] is caches[2].kv  # the buffers, published
    blocks = np.array(spy.seen["candidates.4"])  # [B, S, blocks] kept by the candidate source
    t = np.arange(L)
    visible_blocks = -(-(t + 1) // bs)
    assert np.array_equal(
        blocks.sum(-1), np.broadcast_to(np.minimum(visible_blocks, args.candidate_topk_blocks), (2, L))
    )
    assert (visible_blocks > args.candidate_topk_blocks).sum() > L // 2  # most queries are filtered
    assert blocks[:, t, t // bs].all()  # the newest block is always kept
    # The Reindex layer (6) picks inside the kept blocks; layer 7 reuses its top-k. When fewer than
    # index_topk visible entries survive the mask, the reference's top-k also takes masked visible
    # entries (only invisible picks become -1), so then every surviving entry must be picked.
    topk = np.array(spy.seen["topk.6"])
    assert topk.shape[-1] == args.index_topk and (topk[:, -1] >= 0).all()
    for b in range(topk.shape[0]):
        for s in range(L):
            inside = {j for j in range(s + 1) if blocks[b, s, j // bs]}
            picks = set(topk[b, s][topk[b, s] >= 0].tolist())
            assert max(picks) <= s  # only visible entries
            assert picks <= inside if len(inside) >= args.index_topk else inside <= picks, (b, s)


def test_decode_one_token_at_a_time_equals_prefill(model, ids, full):
    cache = model.make_cache()
    steps = [np.array(model(ids[:, t : t + 1], cache)) for t in range(L)]
    _close(np.concatenate(steps, axis=1), full, "decode vs prefill")


def test_chunked_prefill_every_size_equals_prefill(model, ids, full):
    window = model.args.sliding_window
    for n in range(1, 2 * window + 1):
        cache = model.make_cache()
        parts = [np.array(model(ids[:, s : s + n], cache)) for s in range(0, L, n)]
        _close(np.concatenate(parts, axis=1), full, f"chunks of {n}")


@pytest.mark.parametrize("keep,trim", [(13, 5), (16, 3), (11, 8)])  # trims inside ratio-2 groups
def test_trim_then_redecode_equals_never_decoded(model, ids, full, keep, trim):
    other = mx.array(np.random.default_rng(keep).integers(0, 159, (2, trim)))
    cache = model.make_cache()
    model(ids[:, :keep], cache)
    model(other, cache)  # tokens that are then taken back
    for c in cache:
        assert c.trim(trim) == trim
    assert all(c.offset == keep for c in cache)
    rest = np.array(model(ids[:, keep:], cache))
    _close(rest, full[:, keep:], f"trim {trim} after {keep + trim}")


def test_batched_equals_each_alone(model, ids, full):
    for b in range(2):
        solo = np.array(model(ids[b : b + 1], model.make_cache()))
        _close(solo, full[b : b + 1], f"row {b} alone")


def test_engram_path_changes_the_output(ids, full):
    for layer in (1, 2):  # one on a window-only layer, one on a KV-source layer
        model = tiny_model(seed=0)
        model.layers[layer].engram.wkv.weight = mx.zeros_like(model.layers[layer].engram.wkv.weight)
        out = np.array(model(ids, model.make_cache()))
        assert np.abs(out - full).max() > 0.05 * np.abs(full).max(), f"Engram layer {layer} had no effect"


def test_indexed_attention_path_changes_the_output(ids, full):
    model = tiny_model(seed=0)
    for layer in model.layers:
        layer.attn.attend_compressed = False
    out = np.array(model(ids, model.make_cache()))
    assert np.abs(out - full).max() > 0.05 * np.abs(full).max()


def test_engram_reads_every_row_once_per_position(ids):
    model = tiny_model(seed=0)
    model(ids, model.make_cache())
    cols = model.args.engram_columns
    for layer in (1, 2):
        assert model._engram_rows[layer].stats.rows == 2 * L * cols


class _RecordingRows:
    """A row source that remembers the row ids it was asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def read(self, row_ids):
        self.asked.append(np.array(row_ids))
        return self.inner.read(row_ids)


def test_engram_layers_listed_out_of_order_read_their_own_rows(ids):
    """Tables, primes and multipliers follow engram_layer_ids' order, not the layer order."""
    args = tiny_args(engram_layer_ids=(2, 1))
    model = tiny_model(args)
    sources = {layer: _RecordingRows(s) for layer, s in model.engram_sources.items()}
    model.set_engram(synthetic_token_map(args), sources)
    model(ids, model.make_cache())
    want = model.engram_row_ids(np.array(ids))
    for layer, source in sources.items():
        assert np.array_equal(source.asked[0], want[:, :, args.engram_index(layer)].reshape(-1)), layer


def test_engram_state_is_not_a_parameter_and_is_required():
    model = tiny_model(seed=0)
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert not any("engram_rows" in k or "token_map" in k or "_engram" in k for k in names)
    bare = Model(tiny_args())
    with pytest.raises(RuntimeError, match=r"Engram layers \[1, 2\] need a token map and row sources"):
        bare(mx.array([[1, 2]]))
    tables = random_engram_tables(bare.args)
    with pytest.raises(ValueError, match=r"row sources needed for Engram layers \[1, 2\], got \[1\]"):
        bare.set_engram(synthetic_token_map(bare.args), {1: MemoryRowSource(tables[1])})


def test_evaluating_logits_materialises_every_cache_array(ids):
    """No lazy chain survives a step: after evaluating the logits, no cache array has a graph
    (long generations would otherwise grow one through state the logits do not read)."""
    import io

    model = tiny_model(seed=0)
    cache = model.make_cache()
    for t in range(5):  # odd offsets leave ratio-2 groups pending
        mx.eval(model(ids[:, t : t + 1], cache))
    held = [a for c in cache[:-1] for a in c.arrays()]
    assert any(c.raw_kv is not None for c in cache[:-1])
    buf = io.StringIO()
    mx.export_to_dot(buf, *held)
    assert "shape=rectangle" not in buf.getvalue()


def test_input_embeddings_replace_the_lookup(model, ids, full):
    out = np.array(model(ids, model.make_cache(), input_embeddings=model.embed(ids)))
    assert np.array_equal(out, full)


def test_cache_list_is_checked(model):
    with pytest.raises(ValueError, match="cache has 8 entries; this model needs 9"):
        model(mx.array([[1]]), model.make_cache()[:8])


def test_mlx_lm_generate_step_drives_the_model(model, ids):
    """mlx-lm's own generation loop (prefill chunks, async decode) gives our greedy tokens."""
    from mlx_lm.generate import generate_step

    prompt = ids[0, :10]
    got = [int(t) for t, _ in generate_step(prompt, model, max_tokens=6, prefill_step_size=4)]
    cache, seq, want = model.make_cache(), prompt[None], []
    for _ in range(6):
        tok = int(np.array(model(seq, cache))[0, -1].argmax())
        want.append(tok)
        seq = mx.array([[tok]])
    assert got == want


# ------------------------------------------------------------------ wiring vs float64
# (docs/model.md#top-level, docs/model.md#mhc)


class _StubAttention(nn.Module):
    """Stands in for attention: bf16(tanh(x @ M)) (the wiring test needs no attention math)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def __call__(self, x, cache, shared):
        return mx.tanh(x.astype(mx.float32) @ self.m).astype(x.dtype)


class _StubFFN(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def __call__(self, x):
        return mx.sin(x.astype(mx.float32) @ self.m).astype(x.dtype)


def _ref_norm(x, w):
    return ref_rms_norm(x, w, 1e-20)


def _is_prime(n):
    return n > 1 and all(n % f for f in range(2, int(n**0.5) + 1))


def _independent_row_ids(args, ids):
    """docs/model.md#engram-hashing written out again, sharing no code with
    mlx_dsv41.model.engram_hash: row ids [B, S, Engram layers, columns] of the n-grams ending at
    each position of ids [B, S] (from position 0), with the synthetic token map t -> t mod C and the
    image id DEAD."""
    C, heads, N = args.engram_compressed_vocab_size, args.engram_n_heads, args.engram_max_ngram_size
    seen, primes = set(), []
    for _ in args.engram_layer_ids:
        per_n = []
        for _ in range(2, N + 1):
            cand, row = args.engram_vocab_size - 1, []
            for _ in range(heads):
                cand += 1
                while cand in seen or not _is_prime(cand):
                    cand += 1
                seen.add(cand)
                row.append(cand)
            per_n.append(row)
        primes.append(per_n)
    bound = (2**63 - 1) // C // 2
    out = np.zeros((*ids.shape, len(args.engram_layer_ids), (N - 1) * heads), np.int64)
    for li, layer in enumerate(args.engram_layer_ids):
        mult = [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, N, dtype=np.int64)]
        cols = [p for row in primes[li] for p in row]
        offsets = [sum(cols[:c]) for c in range(len(cols))]
        for b, t in np.ndindex(*ids.shape):
            toks, dead = [], False
            for back in range(N):
                dead = dead or t - back < 0 or ids[b, t - back] == args.image_token_id
                toks.append(args.engram_pad_token_id % C if dead else int(ids[b, t - back]) % C)
            x, c = toks[0] * mult[0], 0
            for n in range(2, N + 1):
                x ^= toks[n - 1] * mult[n - 1]
                for h in range(heads):
                    out[b, t, li, c] = x % primes[li][n - 2][h] + offsets[c]
                    c += 1
    return out


def ref_engram(streams, raw, wkv, q_weight, k_weight, head_dim, dead):
    """docs/model.md#engram-rows-and-gate in float64 with the reference's roundings: streams [B, S,
    HC, D], raw rows uint8 [B, S, columns, row_bytes], dead [B, S] -> the new streams (bf16
    values)."""
    *lead, hc, D = streams.shape
    vals = raw[..., :head_dim].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    e = rb(vals * np.repeat(np.exp2(raw[..., head_dim:].astype(np.float64) - 127), 32, -1))
    kv = rb(e.reshape(*lead, -1) @ wkv.T)
    key, value = kv[..., : hc * D].reshape(*lead, hc, D), kv[..., hc * D :]
    dot = (streams * q_weight * k_weight * key).sum(-1)
    dot /= np.sqrt((streams**2).mean(-1) + 1e-20) * np.sqrt((key**2).mean(-1) + 1e-20) * np.sqrt(D)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    gate[dead] = 0
    return rb(streams + gate[..., None] * value[..., None, :])


def _reference(args, w, tables, ids, stubs, lag=True):
    """docs/model.md#top-level / docs/model.md#mhc / docs/model.md#engram-gate / docs/model.md#head
    in float64 with the bf16 roundings of the reference."""
    hc = args.hc_mult
    row_ids = _independent_row_ids(args, ids)
    comp = np.where(ids == args.image_token_id, -1, 0)
    h = w["embed.weight"][ids]
    streams = np.repeat(h[:, :, None, :], hc, axis=2)
    pre = np.zeros((*ids.shape, hc))
    pre[..., 0] = 1
    for i in range(args.num_hidden_layers):
        p = f"layers.{i}."
        if i in args.engram_layer_ids:
            raw = tables[i][row_ids[:, :, args.engram_layer_ids.index(i)]]  # [B, S, cols, row_bytes]
            streams = ref_engram(
                streams,
                raw,
                w[p + "engram.wkv.weight"],
                w[p + "engram.q_weight"],
                w[p + "engram.k_weight"],
                args.engram_head_dim,
                comp < 0,
            )
        a_pre, a_post, a_c = mixes_f64(streams, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"])
        x = _ref_norm(rb(np.einsum("bsi,bsid->bsd", pre if lag else a_pre, streams)), w[p + "attn_norm.weight"])
        y = rb(np.tanh(x @ stubs[i][0]))
        streams = rb(a_post[..., None] * y[:, :, None, :] + np.einsum("bsij,bsid->bsjd", a_c, streams))
        f_pre, f_post, f_c = mixes_f64(streams, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"])
        x = _ref_norm(rb(np.einsum("bsi,bsid->bsd", a_pre if lag else f_pre, streams)), w[p + "ffn_norm.weight"])
        y = rb(np.sin(x @ stubs[i][1]))
        streams = rb(f_post[..., None] * y[:, :, None, :] + np.einsum("bsij,bsid->bsjd", f_c, streams))
        pre = f_pre
    x = _ref_norm(rb(np.einsum("bsi,bsid->bsd", pre, streams)), w["norm.weight"])
    return x @ w["head.weight"].T


def test_mhc_engram_and_head_wiring_matches_float64():
    args = tiny_args()
    weights = random_weights(args, seed=3)
    model = tiny_model(args, seed=3, weights=weights)
    rng = np.random.default_rng(4)
    stubs = [
        (rng.standard_normal((64, 64)).astype(np.float32) / 8, rng.standard_normal((64, 64)).astype(np.float32) / 8)
        for _ in range(args.num_hidden_layers)
    ]
    for layer, (ma, mf) in zip(model.layers, stubs):
        layer.attn = _StubAttention(mx.array(ma))
        layer.ffn = _StubFFN(mx.array(mf))
    ids = rng.integers(0, 159, (2, 9))
    ids[1, 4] = args.image_token_id  # a DEAD position: Engram gate 0, look-back stops there
    got = np.array(model(mx.array(ids), model.make_cache()), np.float64)

    w = {k: np.array(v.astype(mx.float32), np.float64) for k, v in weights.items()}
    tables = random_engram_tables(args, seed=3)
    stubs64 = [(a.astype(np.float64), b.astype(np.float64)) for a, b in stubs]
    ref = _reference(args, w, tables, ids, stubs64)
    wrong = _reference(args, w, tables, ids, stubs64, lag=False)  # V4's same-site pre
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert err < 5e-3 * scale, (err, scale)
    assert np.abs(got - wrong).max() > 10 * err  # the test tells the lag apart
