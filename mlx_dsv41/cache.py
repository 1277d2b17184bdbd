"""Decode-time state (docs/cache.md#decode-state): one `LayerCache` per layer, the Engram n-gram
history, and the DSpark draft head's `DraftCache` (docs/dspark.md#stage-cache).

Every piece of state is indexed by absolute token position, so `trim(n)` is exact: a cache keeps
`trim_slack` tokens more than decoding needs (window rows older than the window, the raw fp32
compressor projections of recent tokens, older Engram ids) and can remove up to that many tokens
(at least `trim_slack`; `max_trim()` says exactly how many), also inside a compression group. A
larger trim raises instead of leaving a silently wrong cache.

Buffers keep their shapes from one decode step to the next (rings of fixed size, compressed
entries in a capacity that doubles), and index arithmetic reads the offset from an array: a
decode step can be compiled once and replayed (Model; docs/design.md, "Compiled decode step").
Batched generation over these caches is in batch_cache.py.

The classes follow the mlx-lm 0.32 cache contract (docs/mlx.md#cache-contract): `state` (arrays and
Python scalars) get/set, `from_state`, `is_trimmable`, `trim`, `size`, `empty`, `nbytes`, and they
are registered in `mlx_lm.models.cache` so `save_prompt_cache` / `load_prompt_cache` round-trip
them.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.config import ModelArgs

DEFAULT_TRIM_SLACK = 32


class _PositionalCache:
    """Trim and size bookkeeping shared by the caches; subclasses say how far back they can go."""

    offset: int
    trim_slack: int

    def max_trim(self) -> int:
        raise NotImplementedError

    def _drop(self, n: int) -> None:
        """Forget the last n tokens (called before `offset` moves back)."""
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(int(n), self.offset)
        limit = self.max_trim()
        if n > limit:
            raise ValueError(
                f"{type(self).__name__}.trim({n}): only the last {limit} tokens can be removed exactly "
                f"(trim_slack={self.trim_slack}); build the cache with a larger trim_slack"
            )
        if n > 0:
            self._drop(n)
            self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @classmethod
    def from_state(cls, state):
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    @classmethod
    def merge(cls, caches):
        """mlx-lm's BatchGenerator: the caches of several sequences, one per sequence."""
        from mlx_dsv41.batch_cache import BatchCache

        return BatchCache.merge(caches)


class LayerCacheState(NamedTuple):
    """LayerCache.state (the mlx-lm cache contract): arrays, then the Python bookkeeping."""

    ring: mx.array | None
    kv: mx.array | None  # the valid compressed entries only (offset // ratio)
    index_keys: mx.array | None
    raw_kv: mx.array | None
    raw_gate: mx.array | None
    offset: int
    ring_from: int
    raw_from: int
    window: int
    ratio: int
    owns_kv: bool
    trim_slack: int


