"""DeepSeek-V4.1: Block and Model (docs/model.md#top-level, docs/model.md#mhc, docs/model.md#head),
following the mlx-lm model contract (docs/mlx.md#model-contract): `Model(args)`, `layers`,
`make_cache()`, `sanitize(weights)`, `__call__(inputs, cache=None, input_embeddings=None) ->
logits`.

Module attributes carry the official checkpoint names (docs/checkpoint.md#tensor-names), so a plain
checkpoint loads without renaming; `sanitize` only re-lays formats through `mlx_dsv41.quant`.

The DSpark draft head's stages (`mtp.{s}`, model/dspark.py) are built here when the config can
draft; `__call__(..., capture=True)` also returns the hidden rows they draft from.

Engram (docs/model.md#engram) runs partly on the host: the n-gram hash needs the token ids, and its
row ids pick rows to read from SSD. The model therefore holds a compressed-token map and one row
source per Engram layer, set with `set_engram(...)`; they are not parameters.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlx_dsv41 import quant
from mlx_dsv41.batch_cache import BatchCache, batched_forward
from mlx_dsv41.cache import (
    DraftCache,
    EngramHistory,
    LayerCache,
    make_draft_cache,
    make_engram_history,
    make_layer_cache,
)
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.kernels.grid_finish import held_counters
from mlx_dsv41.model import compiled_step
from mlx_dsv41.model.attention import Attention
from mlx_dsv41.model.engram import Engram, RowSource
from mlx_dsv41.model.engram_hash import CompressedTokenMap, EngramHashLayout
from mlx_dsv41.model.hyper_connections import Expansion, collapse_norm, expand_site, formed, hc_site, initial_mixes
from mlx_dsv41.model.moe import MoE
from mlx_dsv41.model.norm import RMSNorm


class Block(nn.Module):
    """One backbone layer: [engram], attention site, FFN site, with their mHC parameters."""

    attention_class = Attention  # a DSpark stage attends its own way (model/dspark.py)

    def __init__(self, args: ModelArgs, layer_id: int, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.hc_iters, self.hc_eps, self.norm_eps = args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps
        d, hc = args.hidden_size, args.hc_mult
        mix = (2 + hc) * hc
        self.attn = self.attention_class(args, layer_id)
        self.ffn = MoE(args, expert_range)
        self.attn_norm = RMSNorm(d, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, args.rms_norm_eps)
        # fp32 (docs/numerics.md#dtypes); official names hc_{attn,ffn}_{fn,base,scale}
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", mx.random.normal((mix, hc * d)) * (hc * d) ** -0.5)
            setattr(self, f"hc_{site}_base", mx.random.normal((mix,)) * 0.5)
            setattr(self, f"hc_{site}_scale", mx.ones((3,), dtype=mx.float32))
        if args.role(layer_id).engram:
            self.engram = Engram(args)

    def _site(self, streams: mx.array | Expansion, prev: mx.array, site: str):
        """(the streams, formed if they came as an Expansion; the site's input: its norm of the streams
        collapsed with the pre of `prev`, the previous site's mixes; this site's mixes)."""
        args = (
            prev,
            getattr(self, f"{site}_norm").weight,
            self.norm_eps,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"),
        )
        # On CUDA the site, with the expand before it, is one launch (kernels/grid_finish.py).
        kwargs = dict(
            iters=self.hc_iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps, counters=held_counters(self, 1, site)
        )
        if isinstance(streams, Expansion):
            return expand_site(*streams, *args, **kwargs)
        return (streams, *hc_site(streams, *args, **kwargs))

    def __call__(
        self,
        streams: mx.array,
        prev: mx.array,
        cache: LayerCache,
        shared: dict,
        engram_rows: mx.array | None = None,
        engram_live: mx.array | None = None,
    ) -> tuple[Expansion, mx.array]:
        """streams [B, S, HC, D] bf16 (or an Expansion forming them), prev [B, S, (2+HC)·HC] fp32 (the
        previous site's mixes, whose pre this block's attention collapses with) -> (the streams as an
        Expansion of the FFN's output: the next site forms them; `formed` for an array, the FFN
        site's mixes). Engram, if any, runs first (docs/model.md#top-level)."""
        if engram_rows is not None:
            streams = self.engram(formed(streams), engram_rows, engram_live)
        # Single-pass mHC (docs/model.md#mhc, docs/model.md#mhc-schedule): each site collapses with
        # the previous site's pre; a site's mixes are one array (post and comb read by expand).
        streams, x, attn_mixes = self._site(streams, prev, "attn")
        streams, x, ffn_mixes = self._site(
            Expansion(self.attn(x, cache, shared), streams, attn_mixes), attn_mixes, "ffn"
        )
        return Expansion(self.ffn(x), streams, ffn_mixes), ffn_mixes


# Checkpoint tensors the text model never reads (docs/checkpoint.md#tensor-names;
# docs/mlx.md#lazy-loading: dropped tensors are never loaded, which is how the Engram tables stay on
# SSD).
_DROP = re.compile(r"^(vision\.|aligner\.|image_)|\.gate\.bias_vl$|^layers\.\d+\.engram\.embed\.")
# The DSpark draft head (docs/dspark.md#tensors): read when the model drafts, dropped otherwise.
MTP = re.compile(r"^mtp\.")
_EXPERT_PREFIX = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.")
# Stored in fp32 in the release and computed from fp32 (docs/numerics.md#dtypes).
FP32_STORED = re.compile(r"\.(hc_(attn|ffn)_(fn|base|scale)|attn_sink|ffn\.gate\.bias)$")
# The weights of the reference's fp32 linears (docs/numerics.md#fp32-linears) and the fp32-stored tensors:
# kept as they are by `mlx_lm.convert --dtype` (cast_predicate).
_KEEP_DTYPE = re.compile(
    r"hc_(attn|ffn)_|attn_sink|\.gate\.|compressor\.|^head\.|^mtp\.\d+\.(markov_head\.head|confidence_head\.proj)\."
)


NORM_WEIGHT = re.compile(r"norm\.weight$")


def held_dtype(key: str, value: mx.array) -> mx.array:
    """A stored tensor as the model holds it: as stored, but RMSNorm weights in fp32 (vectors of D:
    the fused norm reads fp32, and a 16-bit copy would be one cast launch per norm per step)."""
    return value.astype(mx.float32) if NORM_WEIGHT.search(key) and mx.issubdtype(value.dtype, mx.floating) else value


class Model(nn.Module):
    def __init__(self, args: ModelArgs, expert_range: tuple[int, int] | None = None):
        super().__init__()
        args.validate()
        compiled_step.setting()  # a bad MLX_DSV41_COMPILE fails here, not at the first decode step
        self.args = args
        self.model_type = args.model_type
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, i, expert_range) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        from mlx_dsv41.model.dspark import DSparkStage  # it subclasses Block (defined here)

        # The DSpark stages (`mtp.{s}`); embed and head are the ones above (docs/dspark.md#tensors).
        self.mtp = [DSparkStage(args, s, expert_range) for s in range(args.dspark_stages)]
        self.dspark_unavailable: str | None = args.dspark_unavailable  # why there are no stages
        self._capture_layers = frozenset(args.dspark_target_layer_ids)
        # Config order: the hash layout's order of tables, primes and multipliers.
        self._engram_layers = list(args.engram_layer_ids)
        self._engram_hash: EngramHashLayout | None = None
        self._engram_map: CompressedTokenMap | None = None
        self._engram_rows: dict[int, RowSource] = {}
        self._compiled: compiled_step.CompiledStep | None = None  # built at the first compiled step
        self._compiled_draft: compiled_step.CompiledStep | None = None  # the first compiled draft block

    # ---------------------------------------------------------------- Engram inputs

    def set_engram(self, token_map: CompressedTokenMap, row_sources: dict[int, RowSource]) -> None:
        """The compressed-token map and one row source per Engram layer (not parameters).

        Checks the map size and the bucket primes against the config
        (docs/model.md#engram-checks)."""
        layout = EngramHashLayout.from_args(self.args, token_map)
        missing = sorted(set(self._engram_layers) - set(row_sources))
        extra = sorted(set(row_sources) - set(self._engram_layers))
        if missing or extra:
            raise ValueError(
                f"set_engram: row sources needed for Engram layers {self._engram_layers}, got {sorted(row_sources)}"
            )
        self._engram_hash, self._engram_map = layout, token_map
        self._engram_rows = dict(row_sources)

    @property
    def engram_sources(self) -> dict[int, RowSource]:
        """Engram layer -> its row source (read statistics: `source.stats`)."""
        return dict(self._engram_rows)

    def engram_row_ids(self, ids) -> np.ndarray:
        """int64 [B, S, Engram layers, columns]: the rows a sequence `ids` [B, S] starting at
        position 0 reads (the n-grams ending at each position; for inspection)."""
        return self._hash(np.asarray(ids, dtype=np.int64), make_engram_history(self.args))[1]

    def _hash(self, ids: np.ndarray, history: EngramHistory) -> tuple[np.ndarray, np.ndarray]:
        """(compressed ids [B, S], row ids [B, S, layers, columns]); advances `history`."""
        if self._engram_hash is None:
            raise RuntimeError(
                f"Engram layers {self._engram_layers} need a token map and row sources: call "
                f"model.set_engram(token_map, {{layer: row_source}}) first"
            )
        compressed = self._engram_map.compress(ids, dead_token_id=self.args.image_token_id)
        return compressed, self._engram_hash.row_ids(compressed, history.update(compressed))

    def _engram_inputs(self, inputs: mx.array, history: EngramHistory):
        """Host side of Engram: hash the n-grams ending at each position, read their rows."""
        ids = np.array(inputs, dtype=np.int64)  # host-readable ids (this waits for them)
        compressed, row_ids = self._hash(ids, history)
        B, S = ids.shape
        rows = {}
        for li, layer in enumerate(self._engram_layers):
            raw = self._engram_rows[layer].read(row_ids[:, :, li].reshape(-1))
            rows[layer] = mx.array(raw).reshape(B, S, row_ids.shape[-1], -1)
        dead = compressed < 0
        live = mx.array(~dead) if dead.any() else None
        return rows, live

    # ---------------------------------------------------------------- mlx-lm contract

    def make_cache(self) -> list:
        """One LayerCache per layer, then the Engram n-gram history if the model has Engram."""
        caches: list = [make_layer_cache(self.args, i) for i in range(self.args.num_hidden_layers)]
        if self._engram_layers:
            caches.append(make_engram_history(self.args))
        return caches

    def drop_dspark(self, reason: str) -> None:
        """Remove the DSpark stages (their weights are never read); `reason` says why."""
        self.mtp, self.dspark_unavailable = [], reason

    def make_draft_cache(self) -> DraftCache:
        """The DSpark state (rings and captured rows) to draft with (`model.dspark.draft_block`)."""
        if not self.mtp:
            raise ValueError(f"this model cannot draft: {self.dspark_unavailable}")
        return make_draft_cache(self.args)

    def __call__(
        self,
        inputs: mx.array,
        cache: list | None = None,
        input_embeddings: mx.array | None = None,
        *,
        capture: bool = False,
    ):
        """inputs [B, S] token ids -> logits [B, S, vocab] fp32.

        `input_embeddings` [B, S, D] replaces the embedding lookup (the ids still drive Engram).
        A few tokens at a time (decode, a DSpark verify) run as a compiled step on a GPU
        (model/compiled_step.py).
        capture=True returns (logits, main_hidden [B, S, T·D] bf16): for every position, the mean
        over the streams of the inputs of the dspark_target_layer_ids layers, in layer order, one
        bf16 rounding of the fp32 mean (docs/dspark.md#capture). The logits are the same either way.
        """
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be token ids [B, S], got shape {inputs.shape}")
        if capture and not self._capture_layers:
            raise ValueError("capture=True needs dspark_target_layer_ids in the config")
        if cache and isinstance(cache[0], BatchCache):  # mlx-lm BatchGenerator: rows at own positions
            if capture:
                raise ValueError("capture=True runs one batch at one position, not a BatchCache")
            return batched_forward(self, inputs, cache, input_embeddings)
        n = self.args.num_hidden_layers
        cache = self.make_cache() if cache is None else cache
        expected = n + (1 if self._engram_layers else 0)
        if len(cache) != expected:
            raise ValueError(
                f"cache has {len(cache)} entries; this model needs {expected} "
                f"(one per layer{', then the Engram history' if self._engram_layers else ''})"
            )
        layer_caches = cache[:n]
        offsets = {c.offset for c in layer_caches}
        if len(offsets) != 1:
            raise ValueError(f"the layer caches are at different offsets {sorted(offsets)}; they must move together")
        rows, live = self._engram_inputs(inputs, cache[n]) if self._engram_layers else ({}, None)
        B, S = inputs.shape
        dtype = self.embed.weight.dtype if input_embeddings is None else input_embeddings.dtype
        for c in layer_caches:  # every buffer at its final shape before a (compiled) step
            c.reserve(B, S, self.args.head_dim, self.args.index_head_dim, dtype)
        if compiled_step.compiles(B * S):
            if self._compiled is None:
                quant.hold_cpu_weights(self)  # decoded weights outside the trace, not in every replay
                self._compiled = compiled_step.CompiledStep(self._forward)
            return self._compiled(layer_caches, inputs, input_embeddings, rows, live, capture)
        return self._forward(
            layer_caches, mx.array(offsets.pop(), mx.int32), inputs, input_embeddings, rows, live, capture
        )

    def _forward(
        self,
        caches: list,
        position: mx.array,
        inputs: mx.array,
        input_embeddings,
        rows: dict,
        live,
        capture: bool = False,
    ):
        """The forward at `position` (an int32 array: the caches' common offset) -> logits (and the
        captured rows with `capture`)."""
        for c in caches:
            c.bind(position)
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        B, S, D = h.shape
        hc = self.args.hc_mult
        streams = mx.broadcast_to(h[:, :, None, :], (B, S, hc, D))
        mixes = initial_mixes(B, S, hc)
        shared: dict = {}  # one per forward: sources publish compressed KV, index keys, top-k
        captured = []
        for i, (layer, layer_cache) in enumerate(zip(self.layers, caches)):
            if capture and i in self._capture_layers:
                streams = formed(streams)
                captured.append(mx.mean(streams.astype(mx.float32), axis=2).astype(streams.dtype))
            streams, mixes = layer(streams, mixes, layer_cache, shared, rows.get(i), live)
        # The last FFN site's pre (docs/model.md#head): the first columns of its mixes.
        x = collapse_norm(formed(streams), mixes, self.norm.weight, self.args.rms_norm_eps)
        logits = self.head(x.astype(mx.float32))
        # Evaluating the logits also materialises every cache array, so a long generation never
        # builds a lazy chain through state the logits do not read (e.g. pending groups).
        logits = mx.depends(logits, [a for c in caches for a in c.arrays()])
        return (logits, mx.concatenate(captured, axis=-1)) if capture else logits

    # ---------------------------------------------------------------- loading

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Official checkpoint tensors -> this model's parameters.

        Drops what the text model does not read; builds every linear and experts module from the
        format stored for it (quant seam) and swaps it in; holds every tensor as stored but the
        RMSNorm weights (fp32, `held_dtype`).
        Nothing is evaluated: unread tensors are never loaded.
        """
        if self.mtp and not any(MTP.match(k) for k in weights):
            self.drop_dspark("the checkpoint has no DSpark weights (mtp.*)")
        weights = {k: v for k, v in weights.items() if not _DROP.search(k) and (self.mtp or not MTP.match(k))}
        experts: dict[str, dict[str, mx.array]] = {}
        out: dict[str, mx.array] = {}
        for k, v in weights.items():
            m = _EXPERT_PREFIX.match(k)
            (experts.setdefault(m.group(1), {}) if m else out)[k] = v

        args = self.args
        swaps = []
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                built = quant.make_linear(out, name, module.weight.shape[1], module.weight.shape[0])
            elif isinstance(module, quant.GroupedLinear):
                built = quant.make_grouped_linear(out, name, module.groups, module.in_features, module.out_features)
            elif name.endswith(".ffn.experts"):
                built = quant.make_experts(
                    experts.pop(name, {}),
                    name,
                    module.n_experts,
                    args.hidden_size,
                    args.moe_intermediate_size,
                    args.swiglu_limit,
                    module.expert_range,
                )
            else:
                continue
            for k in [k for k in out if k.startswith(name + ".")]:
                del out[k]
            out.update(quant.module_tensors(built, name))
            swaps.append((name, built))
        self.update_modules(tree_unflatten(swaps))  # nested dict/list tree of the swapped modules
        # Held as stored (the fp32 linears widen 16-bit weights where used:
        # docs/numerics.md#fp32-linears), but for the RMSNorm weights (docs/design.md#graph-constants).
        return {k: held_dtype(k, v) for k, v in out.items()}

    @property
    def cast_predicate(self):
        """mlx-lm convert --dtype: keep the fp32 tensors and the fp32 linears' weights as they are."""
        return lambda k: not _KEEP_DTYPE.search(k)
