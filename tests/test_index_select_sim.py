"""The indexer kernels (mlx_dsv41/metal_ext/index_scores.metal, index_select.metal) on the CPU simulator:
the scores against float64 (docs/numerics.md#index-scores), the selection from those scores the bytes of
model/indexer.py's plain-MLX selection (every mode, ties, -0, NaN and inf, rows past the visible count,
more and fewer entries than k), the one launch (CUDA) the bytes of the two (Metal), untouched guard
rows, and the model's indexer on the kernel against its reference path. tests/gpu/test_index_select_gpu.py
repeats the kernel contract on the device."""

import shutil
import zlib

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import grid_finish
from mlx_dsv41.kernels import index_select as ix
from mlx_dsv41.model import indexer as ref

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

GUARD, POISON = 1, 7  # a guard row after every output, filled with POISON (init_value)

# B, S, Hi, Di, T, position, ratio, k, block, keep, what the keys hold
CASES = {
    "flash_decode": (1, 1, 32, 128, 300, 530, 2, 64, 8, 16, "random"),
    "flash_all_picked": (1, 1, 32, 128, 40, 70, 2, 40, 8, 2048, "random"),
    "verify_rows": (2, 3, 32, 128, 96, 150, 2, 24, 8, 5, "random"),
    "few_heads": (1, 2, 4, 64, 70, 120, 1, 16, 4, 3, "random"),
    "ties": (1, 2, 32, 128, 260, 400, 2, 40, 8, 6, "ties"),
    "zeros_and_signs": (1, 1, 8, 32, 100, 190, 2, 30, 2, 9, "negative"),
    "nonfinite": (1, 2, 32, 128, 64, 110, 2, 12, 8, 3, "nonfinite"),
    "long": (1, 1, 32, 128, 1500, 2900, 2, 512, 8, 64, "random"),
}
MODES = ("plain", "build", "inside")