class LayerCache(_PositionalCache):
    """The state of one attention layer, in buffers whose shapes change only when they grow.

    ring          [B, window + trim_slack, D] window KV; position p lives in slot p mod ring_size
                  (docs/model.md#sliding-window; the slack keeps rows a trim may bring back)
    raw_kv, raw_gate  ratio > 1 owners: [B, trim_slack + ratio - 1, D] fp32 wkv / wgate
                  projections of the latest tokens, position p in slot p mod raw_capacity: the open
                  group (docs/cache.md#open-groups) and what lets a trim reopen a group
    kv, index_keys  owners only: compressed KV [B, capacity, D] and index keys [B, capacity, Di],
                  entry j = group j; `offset // ratio` are valid, the rest is never read (queries
                  see entry j only once it is visible, docs/model.md#visibility); capacity doubles
                  when it fills

    A forward places its S tokens at positions offset .. offset+S-1. The index arithmetic of a
    call uses `position`, an int32 array holding the offset that the Model binds once per forward
    (`bind`), so a compiled decode step is not specialised on the offset; shapes and Python
    branches depend only on S, the buffer shapes and `offset % ratio`. `advance(S)` does the
    Python bookkeeping once the layer has run.
    """

    step = 256  # compressed-entry capacity grows to a multiple of this

    def __init__(self, window: int, ratio: int = 0, owns_kv: bool = False, trim_slack: int = DEFAULT_TRIM_SLACK):
        if window < 1:
            raise ValueError(f"LayerCache: window must be >= 1, got {window}")
        if trim_slack < 0:
            raise ValueError(f"LayerCache: trim_slack must be >= 0, got {trim_slack}")
        if owns_kv and ratio < 1:
            raise ValueError(f"LayerCache: a compressed-KV owner needs ratio >= 1, got {ratio}")
        self.window_size, self.ratio, self.owns_kv, self.trim_slack = window, ratio, owns_kv, trim_slack
        self.offset = 0
        self.ring: mx.array | None = None
        self.ring_from = 0  # lowest position still held by the ring
        self.kv: mx.array | None = None
        self.index_keys: mx.array | None = None
        self.raw_kv: mx.array | None = None
        self.raw_gate: mx.array | None = None
        self.raw_from = 0  # lowest position still held by the raw ring
        self._position: mx.array | None = None

    @property
    def ring_size(self) -> int:
        return self.window_size + self.trim_slack

    @property
    def raw_capacity(self) -> int:
        return self.trim_slack + self.ratio - 1 if self.owns_kv and self.ratio > 1 else 0

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[1]

    # ------------------------------------------------------------ one forward (Attention calls)

    def bind(self, position: mx.array | None) -> None:
        """The int32 array holding `offset` that this forward's index arithmetic uses."""
        self._position = position

    @property
    def position(self) -> mx.array:
        return mx.array(self.offset, mx.int32) if self._position is None else self._position

    def reserve(self, batch: int, tokens: int, dim: int, index_dim: int, dtype: mx.Dtype) -> None:
        """Allocate (or grow) every buffer the next `tokens` tokens need, before a forward: inside a
        compiled step each buffer must already exist at its final shape."""
        self._ensure_ring(batch, dim, dtype)
        self._ensure_raw(batch, dim)
        if self.owns_kv:
            self._ensure_compressed(batch, tokens, dim, index_dim, dtype)

    def _ensure_ring(self, batch: int, dim: int, dtype: mx.Dtype) -> None:
        if self.ring is None:
            self.ring = mx.zeros((batch, self.ring_size, dim), dtype)
        elif self.ring.shape[0] != batch or self.ring.shape[2] != dim:
            raise ValueError(
                f"LayerCache: got rows of batch {batch} and width {dim}; this cache holds batch "
                f"{self.ring.shape[0]} and width {self.ring.shape[2]}"
            )

    def _ensure_raw(self, batch: int, dim: int) -> None:
        if self.raw_capacity and self.raw_kv is None:
            self.raw_kv = mx.zeros((batch, self.raw_capacity, dim), mx.float32)
            self.raw_gate = mx.zeros((batch, self.raw_capacity, dim), mx.float32)

    def _ensure_compressed(self, batch: int, tokens: int, dim: int, index_dim: int, dtype: mx.Dtype) -> None:
        need = (self.offset + tokens) // self.ratio
        if self.kv is None:
            self.kv = mx.zeros((batch, self._grown(0, need), dim), dtype)
            self.index_keys = mx.zeros((batch, self.kv.shape[1], index_dim), dtype)
        elif need > self.capacity:
            cap = self._grown(self.capacity, need)
            self.kv, self.index_keys = (
                mx.pad(a, [(0, 0), (0, cap - a.shape[1]), (0, 0)]) for a in (self.kv, self.index_keys)
            )

    def _grown(self, capacity: int, need: int) -> int:
        """Capacity for `need` entries: doubled, in steps (a compiled step re-traces on growth)."""
        return -(-max(need, 2 * capacity, 1) // self.step) * self.step

    def update_window(self, kv: mx.array) -> tuple[mx.array, mx.array]:
        """Store the window KV of the new tokens; return what their queries attend to.

        Returns (window [B, ring_size (+ S), D], rows [S, window] int32): rows[s, c] indexes the
        row of `window` holding position t - window + 1 + c (t = offset + s), or -1 when that
        position is before the start. When the ring, with the new rows written, still holds every
        position the new queries see (S <= trim_slack + 1: decode steps, DSpark verifies), `window`
        is the ring itself; otherwise it is the ring as it was, then the new rows (a copy of both:
        two launches a layer on a GPU that the first case saves). The same keys in the same order
        either way (docs/cache.md#window-ring).
        """
        B, S, D = kv.shape
        R = self.ring_size
        if self.window_ring(B, S, D, kv.dtype) is not None:
            return self.written_window(store_rows(self.ring, kv, self.position, R), S)
        window = mx.concatenate([self.ring, kv], axis=1)
        rows = window_rows(self.position, S, self.window_size, R)
        # Only the last R new rows can survive in the ring; write them at their slots.
        keep = min(S, R)
        self.ring = store_rows(self.ring, kv[:, S - keep :], self.position + (S - keep), R)
        return window, rows

    def window_ring(self, batch: int, tokens: int, dim: int, dtype: mx.Dtype) -> mx.array | None:
        """The ring, where the window KV of `tokens` new tokens can be written into it in place
        (the writes replace only positions before every new query's window: tokens <=
        trim_slack + 1), else None. A caller that writes the rows itself (at slots (offset + s) %
        ring_size, as store_rows does) hands the result to `written_window`."""
        self._ensure_ring(batch, dim, dtype)
        return self.ring if tokens <= self.ring_size - self.window_size + 1 else None

    def written_window(self, ring: mx.array, tokens: int) -> tuple[mx.array, mx.array]:
        """update_window's result for the ring from `window_ring` with the new rows written."""
        self.ring = ring
        return ring, window_rows(self.position, tokens, self.window_size, self.ring_size, appended=False)

    def group_inputs(self, kv: mx.array, gate: mx.array) -> tuple[mx.array, mx.array]:
        """Ratio > 1 owners: record the new raw projections; return the rows from the start of the
        open group on (the carried partial group, then the new tokens), fp32 [B, pending + S, D]."""
        B, S, D = kv.shape
        Q, pending = self.raw_capacity, self.open_group(B, D)
        all_kv, all_gate = kv, gate
        if pending:
            held = ring_slots(self.position, -pending, pending, Q)
            # mx.take, not raw[:, held]: the same rows in 3 graph nodes where the slice-then-index
            # form builds 8 (an arange and casts for the sliced axis) at every step
            all_kv = mx.concatenate([mx.take(self.raw_kv, held, axis=1), kv], axis=1)
            all_gate = mx.concatenate([mx.take(self.raw_gate, held, axis=1), gate], axis=1)
        keep = min(S, Q)
        self.raw_kv = store_rows(self.raw_kv, kv[:, S - keep :], self.position + (S - keep), Q)
        self.raw_gate = store_rows(self.raw_gate, gate[:, S - keep :], self.position + (S - keep), Q)
        return all_kv, all_gate

    def open_group(self, batch: int, dim: int) -> int:
        """Ratio > 1 owners: the rows of the open group held in the raw rings (offset mod ratio), the
        rings made if new; a caller that writes the rings itself (kernels.compressor_raw, as
        group_inputs does) hands them to `written_raw`."""
        pending = self.offset % self.ratio
        self._ensure_raw(batch, dim)
        if pending > self.offset - self.raw_from:
            raise ValueError(
                f"LayerCache: the open group needs {pending} raw rows before offset "
                f"{self.offset}, but only {self.offset - self.raw_from} are held"
            )
        return pending

    def written_raw(self, raw_kv: mx.array, raw_gate: mx.array) -> None:
        """The raw rings with this call's rows written (see open_group)."""
        self.raw_kv, self.raw_gate = raw_kv, raw_gate

    def append_compressed(self, kv: mx.array | None, index_keys: mx.array | None) -> tuple[mx.array, mx.array]:
        """Owners: store the entries completed by this call (None: none); return the whole buffers
        (compressed KV [B, capacity, D], index keys [B, capacity, Di]). Entry j is valid once
        j < (offset + S) // ratio; callers read entries only through visibility
        (docs/model.md#visibility)."""
        n = 0 if kv is None else kv.shape[1]
        if n:
            self._ensure_compressed(kv.shape[0], n * self.ratio, kv.shape[2], index_keys.shape[2], kv.dtype)
            first = self.position // self.ratio  # n consecutive entries: never past the capacity
            self.kv = store_rows(self.kv, kv, first)
            self.index_keys = store_rows(self.index_keys, index_keys, first)
        return self.kv, self.index_keys

    def advance(self, n: int) -> None:
        """Bookkeeping after a forward of n tokens: the offset moves, the rings forget what their
        writes replaced, the bound position is released."""
        self.offset += n
        if self.ring is not None:
            self.ring_from = max(self.ring_from, self.offset - self.ring_size)
        if self.raw_capacity and self.raw_kv is not None:
            self.raw_from = max(self.raw_from, self.offset - self.raw_capacity)
        self._position = None

    def arrays(self) -> list[mx.array]:
        """The arrays this cache holds: evaluate them after each forward so a long generation does
        not build an ever longer lazy graph."""
        held = (self.ring, self.kv, self.index_keys, self.raw_kv, self.raw_gate)
        return [a for a in held if a is not None]

    # ------------------------------------------------------------ compiled steps (Model)

    _ARRAYS = ("ring", "kv", "index_keys", "raw_kv", "raw_gate")

    def step_arrays(self) -> tuple[mx.array | None, ...]:
        return tuple(getattr(self, name) for name in self._ARRAYS)

    def set_step_arrays(self, arrays) -> None:
        for name, a in zip(self._ARRAYS, arrays):
            setattr(self, name, a)

    def bookkeeping(self) -> tuple:
        return (self.offset, self.ring_from, self.raw_from, self._position)

    def restore_bookkeeping(self, saved: tuple) -> None:
        self.offset, self.ring_from, self.raw_from, self._position = saved

    def step_key(self) -> tuple:
        """What a compiled step is specialised on besides its arrays' shapes: the open group."""
        return (self.offset % self.ratio if self.ratio else 0,)

    # ------------------------------------------------------------ trim

    def max_trim(self) -> int:
        limit = self.offset
        if self.ring_from > 0:  # the next query needs positions offset' - window + 1 .. offset' - 1
            limit = min(limit, self.offset - (self.ring_from + self.window_size - 1))
        if self.raw_from > 0:  # the open group after the trim must still be held raw
            limit = min(limit, self.offset - -(-self.raw_from // self.ratio) * self.ratio)
        return max(limit, 0)

    def _drop(self, n: int) -> None:
        # Ring and raw rows past the new offset are never read before they are rewritten, and
        # compressed entries past (offset - n) // ratio are not visible until they are rewritten.
        self._position = None

    # ------------------------------------------------------------ mlx-lm contract

    @property
    def state(self) -> LayerCacheState:
        count = self.offset // self.ratio if self.owns_kv else 0
        kv = self.kv[:, :count] if self.kv is not None and count else None
        keys = self.index_keys[:, :count] if self.index_keys is not None and count else None
        return LayerCacheState(
            self.ring,
            kv,
            keys,
            self.raw_kv,
            self.raw_gate,
            self.offset,
            self.ring_from,
            self.raw_from,
            self.window_size,
            self.ratio,
            self.owns_kv,
            self.trim_slack,
        )

    @state.setter
    def state(self, v):
        if len(v) != len(LayerCacheState._fields):
            raise ValueError(f"LayerCache.state: expected {len(LayerCacheState._fields)} entries, got {len(v)}")
        v = LayerCacheState(*v)
        self.ring, self.kv, self.index_keys, self.raw_kv, self.raw_gate = (
            v.ring,
            v.kv,
            v.index_keys,
            v.raw_kv,
            v.raw_gate,
        )
        self.offset, self.ring_from, self.raw_from = int(v.offset), int(v.ring_from), int(v.raw_from)
        self.window_size, self.ratio, self.trim_slack = int(v.window), int(v.ratio), int(v.trim_slack)
        self.owns_kv = bool(v.owns_kv)
        self._position = None
        count = self.offset // self.ratio if self.owns_kv else 0
        held = 0 if self.kv is None else self.kv.shape[1]
        if held != count:
            raise ValueError(
                f"LayerCache.state: {held} compressed entries for offset {self.offset} "
                f"and ratio {self.ratio} (expected {count})"
            )
        if self.raw_capacity and self.raw_kv is not None and self.raw_kv.shape[1] != self.raw_capacity:
            raise ValueError(
                f"LayerCache.state: a raw ring of {self.raw_kv.shape[1]} rows; this cache keeps {self.raw_capacity}"
            )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def store_rows(buf: mx.array, rows: mx.array, first: mx.array, ring: int | None = None) -> mx.array:
    """buf [B, N, D] with rows [B, n, D] written at positions first .. first + n - 1 (int32 array),
    modulo `ring` for a ring buffer. Rows that cannot wrap (one row, or no ring) are one dynamic
    slice update, where an indexed write is a scatter plus the index arithmetic around it."""
    n = rows.shape[1]
    if ring is None or n == 1:
        start = first if ring is None else first % ring
        return mx.slice_update(buf, rows, start.reshape(1), axes=(1,))
    buf[:, ring_slots(first, 0, n, ring)] = rows
    return buf


def ring_slots(position: mx.array, start: int, count: int, size: int) -> mx.array:
    """Ring slots of positions position + start .. + count - 1 (int32 [count])."""
    return (position + graph_constants.arange(count, start)) % size


@graph_constants.constant
def _window_offsets(length: int, window: int) -> np.ndarray:
    """[length, window] int32: query s's window holds positions s - window + 1 .. s (plus the offset)."""
    return (np.arange(length)[:, None] - window + 1 + np.arange(window)[None, :]).astype(np.int32)


def window_rows(position: mx.array, length: int, window: int, ring: int, appended: bool = True) -> mx.array:
    """rows [length, window] int32 of LayerCache.update_window for queries at position + s: slot p mod
    ring of the ring, or with `appended` (the new rows after the ring as it was) row ring + p -
    position for the new positions."""
    p = position + _window_offsets(length, window)
    rows = p % ring
    if appended:
        rows = mx.where(p >= position, ring + p - position, rows)
    return mx.where(p < 0, -1, rows).astype(mx.int32)


def make_layer_cache(args: ModelArgs, layer_id: int, trim_slack: int = DEFAULT_TRIM_SLACK) -> LayerCache:
    """The cache of backbone layer `layer_id`, or of a DSpark stage (layer_id >= num_hidden_layers)."""
    role = args.role(layer_id)
    _register_once()
    return LayerCache(args.sliding_window, role.ratio, role.owns_kv, trim_slack)


class EngramHistoryState(NamedTuple):
    ids: mx.array | None  # [B, m] int64: positions offset - m .. offset - 1
    offset: int
    kept_from: int
    length: int
    trim_slack: int


class EngramHistory(_PositionalCache):
    """The last compressed token ids per batch row (docs/model.md#engram-hash: decode needs
    max_ngram_size - 1).

    Host-side numpy int64 (the hash runs on the host: its row ids pick rows to read from SSD).
    Positions before the first token read as NO_TOKEN.
    """

    NO_TOKEN = -1

    def __init__(self, length: int, trim_slack: int = DEFAULT_TRIM_SLACK):
        if length < 1 or trim_slack < 0:
            raise ValueError(f"EngramHistory: need length >= 1 and trim_slack >= 0, got {length} and {trim_slack}")
        self.length, self.trim_slack = length, trim_slack
        self.offset = 0
        self.ids: np.ndarray | None = None  # [B, m] int64: positions offset - m .. offset - 1
        self.kept_from = 0

    def last(self, batch: int) -> np.ndarray:
        """int64 [batch, length]: ids at positions offset - length .. offset - 1."""
        out = np.full((batch, self.length), self.NO_TOKEN, np.int64)
        if self.ids is not None:
            m = min(self.length, self.ids.shape[1])
            if m:
                out[:, self.length - m :] = self.ids[:, self.ids.shape[1] - m :]
        return out

    def update(self, new_ids: np.ndarray) -> np.ndarray:
        """Append ids [B, S] of the next S positions; return the history before them [B, length]."""
        new_ids = np.asarray(new_ids)
        if new_ids.ndim != 2 or not np.issubdtype(new_ids.dtype, np.integer):
            raise ValueError(
                f"EngramHistory.update: ids must be an integer array [B, S], got {new_ids.dtype} {new_ids.shape}"
            )
        B, S = new_ids.shape
        if self.ids is not None and self.ids.shape[0] != B:
            raise ValueError(f"EngramHistory.update: batch {B}, but this history holds batch {self.ids.shape[0]}")
        previous = self.last(B)
        held = (
            new_ids.astype(np.int64)
            if self.ids is None
            else np.concatenate([self.ids, new_ids.astype(np.int64)], axis=1)
        )
        keep = min(held.shape[1], self.length + self.trim_slack)
        self.ids = held[:, held.shape[1] - keep :].copy()
        self.offset += S
        self.kept_from = self.offset - keep
        return previous

    def max_trim(self) -> int:
        if self.kept_from == 0:
            return self.offset
        return max(self.offset - (self.kept_from + self.length), 0)

    def _drop(self, n: int) -> None:
        self.ids = self.ids[:, : self.offset - n - self.kept_from]

    @property
    def state(self) -> EngramHistoryState:
        ids = None if self.ids is None else mx.array(self.ids)
        return EngramHistoryState(ids, self.offset, self.kept_from, self.length, self.trim_slack)

    @state.setter
    def state(self, v):
        if len(v) != len(EngramHistoryState._fields):
            raise ValueError(f"EngramHistory.state: expected {len(EngramHistoryState._fields)} entries, got {len(v)}")
        ids, offset, kept_from, length, trim_slack = v
        self.ids = None if ids is None else np.array(ids, dtype=np.int64)
        self.offset, self.kept_from = int(offset), int(kept_from)
        self.length, self.trim_slack = int(length), int(trim_slack)

    @property
    def nbytes(self) -> int:
        return 0 if self.ids is None else self.ids.nbytes


def make_engram_history(args: ModelArgs, trim_slack: int = DEFAULT_TRIM_SLACK) -> EngramHistory:
    """The history the n-gram hash needs: the last max_ngram_size - 1 ids
    (docs/model.md#engram-hash)."""
    return EngramHistory(args.engram_max_ngram_size - 1, trim_slack)


class DraftCache(_PositionalCache):
    """The DSpark state of a batch of sequences at one position (docs/dspark.md#stage-cache,
    docs/dspark.md#stage-rollback).

    hidden  [B, m, F] the main model's captured rows (`Model(..., capture=True)`,
            docs/dspark.md#capture) of positions offset - m .. offset - 1, m <= window + trim_slack;
            `offset` follows the main caches (`append` after each main forward, `trim` with them)
    rings   one LayerCache per stage, holding the entries of the positions below its own offset.
            An entry is a pure function of its hidden row, so the rings are written only when a
            draft runs (`rows_to_write`), and never for a position a trim took back: a ring past
            the new offset is trimmed too, or emptied and rewritten from the held rows.
    """

    def __init__(self, window: int, rings: list[LayerCache], trim_slack: int = DEFAULT_TRIM_SLACK):
        if window < 1 or trim_slack < 0:
            raise ValueError(f"DraftCache: need window >= 1 and trim_slack >= 0, got {window} and {trim_slack}")
        self.window, self.rings, self.trim_slack = window, list(rings), trim_slack
        self.offset = 0
        self.hidden: mx.array | None = None
        self.kept_from = 0  # position of hidden[:, 0]

    def append(self, rows: mx.array) -> None:
        """The captured rows [B, S, F] of the main model's next S positions."""
        held = rows if self.hidden is None else mx.concatenate([self.hidden, rows], axis=1)
        keep = min(held.shape[1], self.window + self.trim_slack)
        self.hidden = held[:, held.shape[1] - keep :]
        self.offset += rows.shape[1]
        self.kept_from = self.offset - keep

    def rows_to_write(self) -> mx.array:
        """The hidden rows every ring must write before a draft at p = offset - 1: from each ring's
        offset (moved back to p if it is past it, so p is always rewritten, as the reference
        does; a ring too far behind starts afresh at p - window + 1) to p."""
        if self.offset < 1:
            raise ValueError("DraftCache: no main position yet (append the prefill's rows first)")
        p, first = self.offset - 1, max(0, self.offset - self.window)
        for i, ring in enumerate(self.rings):
            if ring.offset > p:
                ring.trim(ring.offset - p)
            elif ring.offset < first:
                self.rings[i] = ring = LayerCache(ring.window_size, 0, False, ring.trim_slack)
                ring.advance(first)
        start = self.rings[0].offset if self.rings else p
        if any(ring.offset != start for ring in self.rings):
            raise ValueError(f"DraftCache: rings at different positions {[r.offset for r in self.rings]}")
        return self.hidden[:, start - self.kept_from :]

    def arrays(self) -> list[mx.array]:
        held = [] if self.hidden is None else [self.hidden]
        return held + [a for ring in self.rings for a in ring.arrays()]

    def max_trim(self) -> int:
        if self.kept_from == 0:
            return self.offset
        return max(self.offset - (self.kept_from + self.window), 0)

    def _drop(self, n: int) -> None:
        offset = self.offset - n
        self.hidden = self.hidden[:, : offset - self.kept_from]
        for i, ring in enumerate(self.rings):
            if ring.offset > offset:
                if ring.offset - offset <= ring.max_trim():
                    ring.trim(ring.offset - offset)
                else:
                    self.rings[i] = LayerCache(ring.window_size, 0, False, ring.trim_slack)

    @property
    def state(self):
        """The held rows and positions; the rings are not saved (they are rewritten from the rows)."""
        return (
            self.hidden,
            self.offset,
            self.kept_from,
            self.window,
            self.trim_slack,
            len(self.rings),
            self.rings[0].window_size if self.rings else self.window,
        )

    @state.setter
    def state(self, v):
        if len(v) != 7:
            raise ValueError(f"DraftCache.state: expected 7 entries, got {len(v)}")
        self.hidden, offset, kept_from, window, trim_slack, stages, ring_window = v
        self.offset, self.kept_from = int(offset), int(kept_from)
        self.window, self.trim_slack = int(window), int(trim_slack)
        self.rings = [LayerCache(int(ring_window), 0, False, self.trim_slack) for _ in range(int(stages))]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def make_draft_cache(args: ModelArgs, trim_slack: int = DEFAULT_TRIM_SLACK) -> DraftCache:
    """The DSpark state of a model whose config drafts: one ring per stage
    (docs/dspark.md#stage-cache)."""
    if args.dspark_unavailable:
        raise ValueError(f"no DSpark draft cache: {args.dspark_unavailable}")
    rings = [make_layer_cache(args, args.num_hidden_layers + s, trim_slack) for s in range(args.dspark_stages)]
    return DraftCache(args.sliding_window, rings, trim_slack)


def register_with_mlx_lm() -> bool:
    """Put the cache classes into `mlx_lm.models.cache`, where `load_prompt_cache` looks classes up
    by name (docs/mlx.md#cache-class-lookup), over the stand-ins of `mlx_dsv41_cache_hook` (which
    covers programs that read a cache file before building a model). Returns False when mlx-lm is
    not installed."""
    try:
        import mlx_lm.models.cache as mlx_lm_cache
    except ImportError:
        return False
    for cls in (LayerCache, EngramHistory, DraftCache):
        existing = getattr(mlx_lm_cache, cls.__name__, None)
        if (
            existing is not None
            and existing is not cls
            and existing.__module__ != cls.__module__
            and not getattr(existing, "mlx_dsv41_stand_in", False)
        ):  # mlx_dsv41_cache_hook's
            raise RuntimeError(
                f"mlx_lm.models.cache already defines a different {cls.__name__} "
                f"({existing.__module__}); refusing to replace it"
            )
        setattr(mlx_lm_cache, cls.__name__, cls)
    return True


_registered = False


def _register_once() -> None:
    """Register when caches are built (if mlx-lm is installed), so a cache saved by this process or
    loaded after building a model round-trips whatever the import order was."""
    global _registered
    if not _registered:
        _registered = importlib.util.find_spec("mlx_lm") is None or register_with_mlx_lm()


# Importing mlx-lm costs ~1 s (it pulls in transformers): at import, register only if it is loaded.
if "mlx_lm.models.cache" in sys.modules:
    register_with_mlx_lm()
