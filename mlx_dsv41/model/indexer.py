"""The lightning indexer and the two-level selection of compressed entries (docs/model.md#indexer,
docs/model.md#two-level-selection; docs/numerics.md#stale-index-keys, docs/numerics.md#topk-ties,
docs/model.md#visibility).

Keys (KV-source layers only): k = k_norm(wk(latent)) from the PRE-RoPE compressed latent, RoPE on
its last dims at position j·r, FP4 fake quant (block 32, ue8m0).
Scores: qi = wq_b(qr) [S, Hi, Di] with RoPE at t and the same FP4 fake quant;
w = weights_proj(x) · Di^-0.5 · Hi^-0.5; score[s, j] = Σ_h relu(qi[s,h] · K[j]) · w[s,h] in fp32;
entry j is visible to the query at t iff j < (t+1) // r, otherwise its score is -inf.
Selection: the candidate source keeps, per query, the best `candidate_topk_blocks` blocks of
`candidate_block_size` entries by their max score, always including the block of the newest
visible entry; Reindex layers after it only score inside those blocks. Every index source then
takes the top min(index_topk, T) entries, sorted ascending; picks that are not visible become -1.
As in the reference (`idx >= lens -> -1`), a visible entry masked out by the candidate blocks can
still be picked when fewer than index_topk entries survive the mask (never at Flash sizes).

Ties (docs/numerics.md#topk-ties): ReLU and FP4 make exactly equal scores common, and top-k among
ties is backend-dependent in the reference. Here selection is made deterministic: entries (and
blocks) are ranked by (score, then lower index), a strict order, so every backend and every chunking
picks the same set.

On a GPU, up to 16 query rows (decode steps, verifies) are scored and selected by one kernel launch
(kernels/index_select.py, docs/design.md#index-select): the same selection on its own fixed-order
scores. The functions below are the plain-MLX path: the CPU, prefills, and the reference.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.kernels import index_select
from mlx_dsv41.model.fake_quant import INDEXER
from mlx_dsv41.model.norm import RMSNorm
from mlx_dsv41.model.rope import RoPE, make_rope
from mlx_dsv41.quant import linear_into

# Bound on the [B, rows, heads, T] score temporary: prefill scores queries in row chunks.
_SCORE_CHUNK_ELEMENTS = 1 << 26


def visible_counts(position: mx.array, length: int, ratio: int) -> mx.array:
    """Compressed entries visible to the queries at position .. position+length-1: (t+1) // r
    (int32 [length]; position an int32 array, so a compiled step is not specialised on it)."""
    return (position + graph_constants.arange(length, 1)) // ratio


def index_scores(q: mx.array, weights: mx.array, keys: mx.array, visible: mx.array) -> mx.array:
    """q [B, S, Hi, Di], weights [B, S, Hi] fp32, keys [B, T, Di], visible [S] -> scores [B, S, T]
    fp32, -inf where an entry is not visible (keys past the visible count may be any values)."""
    dots = q.astype(mx.float32) @ keys.astype(mx.float32)[:, None].swapaxes(-1, -2)  # [B, S, Hi, T]
    scores = mx.sum(mx.maximum(dots, 0.0) * weights[..., None], axis=2)
    seen = graph_constants.arange(keys.shape[1]) < visible[:, None]  # [T] broadcasts as [1, T]: no view to replay
    return mx.where(seen, scores, -mx.inf)


@graph_constants.constant
def _lower_index_first(n: int) -> np.ndarray:
    """int64 0xFFFFFFFF - j: the low half of a ranking key, larger for a lower index j."""
    return 0xFFFFFFFF - np.arange(n, dtype=np.int64)


def _ranking_keys(scores: mx.array) -> mx.array:
    """int64 keys in the order (score, then lower index first): larger is better, never equal."""
    bits = mx.view(scores + 0.0, mx.int32)  # + 0.0 turns -0 into +0: they are equal scores
    # Flipping the magnitude bits of negative floats makes the int32 order match the float order.
    ordered = mx.where(bits < 0, mx.bitwise_xor(bits, 0x7FFFFFFF), bits).astype(mx.int64)
    return ordered * (1 << 32) + _lower_index_first(scores.shape[-1])


def select_topk(scores: mx.array, k: int, visible: mx.array) -> mx.array:
    """The k best entries of each row of scores [B, S, T] -> int32 [B, S, k], ascending; picks at
    or past the row's visible count (visible [S]) are -1."""
    T = scores.shape[-1]
    picks = mx.argpartition(-_ranking_keys(scores), kth=k - 1, axis=-1)[..., :k].astype(mx.int32)
    dropped = picks >= visible[:, None]
    picks = mx.sort(mx.where(dropped, T, picks), axis=-1)  # dropped picks sort last ...
    return mx.where(picks == T, -1, picks)  # ... and read -1


