"""Decode-time state (spec §5): one `LayerCache` per layer, and the Engram n-gram history.

Every piece of state is indexed by absolute token position, so `trim(n)` is exact: a cache keeps
`trim_slack` tokens more than decoding needs (window rows older than the window, the raw fp32
compressor projections of recent tokens, older Engram ids) and can remove up to that many tokens
(at least `trim_slack`; `max_trim()` says exactly how many), also inside a compression group. A
larger trim raises instead of leaving a silently wrong cache.

Both classes follow the mlx-lm 0.32 cache contract (mlx-notes §8.4): `state` (arrays and Python
scalars) get/set, `from_state`, `is_trimmable`, `trim`, `size`, `empty`, `nbytes`, and they are
registered in `mlx_lm.models.cache` so `save_prompt_cache` / `load_prompt_cache` round-trip them.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import mlx.core as mx
import numpy as np

from .config import ModelArgs

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
    def merge(cls, caches) -> "BatchCache":
        """mlx-lm's BatchGenerator: the caches of several sequences, one per sequence."""
        return BatchCache.merge(caches)


class LayerCache(_PositionalCache):
    """The state of one attention layer.

    ring          [B, window + trim_slack, D] window KV; position p lives in slot p mod ring_size
                  (spec §4.3 "Sliding window"; the slack keeps rows a trim may bring back)
    kv, index_keys  owners only: compressed KV [B, cap, D] and index keys [B, cap, Di], entry j =
                  group j; `offset // ratio` entries are valid; grown in steps of `step`
    raw_kv, raw_gate  ratio > 1 owners: fp32 wkv / wgate projections of the last tokens (positions
                  raw_from .. offset-1); the open group is the last `offset % ratio` of them
                  (spec §8.14), the rest lets a trim reopen a group
    """

    step = 256

    def __init__(self, window: int, ratio: int = 0, owns_kv: bool = False,
                 trim_slack: int = DEFAULT_TRIM_SLACK):
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
        self.raw_from = 0  # position of raw_kv[:, 0]

    @property
    def ring_size(self) -> int:
        return self.window_size + self.trim_slack

    @property
    def raw_capacity(self) -> int:
        return self.trim_slack + self.ratio - 1 if self.owns_kv and self.ratio > 1 else 0

    # ------------------------------------------------------------ one forward (Attention calls)
    # Every method places this call's tokens at positions offset .. offset+S-1; `advance(S)` moves
    # the offset once the layer is done.

    def update_window(self, kv: mx.array) -> tuple[mx.array, mx.array]:
        """Store the window KV of the new tokens; return what their queries attend to.

        Returns (window [B, ring_size + S, D], rows [S, window] int32): `window` is the ring as it
        was, then the new rows; rows[s, c] indexes the row of `window` holding position
        t - window + 1 + c (t = offset + s), or -1 when that position is before the start.
        """
        B, S, D = kv.shape
        R, W, o = self.ring_size, self.window_size, self.offset
        if self.ring is None:
            self.ring = mx.zeros((B, R, D), kv.dtype)
        elif self.ring.shape[0] != B or self.ring.shape[2] != D:
            raise ValueError(f"LayerCache: got kv of shape {kv.shape}; this cache holds batch "
                             f"{self.ring.shape[0]} and width {self.ring.shape[2]}")
        window = mx.concatenate([self.ring, kv], axis=1)
        p = o + np.arange(S)[:, None] - W + 1 + np.arange(W)[None, :]
        rows = np.where(p < 0, -1, np.where(p >= o, R + p - o, p % R))
        # Only the last R new rows can survive in the ring; write them at their slots.
        keep = min(S, R)
        first = o + S - keep
        slot = first % R
        split = min(keep, R - slot)
        self.ring[:, slot : slot + split] = kv[:, S - keep : S - keep + split]
        if split < keep:
            self.ring[:, : keep - split] = kv[:, S - keep + split :]
        self.ring_from = max(self.ring_from, o + S - R)
        return window, mx.array(rows.astype(np.int32))

    def group_inputs(self, kv: mx.array, gate: mx.array) -> tuple[mx.array, mx.array]:
        """Ratio > 1 owners: record the new raw projections; return the rows from the start of the
        open group on (the carried partial group, then the new tokens), fp32 [B, pending + S, D]."""
        S = kv.shape[1]
        pending = self.offset % self.ratio
        if self.raw_kv is None:
            all_kv, all_gate = kv, gate
        else:
            all_kv = mx.concatenate([self.raw_kv, kv], axis=1)
            all_gate = mx.concatenate([self.raw_gate, gate], axis=1)
        start = all_kv.shape[1] - S - pending
        if start < 0:
            raise ValueError(f"LayerCache: the open group needs {pending} raw rows before offset "
                             f"{self.offset}, but only {all_kv.shape[1] - S} are held")
        keep = min(all_kv.shape[1], self.raw_capacity)
        cut = all_kv.shape[1] - keep
        self.raw_kv, self.raw_gate = all_kv[:, cut:], all_gate[:, cut:]
        self.raw_from = self.offset + S - keep
        return all_kv[:, start:], all_gate[:, start:]

    def append_compressed(self, kv: mx.array | None, index_keys: mx.array | None
                          ) -> tuple[mx.array | None, mx.array | None]:
        """Owners: store the new compressed entries (None: no group completed in this call).
        Returns the valid entries (kv [B, T, D], index keys [B, T, Di]), or (None, None) if T = 0."""
        first = self.offset // self.ratio
        n = 0 if kv is None else kv.shape[1]
        if n:
            self.kv = self._grow(self.kv, first, kv)
            self.index_keys = self._grow(self.index_keys, first, index_keys)
            self.kv[:, first : first + n] = kv
            self.index_keys[:, first : first + n] = index_keys
        count = first + n
        if count == 0:
            return None, None
        return self.kv[:, :count], self.index_keys[:, :count]

    def _grow(self, buf: mx.array | None, used: int, rows: mx.array) -> mx.array:
        """A buffer with room for `rows` after the first `used` entries (grown in steps)."""
        need = used + rows.shape[1]
        if buf is not None and need <= buf.shape[1]:
            return buf
        B, _, D = rows.shape
        cap = -(-need // self.step) * self.step
        fresh = mx.zeros((B, cap - used, D), rows.dtype)
        return fresh if buf is None or used == 0 else mx.concatenate([buf[:, :used], fresh], axis=1)

    def advance(self, n: int) -> None:
        self.offset += n

    def arrays(self) -> list[mx.array]:
        """The arrays this cache holds: evaluate them after each forward so a long generation does
        not build an ever longer lazy graph."""
        held = (self.ring, self.kv, self.index_keys, self.raw_kv, self.raw_gate)
        return [a for a in held if a is not None]

    # ------------------------------------------------------------ trim

    def max_trim(self) -> int:
        limit = self.offset
        if self.ring_from > 0:  # the next query needs positions offset' - window + 1 .. offset' - 1
            limit = min(limit, self.offset - (self.ring_from + self.window_size - 1))
        if self.raw_from > 0:  # the open group after the trim must still be held raw
            limit = min(limit, self.offset - -(-self.raw_from // self.ratio) * self.ratio)
        return max(limit, 0)

    def _drop(self, n: int) -> None:
        # Ring rows past the new offset are never read again before they are rewritten, and
        # compressed entries past (offset - n) // ratio are ignored and overwritten.
        if self.raw_kv is not None:
            keep = self.offset - n - self.raw_from
            self.raw_kv, self.raw_gate = self.raw_kv[:, :keep], self.raw_gate[:, :keep]

    # ------------------------------------------------------------ mlx-lm contract

    @property
    def state(self):
        count = self.offset // self.ratio if self.owns_kv else 0
        kv = self.kv[:, :count] if self.kv is not None and count else None
        keys = self.index_keys[:, :count] if self.index_keys is not None and count else None
        return (self.ring, kv, keys, self.raw_kv, self.raw_gate, self.offset, self.ring_from,
                self.raw_from, self.window_size, self.ratio, self.owns_kv, self.trim_slack)

    @state.setter
    def state(self, v):
        if len(v) != 12:
            raise ValueError(f"LayerCache.state: expected 12 entries, got {len(v)}")
        (self.ring, self.kv, self.index_keys, self.raw_kv, self.raw_gate, offset, ring_from,
         raw_from, window, ratio, owns_kv, trim_slack) = v
        self.offset, self.ring_from, self.raw_from = int(offset), int(ring_from), int(raw_from)
        self.window_size, self.ratio, self.trim_slack = int(window), int(ratio), int(trim_slack)
        self.owns_kv = bool(owns_kv)
        count = self.offset // self.ratio if self.owns_kv else 0
        held = 0 if self.kv is None else self.kv.shape[1]
        if held != count:
            raise ValueError(f"LayerCache.state: {held} compressed entries for offset {self.offset} "
                             f"and ratio {self.ratio} (expected {count})")
        if self.raw_capacity:
            raw = 0 if self.raw_kv is None else self.raw_kv.shape[1]
            if raw != self.offset - self.raw_from or raw < self.offset % self.ratio:
                raise ValueError(f"LayerCache.state: {raw} raw rows from position {self.raw_from} do not "
                                 f"reach offset {self.offset} with its open group")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def make_layer_cache(args: ModelArgs, layer_id: int, trim_slack: int = DEFAULT_TRIM_SLACK) -> LayerCache:
    """The cache of backbone layer `layer_id`, or of a DSpark stage (layer_id >= num_hidden_layers)."""
    role = args.role(layer_id)
    _register_once()
    return LayerCache(args.sliding_window, role.ratio, role.owns_kv, trim_slack)


class EngramHistory(_PositionalCache):
    """The last compressed token ids per batch row (spec §4.4d: decode needs max_ngram_size - 1).

    Host-side numpy int64 (the hash runs on the host: its row ids pick rows to read from SSD).
    Positions before the first token read as NO_TOKEN.
    """

    NO_TOKEN = -1

    def __init__(self, length: int, trim_slack: int = DEFAULT_TRIM_SLACK):
        if length < 1 or trim_slack < 0:
            raise ValueError(f"EngramHistory: need length >= 1 and trim_slack >= 0, "
                             f"got {length} and {trim_slack}")
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
            raise ValueError(f"EngramHistory.update: ids must be an integer array [B, S], got "
                             f"{new_ids.dtype} {new_ids.shape}")
        B, S = new_ids.shape
        if self.ids is not None and self.ids.shape[0] != B:
            raise ValueError(f"EngramHistory.update: batch {B}, but this history holds batch "
                             f"{self.ids.shape[0]}")
        previous = self.last(B)
        held = new_ids.astype(np.int64) if self.ids is None else np.concatenate(
            [self.ids, new_ids.astype(np.int64)], axis=1)
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
    def state(self):
        ids = None if self.ids is None else mx.array(self.ids)
        return (ids, self.offset, self.kept_from, self.length, self.trim_slack)

    @state.setter
    def state(self, v):
        if len(v) != 5:
            raise ValueError(f"EngramHistory.state: expected 5 entries, got {len(v)}")
        ids, offset, kept_from, length, trim_slack = v
        self.ids = None if ids is None else np.array(ids, dtype=np.int64)
        self.offset, self.kept_from = int(offset), int(kept_from)
        self.length, self.trim_slack = int(length), int(trim_slack)

    @property
    def nbytes(self) -> int:
        return 0 if self.ids is None else self.ids.nbytes


def make_engram_history(args: ModelArgs, trim_slack: int = DEFAULT_TRIM_SLACK) -> EngramHistory:
    """The history the n-gram hash needs: the last max_ngram_size - 1 ids (spec §4.4d)."""
    return EngramHistory(args.engram_max_ngram_size - 1, trim_slack)


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
    def merge(cls, caches) -> "BatchCache":
        rows = list(caches)
        kinds = {type(c) for c in rows}
        if not rows or len(kinds) != 1 or not issubclass(kinds.pop(), _PositionalCache):
            raise ValueError(f"BatchCache.merge: needs one or more caches of one kind (LayerCache or "
                             f"EngramHistory), got {[type(c).__name__ for c in rows]}")
        return cls(rows)

    def extend(self, other: "BatchCache") -> None:
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
            raise ValueError("BatchCache: left-padded prompts would shift every position; "
                             "pass prompts right-padded with their lengths")
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
    joined = [mx.concatenate([s[k] for s in states]) if isinstance(v, mx.array) else v
              for k, v in enumerate(states[0])]
    return type(caches[0]).from_state(tuple(joined))


def _row(cache, b: int):
    """Batch row b of a stacked cache, as the cache of one sequence."""
    return type(cache).from_state(tuple(v[b : b + 1] if isinstance(v, mx.array) else v for v in cache.state))


def batched_forward(forward, inputs: mx.array, caches: list[BatchCache],
                    input_embeddings: mx.array | None = None) -> mx.array:
    """`forward(inputs, caches, input_embeddings) -> logits` over a BatchCache list (one per layer
    entry of the model's cache): rows grouped by real length and cache layout, each group run as
    one batch. Logits at right-padding positions are 0 (mlx-lm never reads them)."""
    B, S = inputs.shape[:2]
    if any(len(c.rows) != B for c in caches):
        raise ValueError(f"batched_forward: inputs have {B} rows, the caches hold "
                         f"{sorted({len(c.rows) for c in caches})}")
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
    return mx.stack([mx.pad(per_row[b], [(0, S - per_row[b].shape[0])] + tail) if b in per_row
                     else mx.zeros((S, *first.shape[1:]), first.dtype) for b in range(B)])


def register_with_mlx_lm() -> bool:
    """Put the cache classes into `mlx_lm.models.cache`, where `load_prompt_cache` looks classes up
    by name (mlx-notes §8.4 pitfall), over the stand-ins of `mlx_dsv41_cache_hook` (which covers
    programs that read a cache file before building a model). Returns False when mlx-lm is not
    installed."""
    try:
        import mlx_lm.models.cache as mlx_lm_cache
    except ImportError:
        return False
    for cls in (LayerCache, EngramHistory):
        existing = getattr(mlx_lm_cache, cls.__name__, None)
        if existing is not None and existing is not cls and existing.__module__ != cls.__module__ \
                and not getattr(existing, "mlx_dsv41_stand_in", False):  # mlx_dsv41_cache_hook's
            raise RuntimeError(f"mlx_lm.models.cache already defines a different {cls.__name__} "
                               f"({existing.__module__}); refusing to replace it")
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