def _fp4(a: np.ndarray) -> np.ndarray:
    """Values an FP4 fake quant leaves (e2m1 times a power of two): exact products."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    return (grid[np.abs(a * 2).astype(int) % 8] * np.sign(a) * 2.0 ** np.round(a)).astype(np.float32)


def inputs(name: str, mode: str):
    B, S, Hi, Di, T, pos, ratio, k, block, keep, kind = CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{mode}".encode()))
    q = _fp4(rng.standard_normal((B, S, Hi, Di)))
    keys = _fp4(rng.standard_normal((B, T, Di)))
    w = rng.standard_normal((B, S, Hi)).astype(np.float32)
    if kind == "ties":  # every fifth entry repeats: exactly equal scores, decided by the lower index
        keys = keys[:, np.arange(T) % 5]
    if kind == "negative":  # most dots negative: relu 0, scores +0 and -0 (negative weights)
        keys = -np.abs(keys)
        q = np.abs(q)
        q[..., 0, :2] *= -1
    if kind == "nonfinite":
        keys[0, 3] = np.nan
        keys[0, 9, 5] = np.inf
        keys[0, 17, 7] = -np.inf
        w[0, 0, 4] = np.inf
    cand = None
    if mode == "inside":
        nb = -(-T // block)
        cand = mx.array(rng.random((B, S, nb)) < 0.6)
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    common = dict(ratio=ratio, k=k, block=block, keep=keep, candidates=cand, build_candidates=mode == "build")
    return bf(q), bf(w), bf(keys), mx.array(pos, mx.int32), 1 / 64, common


def _call(name, mode, finish=True):
    q, w, keys, pos, scale, common = inputs(name, mode)
    counters = grid_finish.split_counters(q.shape[0] * q.shape[1])
    return ix.scores_args(
        q, w, keys, pos, counters, scale=scale, finish=finish, init_value=POISON, guard=GUARD, **common
    )


@pytest.fixture(scope="module")
def program():
    specs = [(ix.SCORES, _call(n, m)) for n in CASES for m in MODES]
    specs += [(ix.SCORES, _call("verify_rows", "plain", finish=False))]
    specs += [
        (ix.SELECT, ix.select_args(mx.zeros((6, 96)), mx.array(1, mx.int32), 3, **_select_common(m))) for m in MODES
    ]
    return exl3_sim.build(specs, mma=True), specs


def _select_common(mode):
    _, _, _, _, _, common = inputs("verify_rows", mode)
    return dict(common, init_value=POISON, guard=GUARD)


def _spec(program, kernel, name=None, mode=None):
    prog, specs = program
    if kernel is ix.SCORES:
        i = list(CASES).index(name) * len(MODES) + MODES.index(mode) if name else len(CASES) * len(MODES)
    else:
        i = len(CASES) * len(MODES) + 1 + MODES.index(mode)
    return prog, i


def float64_scores(name, mode):
    q, w, keys, pos, scale, common = inputs(name, mode)
    B, S = q.shape[:2]
    q64, k64 = np.array(q.astype(mx.float32), np.float64), np.array(keys.astype(mx.float32), np.float64)
    w32 = np.array(w.astype(mx.float32) * scale, np.float64)  # one fp32 rounding, as the reference
    dots = np.einsum("bshd,btd->bsht", q64, k64)
    with np.errstate(invalid="ignore"):
        relu = np.where(np.isnan(dots), dots, np.maximum(dots, 0))
        terms = relu * w32[..., None]
        scores = terms.sum(axis=2)
        size = (np.abs(terms) + np.einsum("bshd,btd->bsht", np.abs(q64), np.abs(k64)) * np.abs(w32[..., None])).sum(2)
    visible = np.array(ref.visible_counts(pos, S, common["ratio"]))
    seen = np.arange(keys.shape[1])[None, None, :] < visible[None, :, None]
    seen = np.broadcast_to(seen, scores.shape)
    return np.where(seen, scores, -np.inf), size, seen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_scores_within_float64_bound_and_the_selection_is_the_references(program, name, mode):
    prog, i = _spec(program, ix.SCORES, name, mode)
    scores, topk, blocks, _ = prog.run(i)
    q, w, keys, pos, scale, common = inputs(name, mode)
    B, S = q.shape[:2]
    R, T = B * S, keys.shape[1]
    # guard rows keep the poison (nothing is written past the outputs' rows)
    assert np.all(scores[R:] == POISON) and np.all(topk[R:] == POISON)
    if mode == "build":
        assert np.all(blocks[R:] == bool(POISON))
    got = scores[:R].reshape(B, S, T)
    want, size, seen = float64_scores(name, mode)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(
        got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)]
    )
    assert np.all(np.abs(got[finite] - want[finite]) <= 2**-21 * size[finite] + 1e-30)
    assert np.all(got[~seen] == -np.inf)
    # the selection: the reference's bytes on the kernel's scores, every NaN the positive quiet NaN
    # (the kernel's ranking: docs/numerics.md#topk-ties; MLX's max makes that NaN too)
    ks = mx.array(np.where(np.isnan(got), np.float32(np.nan), got))
    visible = ref.visible_counts(pos, S, common["ratio"])
    if mode == "inside":
        ks = ref.apply_candidate_blocks(ks, common["candidates"], common["block"])
    want_topk = np.array(ref.select_topk(ks, common["k"], visible))
    assert np.array_equal(topk[:R].reshape(want_topk.shape), want_topk)
    if mode == "build":
        want_blocks = np.array(ref.select_candidate_blocks(ks, visible, common["block"], common["keep"]))
        assert np.array_equal(blocks[:R].reshape(want_blocks.shape), want_blocks)


def test_the_cases_select_for_real():
    """The cases are not blind: some have more entries than k and more blocks than are kept, ties
    among the picked, exactly-zero scores of both signs, and picks dropped past the visible count."""
    big = [n for n, c in CASES.items() if c[4] > c[7]]
    assert {"flash_decode", "ties", "long", "nonfinite"} <= set(big)
    want, _, _ = float64_scores("zeros_and_signs", "plain")
    assert np.sum(want == 0) > 10
    B, S, Hi, Di, T, pos, ratio, k, block, keep, _ = CASES["flash_decode"]
    assert -(-T // block) > keep and (pos + 1) // ratio < T


def test_one_launch_gives_the_bytes_of_the_two(program):
    """CUDA's index_scores that selects in its last threadgroup, against Metal's index_scores then
    index_select, in every mode."""
    prog, i_two = _spec(program, ix.SCORES)
    prog, i_plain = _spec(program, ix.SCORES, "verify_rows", "plain")
    assert np.array_equal(prog.run(i_plain)[0][:-1], prog.run(i_two)[0][:-1], equal_nan=True)  # the same inputs
    for mode in MODES:
        q, _, _, pos, _, common = inputs("verify_rows", mode)
        prog, i_one = _spec(program, ix.SCORES, "verify_rows", mode)
        scores, topk, blocks, _ = prog.run(i_one)
        S = q.shape[1]
        prog, i_sel = _spec(program, ix.SELECT, mode=mode)
        call = ix.select_args(mx.array(scores[:-1]), pos, S, init_value=POISON, guard=GUARD, **common)
        topk2, blocks2, _ = prog.run(i_sel, call)
        assert np.array_equal(topk, topk2)
        if mode == "build":
            assert np.array_equal(blocks, blocks2)


def test_refusals():
    q, w, keys, pos, _, _ = inputs("verify_rows", "plain")
    assert ix.refusal(q, w, keys) is None
    assert "query rows" in ix.refusal(mx.zeros((1, 17, 32, 128)), mx.zeros((1, 17, 32)), keys[:1])
    assert "heads" in ix.refusal(mx.zeros((2, 3, 33, 128)), mx.zeros((2, 3, 33)), keys)
    assert "heads" in ix.refusal(mx.zeros((2, 3, 32, 48)), mx.zeros((2, 3, 32)), keys[..., :48])
    assert "keys" in ix.refusal(q, w, keys[..., :64])
    assert "keys" in ix.refusal(q, w, keys[:, :0])


def indexer_steps(rng, args, B: int, rows_and_positions) -> list:
    """(x, qr, position) of a forward for each (S, position): random bf16 inputs of an Indexer."""
    steps = []
    for S, position in rows_and_positions:
        x = mx.array(rng.standard_normal((B, S, args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
        qr = mx.array(rng.standard_normal((B, S, args.q_lora_rank)).astype(np.float32)).astype(mx.bfloat16)
        steps.append((x, qr, mx.array(position, mx.int32)))
    return steps


def indexer_picks(indexer, keys, steps) -> list:
    """For each step: the candidate source's top-k and block mask, a Reindex layer's top-k inside
    that mask, a plain Full layer's top-k (numpy)."""
    picks = []
    for x, qr, pos in steps:
        built = indexer(x, qr, keys, pos, build_candidates=True)
        inside = indexer(x, qr, keys, pos, candidates=built[1])
        plain = indexer(x, qr, keys, pos)
        picks.append([np.array(a) for a in (*built, inside[0], plain[0])])
    return picks