def select_candidate_blocks(scores: mx.array, visible: mx.array, block: int, keep: int) -> mx.array:
    """The candidate source's block mask: scores [B, S, T] -> bool [B, S, ceil(T / block)]."""
    B, S, T = scores.shape
    nb = -(-T // block)
    padded = mx.pad(scores, [(0, 0), (0, 0), (0, nb * block - T)], constant_values=-mx.inf)
    block_scores = mx.max(padded.reshape(B, S, nb, block), axis=-1)
    # Pin the block of the newest visible entry: it is only partly filled
    # (docs/model.md#two-level-selection).
    newest = mx.where(visible > 0, (visible - 1) // block, -1)
    block_scores = mx.where(graph_constants.arange(nb) == newest[:, None], mx.inf, block_scores)
    keep = min(keep, nb)
    ranks = _ranking_keys(block_scores)
    kth_best = mx.partition(ranks, kth=nb - keep, axis=-1)[..., nb - keep : nb - keep + 1]
    return (ranks >= kth_best) & (block_scores > -mx.inf)


def apply_candidate_blocks(scores: mx.array, blocks: mx.array, block: int) -> mx.array:
    """Scores outside the candidate blocks become -inf."""
    inside = mx.repeat(blocks, block, axis=-1)[..., : scores.shape[-1]]
    return mx.where(inside, scores, -mx.inf)


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        role = args.role(layer_id)
        self.ratio = role.ratio
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.index_topk = args.index_topk
        self.block_size, self.topk_blocks = args.candidate_block_size, args.candidate_topk_blocks
        self.rope: RoPE = make_rope(args, layer_id)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        if role.owns_kv:
            self.wk = nn.Linear(args.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latent: mx.array, first: mx.array | int) -> mx.array:
        """Index keys of compressed entries first.. from their pre-RoPE latents [B, n, head_dim]."""
        return self.rope(self.wk(latent), first, step=self.ratio, norm=self.k_norm, then=INDEXER)

    def __call__(
        self,
        x: mx.array,
        qr: mx.array,
        keys: mx.array | None,
        position: mx.array,
        *,
        candidates: mx.array | None = None,
        build_candidates: bool = False,
        window: tuple | None = None,
    ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """x [B, S, D_model], qr [B, S, q_lora_rank] (the q_norm output), keys [B, T, Di] or None.

        Returns (top-k [B, S, min(index_topk, T)] int32, -1 = none; the candidate block mask
        [B, S, nb] when build_candidates; the attention's index list [B, S, W + k] where the kernel
        wrote it for window = (rows [S, W], R), else None: docs/design.md#index-list).
        `candidates` (a mask from the candidate source of this forward) restricts the scores
        before the top-k.
        """
        B, S, _ = x.shape
        if keys is None:
            return mx.zeros((B, S, 0), mx.int32), None, None
        T = keys.shape[1]
        q = linear_into(self.wq_b, qr, (B, S, self.n_heads, self.head_dim))
        q = self.rope(q, position, then=INDEXER)
        # Flash: 128^-0.5 · 32^-0.5 = 1/64, a power of two, so the fp32 product equals a bf16 one.
        scale = self.head_dim**-0.5 * self.n_heads**-0.5
        k = min(self.index_topk, T)
        projected = self.weights_proj(x)
        picked = index_select.select(  # one launch a layer where the kernel takes the rows
            q,
            projected,
            keys,
            position,
            ratio=self.ratio,
            k=k,
            scale=scale,
            block=self.block_size,
            keep=self.topk_blocks,
            candidates=candidates,
            build_candidates=build_candidates,
            window=window,
            owner=self,
        )
        if picked is not None:
            return picked
        return self._plain_selection(
            q, projected.astype(mx.float32) * scale, keys, position, k, candidates, build_candidates
        )

    def _plain_selection(self, q, weights, keys, position, k: int, candidates, build_candidates: bool) -> tuple:
        """__call__'s result from the plain-MLX path (the reference: the CPU, prefills), no index list."""
        B, S, T = q.shape[0], q.shape[1], keys.shape[1]
        visible = visible_counts(position, S, self.ratio)
        rows = max(1, _SCORE_CHUNK_ELEMENTS // (B * self.n_heads * T))
        topks, blocks = [], []
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            scores = index_scores(q[:, s0:s1], weights[:, s0:s1], keys, visible[s0:s1])
            if build_candidates:
                # The candidate source's own top-k is over its unmasked scores.
                blocks.append(select_candidate_blocks(scores, visible[s0:s1], self.block_size, self.topk_blocks))
            elif candidates is not None:
                scores = apply_candidate_blocks(scores, candidates[:, s0:s1], self.block_size)
            topks.append(select_topk(scores, k, visible[s0:s1]))
        topk = topks[0] if len(topks) == 1 else mx.concatenate(topks, axis=1)
        if not build_candidates:
            return topk, None, None
        return topk, blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=1), None
