"""CSA2 attention: one shared K=V latent, a sliding window, and selected compressed entries of the
layer's KV source (docs/model.md#attention; docs/model.md#layer-roles).

  Q:       qr = q_norm(wq_a(x)); q = wq_b(qr) -> [B, S, H, head_dim]; RoPE on the last dims at t
  KV:      kv = kv_norm(wkv(x)); RoPE at t; FP8 fake quant -> the layer's window ring
  owners:  compressor latents -> RoPE at j·r + FP4 fake quant -> compressed KV;
           index keys from the pre-RoPE latents (indexer.keys)
  select:  Full / Reindex layers run their indexer; Reuse layers take their index source's top-k
  attend:  one softmax over window ∪ selected entries with the per-head sink in the denominator,
           scale exactly head_dim^-0.5 (kernels.sparse_attention)
  output:  inverse RoPE at t, grouped wo_a, wo_b

Layers share compressed KV, index keys, top-k and the candidate mask through `shared`, one dict
per forward pass: sources publish under "kv.<layer>", "index_keys.<layer>", "topk.<layer>",
"candidates.<layer>" and later layers read by their role's source ids. Owners publish their whole
running index-key cache on every call, also when no group completed
(docs/numerics.md#stale-index-keys: the reference's stale-key bug is fixed on purpose).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.cache import LayerCache
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.kernels.sparse_attention import sparse_attention, sparse_attention_unrotated
from mlx_dsv41.model.compressor import Compressor
from mlx_dsv41.model.fake_quant import COMPRESSED_KV, WINDOW_KV
from mlx_dsv41.model.indexer import Indexer
from mlx_dsv41.model.norm import RMSNorm
from mlx_dsv41.model.rope import make_rope
from mlx_dsv41.quant import GroupedLinear, grouped_flat, linear_into, normed_linear, paired_linears, windowed_linears


def index_list(rows: mx.array, topk: mx.array, R: int) -> mx.array:
    """The attention's indices [B, S, W + k]: each query's window rows [S, W], then its picks of the
    compressed entries plus R (index i >= R reads pool[i - R]), the -1s kept. A scoring layer's
    index kernel writes the same list itself (docs/design.md#index-list)."""
    B, S, _ = topk.shape
    picks = mx.where(topk >= 0, topk + R, -1)
    return mx.concatenate([mx.broadcast_to(rows, (B, S, rows.shape[1])), picks], axis=-1)


def _read(shared: dict, kind: str, source: int, reader: int):
    key = f"{kind}.{source}"
    if key not in shared:
        raise KeyError(
            f"layer {reader} reads {key!r}, but layer {source} has not run in this forward "
            f"pass (shared holds {sorted(shared)}); pass the same dict to every layer in order"
        )
    return shared[key]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.role = args.role(layer_id)
        self.layer_id, self.hidden_size = layer_id, args.hidden_size
        self.candidate_source = args.candidate_source_layer_id
        self.n_heads, self.head_dim, self.o_groups = args.num_attention_heads, args.head_dim, args.o_groups
        self.scale = args.head_dim**-0.5  # exactly; no YaRN mscale (docs/model.md#attention)
        self.rope = make_rope(args, layer_id)
        # Ablation switch: False attends to the window only (the compressed path still runs and
        # publishes, so other layers are unaffected).
        self.attend_compressed = True

        H, Dh = args.num_attention_heads, args.head_dim
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, H * Dh, bias=False)
        self.wkv = nn.Linear(args.hidden_size, Dh, bias=False)
        self.kv_norm = RMSNorm(Dh, args.rms_norm_eps)
        self.wo_a = GroupedLinear(args.o_groups, H // args.o_groups * Dh, args.o_lora_rank)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = mx.zeros((H,), mx.float32)
        if self.role.owns_kv:
            self.compressor = Compressor(args, layer_id)
        if self.role.runs_indexer:
            self.indexer = Indexer(args, layer_id)

    def __call__(self, x: mx.array, cache: LayerCache, shared: dict) -> mx.array:
        """x [B, S, hidden] (attn_norm-ed) at positions cache.offset .. +S-1 -> [B, S, hidden]."""
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"Attention {self.layer_id}: x must be [B, S, {self.hidden_size}], got {x.shape}")
        if (cache.ratio, cache.owns_kv) != (self.role.ratio, self.role.owns_kv):
            raise ValueError(
                f"Attention {self.layer_id}: its cache must come from make_layer_cache(args, "
                f"{self.layer_id}) (ratio {self.role.ratio}, owner {self.role.owns_kv}); got ratio "
                f"{cache.ratio}, owner {cache.owns_kv}"
            )
        B, S, _ = x.shape
        cache.reserve(B, S, self.head_dim, self.indexer.head_dim if self.role.owns_kv else 0, x.dtype)
        position = cache.position  # an int32 array: a compiled step is not specialised on it
        q, qr, (window, rows) = self.queries_and_window(x, position, cache)
        indices, pool = None, window[:, :0]
        if self.role.ratio:
            selected, topk, listed = self._compressed(x, qr, position, cache, shared, (rows, window.shape[1]))
            if self.attend_compressed:
                pool = selected  # index i >= window rows reads pool[i - window rows]
                indices = listed if listed is not None else index_list(rows, topk, window.shape[1])
        if indices is None:
            indices = mx.broadcast_to(rows, (B, S, rows.shape[1]))
        o = self.attend(q, window, pool, indices, position, x.dtype)
        cache.advance(S)
        return self.output(o)

    def queries(self, x: mx.array, offset: mx.array | int) -> tuple[mx.array, mx.array]:
        """(q [B, S, H, head_dim] roped at offset.., qr [B, S, q_lora_rank]) of x [B, S, hidden]."""
        q, qr = self._query_rows(x)
        return self.rope(q, offset), qr

    def _query_rows(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(q [B, S, H, head_dim] before its rope, qr)."""
        B, S, _ = x.shape
        qr = normed_linear(self.wq_a, self.q_norm, x)  # one launch where the format allows
        return linear_into(self.wq_b, qr, (B, S, self.n_heads, self.head_dim)), qr

    def queries_and_window(self, x: mx.array, position: mx.array, cache: LayerCache):
        """(q, qr) as `queries` gives them and the window as `store_window` stores it; on a GPU
        wq_a (with q_norm) and wkv in one launch where their formats allow, which also writes the
        window keys into the ring where it can (quant.windowed_linears), wq_b's launch then turning
        q (docs/design.md#roped-linears); else that launch without the ring (quant.paired_linears)
        and the two ropes in one launch where the kernel takes both (RoPE.pair: rope_pair); the
        bytes of the separate launches either way."""
        B, S, _ = x.shape
        ring = cache.window_ring(B, S, self.head_dim, x.dtype)
        written = None if ring is None else self._written_by_linears(x, position, ring)
        if written is not None:  # the window keys written by wq_a and wkv's launch, q turned by wq_b's
            qr, keys = written
            turn = self.rope.turn(position, self.head_dim)
            q = linear_into(self.wq_b, qr, (B, S, self.n_heads, self.head_dim), rope=turn)
            return q, qr, cache.written_window(keys, S)
        if ring is not None:
            qr, kv = paired_linears(self.wq_a, self.wkv, x, self.q_norm)  # one launch where the formats allow
            q = linear_into(self.wq_b, qr, (B, S, self.n_heads, self.head_dim))
            pair = self.rope.pair(q, kv, position, norm=self.kv_norm, then=WINDOW_KV, ring=ring)
            q, keys = pair if pair is not None else (self.rope(q, position), self._window_rope(kv, position, ring))
            return q, qr, cache.written_window(keys, S)
        return *self.queries(x, position), self.store_window(x, position, cache)

    def _written_by_linears(self, x: mx.array, position: mx.array, ring: mx.array) -> tuple | None:
        """(qr, the ring with x's window keys written) from wq_a and wkv's one launch, where their
        format's kernel also writes the ring (quant.windowed_linears); else None."""
        window = self.rope.window_write(position, norm=self.kv_norm, then=WINDOW_KV, ring=ring)
        return None if window is None else windowed_linears(self.wq_a, self.wkv, x, self.q_norm, window)

    def window_keys(self, x: mx.array, offset: mx.array | int, ring: mx.array | None = None) -> mx.array:
        """The window KV [B, S, head_dim] of x at positions offset..: kv_norm(wkv(x)), roped, FP8
        fake-quantized over all dims (docs/model.md#attention); with `ring`, that ring with the
        rows written at their slots (RoPE's `ring`)."""
        return self._window_rope(self.wkv(x), offset, ring)

    def _window_rope(self, kv: mx.array, offset: mx.array | int, ring: mx.array | None) -> mx.array:
        return self.rope(kv, offset, norm=self.kv_norm, then=WINDOW_KV, ring=ring)

    def store_window(self, x: mx.array, position: mx.array, cache: LayerCache) -> tuple[mx.array, mx.array]:
        """The window KV of x's tokens (at position..) stored in the cache's ring; what
        cache.update_window returns. Where the rows go into the ring in place (decode steps,
        verifies) the rope writes them there: on a GPU one launch (docs/cache.md#window-ring)."""
        B, S, _ = x.shape
        ring = cache.window_ring(B, S, self.head_dim, x.dtype)
        if ring is None:
            return cache.update_window(self.window_keys(x, position))
        return cache.written_window(self.window_keys(x, position, ring), S)

    def attend(self, q, window, pool, indices, offset: mx.array, dtype) -> mx.array:
        """The attention output [B, S, H, head_dim] as the output projection reads it (`unrotated`);
        on a GPU one launch where the attention kernel turns it itself (the bytes of the two:
        docs/numerics.md#unrotated-output)."""
        sinks = self.attn_sink.astype(mx.float32)
        period = self.rope.whole_width(q.shape[-1])
        o = sparse_attention_unrotated(q, window, pool, indices, sinks, self.scale, period, offset, dtype)
        if o is None:
            o = self.unrotated(sparse_attention(q, window, pool, indices, sinks, self.scale), offset, dtype)
        return o

    def unrotated(self, o: mx.array, offset: mx.array | int, dtype) -> mx.array:
        """Attention output o [B, S, H, head_dim] (fp32) at positions offset.. rounded to dtype, then
        given the conjugate rotation at the query position."""
        return self.rope(o, offset, inverse=True, dtype=dtype)

    def output(self, o: mx.array) -> mx.array:
        """The output projection of the unrotated attention output [B, S, H, head_dim] -> [B, S, hidden]."""
        return self.wo_b(grouped_flat(self.wo_a, o, 2))

    def _compressed(self, x, qr, position: mx.array, cache: LayerCache, shared: dict, window: tuple):
        """Update / publish the shared state this layer owns; return (the compressed-KV buffer of
        its KV source [B, capacity, D], the top-k it attends to [B, S, k] (entries that are not yet
        visible are never picked), its index list for window = (rows [S, W], R) where the index
        source's kernel wrote one for the same window, else None)."""
        role, me = self.role, self.layer_id
        if role.owns_kv:
            latent, first = self.compressor(x, cache)
            kv = keys = None
            if latent is not None:
                kv = self.rope(latent, first, step=role.ratio, then=COMPRESSED_KV)
                keys = self.indexer.keys(latent, first)
            shared[f"kv.{me}"], shared[f"index_keys.{me}"] = cache.append_compressed(kv, keys)
        pool = _read(shared, "kv", role.kv_source, me)
        if role.runs_indexer:
            candidates = _read(shared, "candidates", self.candidate_source, me) if role.uses_candidates else None
            topk, blocks, listed = self.indexer(
                x,
                qr,
                _read(shared, "index_keys", role.kv_source, me),
                position,
                candidates=candidates,
                build_candidates=role.builds_candidates,
                window=window,
            )
            shared[f"topk.{me}"] = topk
            # the list and the window it holds: (R, W) fix the rows of one forward
            shared[f"index_list.{me}"] = (window[1], window[0].shape[1], listed)
            if role.builds_candidates:
                shared[f"candidates.{me}"] = blocks
        R, W, listed = shared.get(f"index_list.{role.index_source}", (None, None, None))
        listed = listed if (R, W) == (window[1], window[0].shape[1]) else None
        return pool, _read(shared, "topk", role.index_source, me), listed
