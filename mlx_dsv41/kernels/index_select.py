"""The lightning indexer's scores and two-level top-k for a few query rows in one launch
(docs/design.md#index-select; what is computed: docs/model.md#indexer, docs/model.md#two-level-selection).

    select(q, weights, keys, position, ...) -> (top-k [B, S, k] int32, the candidate block mask
        [B, S, nb] or None, the attention's index list [B, S, W + k] or None), or None where the
        kernel does not take the call (the caller then runs model/indexer.py's plain-MLX path, the
        reference). The list comes with window = (rows [S, W] int32, R): each query's window rows,
        then its picks plus R, the -1s kept (what the attention concatenated itself;
        docs/design.md#index-list)

q [B, S, Hi, Di] (roped, fake-quantized), weights [B, S, Hi] as weights_proj returns them (the
kernel multiplies by `scale` in fp32, as the reference does after its cast), keys [B, T, Di].
On CUDA one index_scores launch whose last threadgroup per row selects (docs/design.md#grid-finish);
on Metal index_scores, then index_select. It replaces the reference's ~11 launches a scoring layer
(an fp32 copy of the keys, the score GEMM, relu-weighted head sum, visibility, the ranking keys, an
arg-partition, a sort, the -1s; the candidate source's block maxima and partition). The scores are
the kernel's own order of the same sums (bounded against float64: docs/numerics.md#index-scores);
the selection from given scores is the reference's, bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import Kernel, backend, float_bits, grid_finish, register, scalar_int32

THREADS = 256  # IX_THREADS
TILE = 32  # IX_TILE: entries a threadgroup scores
MAX_HEADS = 32  # IX_HEADS
MAX_ROWS = 16  # query rows (B · S) a call may hold: decode steps and DSpark verifies; a prefill's
# rows are scored by the reference's GEMM
MAX_HEAD_DIM = 128  # q of one row in threadgroup memory, 32 · DI floats (16 KB at 128), beside the
# selection's words: under Metal's 32 KB a threadgroup

# Whether the model's indexers take the kernel where it applies (False: the reference everywhere;
# benchmarks/bench_model.py --indexer-reference: the A/B).
ENABLED = True
# Whether the kernel also writes the attention's index list where asked (False: the attention builds
# it; benchmarks/bench_model.py --attention-builds-index-list: the A/B; docs/design.md#index-list).
LISTS = True

SCORES = register(
    Kernel(
        "index_scores",
        ("q", "weights", "keys", "position", "candidates", "counters", "rows"),
        ("scores", "topk", "blocks", "list"),
        includes=("float_bits.h", "grid_finish.h", "index_select.h"),
        max_threads=THREADS,
        examples=lambda: _examples(),
    )
)
SELECT = register(
    Kernel(
        "index_select",
        ("scores", "position", "candidates", "rows"),
        ("topk", "blocks", "list"),
        includes=("float_bits.h", "index_select.h"),
        max_threads=THREADS,
        examples=lambda: _select_examples(),
    )
)


def refusal(q: mx.array, weights: mx.array, keys: mx.array) -> str | None:
    """Why the kernel cannot score q against keys, or None."""
    if q.ndim != 4 or weights.shape != q.shape[:3] or keys.ndim != 3 or keys.shape[0] != q.shape[0]:
        shapes = f"{q.shape}, {weights.shape}, {keys.shape}"
        return f"q [B, S, Hi, Di], weights [B, S, Hi], keys [B, T, Di] expected, got {shapes}"
    B, S, Hi, Di = q.shape
    if keys.shape[2] != Di or keys.shape[1] == 0:
        return f"keys [B, T > 0, {Di}] expected, got {keys.shape}"
    if not 0 < B * S <= MAX_ROWS:
        return f"{B * S} query rows: the kernel takes 1..{MAX_ROWS} (a prefill's rows run the GEMM)"
    if Hi > MAX_HEADS or Di % 32 or Di > MAX_HEAD_DIM:
        return f"{Hi} heads of {Di}: the kernel takes <= {MAX_HEADS} heads of a multiple of 32 up to {MAX_HEAD_DIM}"
    if B * keys.shape[1] * Di >= 1 << 31:
        return "keys of 2^31 elements or more"
    return None


@graph_constants.constant
def _no_candidates() -> np.ndarray:
    """The candidates input of a launch that reads none."""
    return np.zeros((1, 1), np.bool_)


def _mode_and_candidates(candidates, build_candidates: bool, R: int) -> tuple[int, mx.array]:
    """The launch's MODE (0 plain, 1 the candidate source, 2 inside the candidate blocks) and its
    candidates input ([R, nb] in MODE 2, otherwise a constant the kernel does not read)."""
    if build_candidates:
        return 1, _no_candidates()
    if candidates is not None:
        return 2, candidates.reshape(R, -1)
    return 0, _no_candidates()


@graph_constants.constant
def _no_rows() -> np.ndarray:
    """The rows input of a launch that writes no index list."""
    return np.zeros((1, 1), np.int32)


def _window_input(window, S: int) -> tuple[mx.array, int, int]:
    """(rows input, LEAD, PLUS) of a launch: window = (rows [S, W] int32, R) writes the attention's
    index list (LEAD = W, PLUS = R); None none (a constant the kernel does not read, 0, 0)."""
    if window is None:
        return _no_rows(), 0, 0
    rows, plus = window
    if rows.ndim != 2 or rows.shape[0] != S or rows.dtype != mx.int32 or rows.shape[1] == 0 or plus < 0:
        raise ValueError(
            f"index select: window rows must be int32 [S={S}, W > 0] with R >= 0, got {rows.shape} {rows.dtype}"
        )
    return rows, rows.shape[1], int(plus)


def _selection(R: int, S: int, T: int, k, ratio, block, keep, candidates, build_candidates, window, guard) -> tuple:
    """What both launches that select (index_scores' finish, index_select) take: (the candidates
    and rows inputs, the selection's template values, the shapes and dtypes of topk, blocks and
    the list). Those outputs are [B, S, ...] as the model reads them (no reshape node: each is a
    node a decode step replays), or [R + guard, ...] with guard rows (tests)."""
    mode, cand = _mode_and_candidates(candidates, build_candidates, R)
    rows, lead, plus = _window_input(window, S)
    template = [
        *(("S", S), ("RATIO", ratio), ("K", k), ("MODE", mode), ("BLOCK", block), ("KEEP", keep)),
        *(("LEAD", lead), ("PLUS", plus)),
    ]
    lead_dims = (R + guard,) if guard else (R // S, S)
    nb = -(-T // block) if mode == 1 else 1
    listed = (*lead_dims, lead + k) if lead else (1, 1)
    return cand, rows, template, [(*lead_dims, k), (*lead_dims, nb), listed], [mx.int32, mx.bool_, mx.int32]


def scores_args(
    q,
    weights,
    keys,
    position,
    counters,
    *,
    ratio,
    k,
    scale,
    block,
    keep,
    candidates=None,
    build_candidates=False,
    window=None,
    finish=True,
    init_value=None,
    guard: int = 0,
) -> dict:
    """index_scores call kwargs (see the body's comment); `guard` extra rows of every output (tests)."""
    B, S, Hi, Di = q.shape
    R, T = B * S, keys.shape[1]
    cand, rows, selection, shapes, dtypes = _selection(
        R, S, T, k, ratio, block, keep, candidates, build_candidates, window, guard
    )
    grid_finish.check_counters(counters, R if finish else 1, "index scores")
    if not finish:  # index_select selects: 1-element stand-ins
        shapes = [(1, 1)] * 3
    template = [("HI", Hi), ("DI", Di)] + selection
    return dict(
        # q and weights as the model holds them ([B, S, Hi, Di], [B, S, Hi]): the kernel reads row r
        inputs=[q, weights, keys, scalar_int32(position), cand, counters, rows],
        output_shapes=[(R + guard, T)] + shapes,
        output_dtypes=[mx.float32] + dtypes,
        grid=(THREADS * -(-T // TILE), R, 1),
        threadgroup=(THREADS, 1, 1),
        template=template + [("SCALE_BITS", float_bits(scale)), ("FINISH", int(finish))],
        init_value=init_value,
    )


def select_args(
    scores,
    position,
    S: int,
    *,
    ratio,
    k,
    block,
    keep,
    candidates=None,
    build_candidates=False,
    window=None,
    init_value=None,
    guard: int = 0,
) -> dict:
    """index_select call kwargs: the selection of scores [R, T] (index_scores' first output)."""
    R, T = scores.shape
    cand, rows, template, shapes, dtypes = _selection(
        R, S, T, k, ratio, block, keep, candidates, build_candidates, window, guard
    )
    return dict(
        inputs=[scores, scalar_int32(position), cand, rows],
        output_shapes=shapes,
        output_dtypes=dtypes,
        grid=(THREADS * R, 1, 1),
        threadgroup=(THREADS, 1, 1),
        template=template,
        init_value=init_value,
    )


def select(
    q,
    weights,
    keys,
    position,
    *,
    ratio: int,
    k: int,
    scale: float,
    block: int,
    keep: int,
    candidates=None,
    build_candidates: bool = False,
    window=None,
    owner=None,
):
    """See the module docstring. `owner` keeps the launch's FINISH counters (grid_finish.held_counters);
    `k` = min(index_topk, T), `keep` = candidate_topk_blocks, `window` = (rows, R) or None."""
    name = backend()
    if not ENABLED or name == "cpu" or refusal(q, weights, keys) is not None:
        return None
    B, S = q.shape[:2]
    R, T = B * S, keys.shape[1]
    if not 0 < k <= T:
        raise ValueError(f"index select: k = {k} must be in 1..{T} (min(index_topk, entries))")
    if candidates is not None and candidates.shape[-1] * block < T:
        raise ValueError(f"index select: candidate mask {candidates.shape} covers fewer than {T} entries")
    common = dict(ratio=ratio, k=k, block=block, keep=keep, candidates=candidates, build_candidates=build_candidates)
    common["window"] = window if LISTS else None
    if grid_finish.merges(name):  # one launch where it may finish itself (--separate-launches: two)
        counters = grid_finish.held_counters(owner, R, "index_scores")
        _, topk, blocks, listed = SCORES(**scores_args(q, weights, keys, position, counters, scale=scale, **common))
    else:
        scores = SCORES(
            **scores_args(q, weights, keys, position, grid_finish.no_counters(), scale=scale, finish=False, **common)
        )[0]
        topk, blocks, listed = SELECT(**select_args(scores, position, S, **common))
    return topk, blocks if build_candidates else None, listed if common["window"] is not None else None


def _example_inputs(B=1, S=1, Hi=32, Di=128, T=40):
    q = mx.random.normal((B, S, Hi, Di), key=mx.random.key(5)).astype(mx.bfloat16)
    w = mx.random.normal((B, S, Hi), key=mx.random.key(6)).astype(mx.bfloat16)
    keys = mx.random.normal((B, T, Di), key=mx.random.key(7)).astype(mx.bfloat16)
    return q, w, keys, mx.array(70, mx.int32)


def _examples():
    q, w, keys, pos = _example_inputs()
    counters = grid_finish.split_counters(4)
    common = dict(ratio=2, k=16, scale=1 / 64, block=8, keep=2)
    mask = mx.ones((1, 1, 5), mx.bool_)
    return [
        scores_args(q, w, keys, pos, counters, **common),
        scores_args(q, w, keys, pos, counters, build_candidates=True, **common),
        scores_args(q, w, keys, pos, counters, candidates=mask, **common),
        scores_args(q, w, keys, pos, counters, window=(mx.zeros((1, 8), mx.int32), 12), **common),
        scores_args(
            q.astype(mx.float32)[:, :, :4, :64], w[..., :4], keys[..., :64], pos, counters, finish=False, **common
        ),
    ]


def _select_examples():
    scores = mx.random.normal((2, 40), key=mx.random.key(8))
    pos = mx.array(70, mx.int32)
    common = dict(ratio=2, k=16, block=8, keep=2)
    return [
        select_args(scores, pos, 2, **common),
        select_args(scores, pos, 2, build_candidates=True, **common),
        select_args(scores, pos, 2, candidates=mx.ones((2, 5), mx.bool_), **common),
        select_args(scores, pos, 2, window=(mx.zeros((2, 8), mx.int32), 12), **common),
    ]