def _run_on_sim(monkeypatch, calls):
    sims = {k.name: exl3_sim.launcher(k) for k in (ix.SCORES, ix.SELECT)}

    def run(self, **call):
        calls.append(self.name)
        return sims[self.name](**call)

    monkeypatch.setattr(type(ix.SCORES), "__call__", run)


@pytest.mark.parametrize("backend_name", ["cuda", "metal"])
def test_the_model_indexer_on_the_kernel_picks_what_its_reference_picks(monkeypatch, backend_name):
    """An Indexer of the tiny model (FP4 q and keys, random weights) at a decode row and a verify's
    rows, in the three roles, on the simulated kernel (CUDA: one launch; Metal: two) against the
    plain-MLX path: the same picks and block masks (the scores' sums differ only in order, and no
    two of these scores are within those roundings of each other)."""
    from mlx_dsv41.model.indexer import Indexer
    from mlx_dsv41.synthetic import tiny_args

    args = tiny_args(index_topk=6, candidate_block_size=2, candidate_topk_blocks=3)
    mx.random.seed(3)
    indexer = Indexer(args, 2)
    mx.eval(indexer.parameters())
    rng = np.random.default_rng(4)
    T = 40
    keys = mx.array(_fp4(rng.standard_normal((2, T, args.index_head_dim)))).astype(mx.bfloat16)
    steps = indexer_steps(rng, args, 2, ((1, 61), (3, 58)))
    results = {}
    for on_kernel in (False, True):
        calls = []
        if on_kernel:
            monkeypatch.setattr(ix, "backend", lambda: backend_name)
            _run_on_sim(monkeypatch, calls)
        results[on_kernel] = indexer_picks(indexer, keys, steps)
        if on_kernel:
            assert len(calls) == 6 * (1 if backend_name == "cuda" else 2)
    assert np.sum(results[False][0][0] == -1) > 0 or results[False][0][0].shape[-1] < T  # a real selection
    for got, want in zip(results[True], results[False]):
        for g, w in zip(got, want):
            assert np.array_equal(g, w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["verify_rows", "flash_all_picked"])
