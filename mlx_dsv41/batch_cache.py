"""Batched generation over per-sequence caches: mlx-lm's `BatchGenerator` (batch_generate, the
server) through `BatchCache` and `batched_forward`."""

from __future__ import annotations

import copy

import mlx.core as mx

from mlx_dsv41.cache import _PositionalCache


class BatchCache:
    """One layer's caches of a batch of sequences, for mlx-lm's `BatchGenerator` (batch_generate,
    the server): `merge`, `extend`, `filter`, `extract`, `prepare`, `finalize`, `state`, `nbytes`.

    Every position-dependent piece of state here (ring slots, compression groups, RoPE, Engram
    n-grams) follows absolute positions, so sequences at different positions cannot share one
    forward the way left-padded KV caches do. Each sequence keeps its own cache (`rows`), and
    `batched_forward` runs rows whose caches have the same layout (same positions, same shapes) as
    one stacked batch (their state is copied in and out of the stack at each forward) and the
    others separately: every row computes exactly what it computes alone. Prompts arrive
    right-padded; `prepare` records the real lengths so padding is never run.
    """

    def __init__(self, rows: list):
        self.rows = list(rows)
        self.remaining: list[int] | None = None  # real prompt tokens left per row (right padding)

    @classmethod
    def merge(cls, caches) -> BatchCache:
        rows = list(caches)
        kinds = {type(c) for c in rows}
        if not rows or len(kinds) != 1 or not issubclass(kinds.pop(), _PositionalCache):
            raise ValueError(
                f"BatchCache.merge: needs one or more caches of one kind (LayerCache or "
                f"EngramHistory), got {[type(c).__name__ for c in rows]}"
            )
        return cls(rows)

    def extend(self, other: BatchCache) -> None:
        if self.remaining is not None or other.remaining is not None:
            raise ValueError("BatchCache.extend: a batch in the middle of a padded prompt cannot grow")
        self.rows += other.rows

    def filter(self, keep) -> None:
        self.rows = [self.rows[i] for i in keep]
        if self.remaining is not None:
            self.remaining = [self.remaining[i] for i in keep]

    def extract(self, idx: int):
        """Row `idx` as the cache of one sequence (a copy: the batch may keep using its own)."""
        return copy.deepcopy(self.rows[idx])

    def prepare(self, *, lengths=None, right_padding=None, left_padding=None) -> None:
        if left_padding is not None and any(left_padding):
            raise ValueError(
                "BatchCache: left-padded prompts would shift every position; "
                "pass prompts right-padded with their lengths"
            )
        if right_padding is not None and any(right_padding):
            if lengths is None or len(lengths) != len(self.rows):
                raise ValueError(f"BatchCache.prepare: need one length per row ({len(self.rows)})")
            self.remaining = [int(n) for n in lengths]

    def finalize(self) -> None:
        self.remaining = None

    @property
    def state(self):
        return [row.state for row in self.rows]

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)

    def size(self) -> int:
        return max((row.offset for row in self.rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    def is_trimmable(self) -> bool:
        return False  # trim the sequences' own caches (extract), not a batch


def _layout(cache) -> tuple:
    """What must agree for caches to run stacked: every scalar of the state, array shapes and
    dtypes past the batch axis, and where arrays are absent."""
    return tuple((a.shape[1:], a.dtype) if isinstance(a, mx.array) else a for a in cache.state)


def _stack(caches: list):
    """Same-layout caches of single sequences -> one cache over their batch."""
    states = [c.state for c in caches]
    joined = [mx.concatenate([s[k] for s in states]) if isinstance(v, mx.array) else v for k, v in enumerate(states[0])]
    return type(caches[0]).from_state(tuple(joined))


def _row(cache, b: int):
    """Batch row b of a stacked cache, as the cache of one sequence."""
    return type(cache).from_state(tuple(v[b : b + 1] if isinstance(v, mx.array) else v for v in cache.state))


def batched_forward(
    forward, inputs: mx.array, caches: list[BatchCache], input_embeddings: mx.array | None = None
) -> mx.array:
    """`forward(inputs, caches, input_embeddings) -> logits` over a BatchCache list (one per layer
    entry of the model's cache): rows grouped by real length and cache layout, each group run as
    one batch. Logits at right-padding positions are 0 (mlx-lm never reads them)."""
    B, S = inputs.shape[:2]
    if any(len(c.rows) != B for c in caches):
        raise ValueError(
            f"batched_forward: inputs have {B} rows, the caches hold {sorted({len(c.rows) for c in caches})}"
        )
    remaining = caches[0].remaining
    real = [S] * B if remaining is None else [min(S, r) for r in remaining]
    groups: dict[tuple, list[int]] = {}
    for b in range(B):
        if real[b]:
            key = (real[b],) + tuple(_layout(c.rows[b]) for c in caches)
            groups.setdefault(key, []).append(b)
    per_row: dict[int, mx.array] = {}
    for rows in groups.values():
        n = real[rows[0]]
        pick = mx.array(rows)
        embeds = None if input_embeddings is None else input_embeddings[pick, :n]
        if len(rows) == 1:
            group_caches = [c.rows[rows[0]] for c in caches]
        else:
            group_caches = [_stack([c.rows[b] for b in rows]) for c in caches]
        logits = forward(inputs[pick, :n], group_caches, embeds)
        if len(rows) > 1:
            for c, stacked in zip(caches, group_caches):
                for j, b in enumerate(rows):
                    c.rows[b] = _row(stacked, j)
        for j, b in enumerate(rows):
            per_row[b] = logits[j]
    if remaining is not None:
        for c in caches:
            c.remaining = [r - k for r, k in zip(remaining, real)]
    if not per_row:
        raise ValueError("batched_forward: no row has tokens to run")
    first = next(iter(per_row.values()))
    tail = [(0, 0)] * (first.ndim - 1)
    return mx.stack(
        [
            mx.pad(per_row[b], [(0, S - per_row[b].shape[0])] + tail)
            if b in per_row
            else mx.zeros((S, *first.shape[1:]), first.dtype)
            for b in range(B)
        ]
    )