def test_the_index_list_is_the_window_rows_then_the_picks_past_them(name, mode):
    """With window = (rows [S, W], R) both launches (CUDA's one that selects, Metal's index_select)
    also write the attention's index list [B, S, W + k]: each query's window rows, then its picks
    plus R with the -1s kept, the bytes of model/attention.py's index_list on the same picks
    (docs/design.md#index-list); the picks themselves are unchanged and the guard row keeps its
    poison."""
    from mlx_dsv41.model.attention import index_list

    q, w, keys, pos, scale, common = inputs(name, mode)
    B, S = q.shape[:2]
    rows = np.random.default_rng(5).integers(0, 150, (S, 12)).astype(np.int32)
    rows[:, :2] = -1  # a window's positions before the start
    rows = mx.array(rows)
    window = dict(common, window=(rows, 150))
    counters = grid_finish.split_counters(B * S)
    one = ix.scores_args(q, w, keys, pos, counters, scale=scale, init_value=POISON, guard=GUARD, **window)
    plain = ix.scores_args(q, w, keys, pos, counters, scale=scale, init_value=POISON, guard=GUARD, **common)
    two = ix.select_args(mx.zeros((B * S, keys.shape[1])), pos, S, init_value=POISON, guard=GUARD, **window)
    prog = exl3_sim.build([(ix.SCORES, one), (ix.SCORES, plain), (ix.SELECT, two)], mma=True)
    scores, topk, _, listed = prog.run(0)
    assert np.array_equal(topk, prog.run(1)[1]) and listed.shape == (B * S + GUARD, 12 + common["k"])
    want = np.array(index_list(rows, mx.array(topk[: B * S]).reshape(B, S, -1), 150)).reshape(B * S, -1)
    assert np.array_equal(listed[: B * S], want) and np.all(listed[B * S :] == POISON)
    assert (want[:, 12:] >= 150).any() and (want[:, :12] == -1).any()
    assert (want[:, 12:] == -1).any() == (name == "flash_all_picked")  # picks past the visible count
    (_, _, listed2) = prog.run(2, dict(two, inputs=[mx.array(scores[: B * S]), *two["inputs"][1:]]))
    assert np.array_equal(listed2, listed)
    with pytest.raises(ValueError, match="window rows"):
        ix.scores_args(
            q, w, keys, pos, counters, scale=scale, **dict(common, window=(mx.concatenate([rows, rows]), 150))
        )


@pytest.mark.parametrize("backend_name", ["cuda", "metal"])
def test_the_model_indexer_writes_the_attention_s_index_list_where_the_kernel_runs(monkeypatch, backend_name):
    """The Indexer with the attention's window rows: on the simulated kernel its third output is
    index_list of the plain path's picks (the same bytes the attention builds), in all three roles;
    on the CPU path it is None (the attention builds it)."""
    from mlx_dsv41.model.attention import index_list
    from mlx_dsv41.model.indexer import Indexer
    from mlx_dsv41.synthetic import tiny_args

    args = tiny_args(index_topk=6, candidate_block_size=2, candidate_topk_blocks=3)
    mx.random.seed(3)
    indexer = Indexer(args, 2)
    mx.eval(indexer.parameters())
    rng = np.random.default_rng(6)
    keys = mx.array(_fp4(rng.standard_normal((2, 40, args.index_head_dim)))).astype(mx.bfloat16)
    ((x, qr, pos),) = indexer_steps(rng, args, 2, ((3, 58),))
    rows = mx.array(rng.integers(-1, 30, (3, 8)).astype(np.int32))
    built = indexer(x, qr, keys, pos, window=(rows, 30), build_candidates=True)
    roles = (dict(build_candidates=True), dict(candidates=built[1]), dict())
    plain = [built] + [indexer(x, qr, keys, pos, window=(rows, 30), **role) for role in roles[1:]]
    assert all(p[2] is None for p in plain)
    monkeypatch.setattr(ix, "backend", lambda: backend_name)
    _run_on_sim(monkeypatch, [])
    for role, want in zip(roles, plain):
        got = indexer(x, qr, keys, pos, window=(rows, 30), **role)
        assert np.array_equal(np.array(got[2]), np.array(index_list(rows, want[0], 30)))
        assert got[2].shape == (2, 3, 8 + want[0].shape[-1])
