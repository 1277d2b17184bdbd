"""DSpark, the checkpoint's own draft head (`mtp.0..`; docs/dspark.md#overview).

Given the main model's state at position p and the token x_{p+1} it chose, one pass proposes
`dspark_block_size` tokens for p+2.. (docs/dspark.md#overview):

  block:   [x_{p+1}, NOISE, ...] embedded with the main `embed`, 4 equal streams, one-hot pre,
           at RoPE positions p+1 ..
           (docs/dspark.md#block-input)
  stages:  `mtp.s` is a full mHC block (window-only attention, MoE with its own expert count,
           no Engram); (streams, ffn_pre) chain from stage to stage
           (docs/dspark.md#stage-chaining)
  context: the main model enters only through attention: each stage's ring holds
           fq8(rope_t(kv_norm(wkv(main_x[t])))), main_x = main_norm(main_proj(main_hidden))
           (stage 0's weights, used by every stage); the block attends to the ring's last window
           positions plus its own keys, not causally, and never caches them
           (docs/dspark.md#main-x, docs/dspark.md#stage-attention)
  head:    collapse, the last stage's `norm`, the main `head` (fp32), then slot by slot a
           rank-R markov bias from the previous token and a raw confidence logit
           (docs/dspark.md#output)

The stages are `Block`s with their own attention class; `draft_block` runs them for one block.
Their rings live in a `cache.DraftCache`, written only by `draft_block` from the main hidden rows
the cache holds (docs/dspark.md#stage-cache, docs/dspark.md#stage-rollback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41 import graph_constants, quant
from mlx_dsv41.cache import DraftCache, LayerCache
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.model import compiled_step
from mlx_dsv41.model.attention import Attention
from mlx_dsv41.model.deepseek_v41 import Block
from mlx_dsv41.model.hyper_connections import collapse, formed, initial_mixes
from mlx_dsv41.model.norm import RMSNorm

MAIN_X = "dspark.main_x"  # key of the shared dict: main_x rows of the positions the rings lack


class StageAttention(Attention):
    """A stage's attention (docs/dspark.md#stage-attention). First the ring gets the entries of the
    main positions it lacks (main_x rows in shared[MAIN_X], the last one at p); then each block
    slot, at p+1+i, attends to the ring's positions p-window+1 .. p (those before 0 excluded) and to
    all block keys, which are not cached. One key set for every slot: not causal inside the
    block."""

    def __call__(self, x: mx.array, cache: LayerCache, shared: dict) -> mx.array:
        B, S, _ = x.shape
        main_x = shared[MAIN_X]
        position = cache.position  # an int32 array, as in Attention: a compiled draft replays it
        window, rows = self.store_window(main_x, position, cache)
        cache.advance(main_x.shape[1])
        start = position + main_x.shape[1]  # p + 1
        q, _ = self.queries(x, start)  # no fake quant on q (docs/dspark.md#dtypes)
        keys = mx.concatenate([window, self.window_keys(x, start)], axis=1)
        # rows[-1]: where the window of position p sits in `window`; the block keys follow it.
        idx = mx.concatenate([rows[-1], graph_constants.arange(S, window.shape[1])])
        indices = mx.broadcast_to(idx, (B, S, idx.shape[0]))
        return self.output(self.attend(q, keys, keys[:, :0], indices, start, x.dtype))


class MarkovHead(nn.Module):
    """`markov_head.embed` [V, R] and `.head` [V, R] (docs/dspark.md#output): a rank-R logit bias
    from the previous token; the head computes in fp32 from its stored bf16 (docs/numerics.md#fp32-linears)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """`confidence_head.proj` [1, D + R], no bias, an fp32 linear (docs/dspark.md#output,
    docs/numerics.md#fp32-linears)."""

    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1, bias=False)


class DSparkStage(Block):
    """`mtp.{stage}`: a window-only block (layer id num_hidden_layers + stage) with the stage's
    expert count; stage 0 adds `main_proj` / `main_norm`, the last stage `norm`, `markov_head` and
    `confidence_head` (docs/dspark.md#tensors)."""

    attention_class = StageAttention

    def __init__(self, args: ModelArgs, stage: int, expert_range: tuple[int, int] | None = None):
        stage_args = args.dspark_stage_args()
        super().__init__(
            stage_args,
            args.num_hidden_layers + stage,
            scaled_expert_range(expert_range, args.n_routed_experts, stage_args.n_routed_experts),
        )
        d, eps = args.hidden_size, args.rms_norm_eps
        if stage == 0:
            self.main_proj = nn.Linear(len(args.dspark_target_layer_ids) * d, d, bias=False)
            self.main_norm = RMSNorm(d, eps)
        if stage == args.dspark_stages - 1:
            self.norm = RMSNorm(d, eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + args.dspark_markov_rank)


def scaled_expert_range(expert_range: tuple[int, int] | None, n_from: int, n_to: int) -> tuple[int, int] | None:
    """A rank's share of n_from experts as the same share of n_to (expert parallelism: each rank
    holds the same fraction of the backbone's and of the stages' experts)."""
    if expert_range is None or n_from == n_to:
        return expert_range
    lo, hi = expert_range
    if (lo * n_to) % n_from or (hi * n_to) % n_from:
        raise ValueError(
            f"expert_range {expert_range} of {n_from} experts is no whole share of the "
            f"{n_to} DSpark experts; use another rank count or partition"
        )
    return lo * n_to // n_from, hi * n_to // n_from


@dataclass
class Draft:
    """One draft block (docs/dspark.md#output), lazy until evaluated.

    tokens      [B, S + 1] int32: x_{p+1}, then the drafts d_1 .. d_S
    logits      [B, S, V] fp32: G_0 .. G_{S-1}, the markov-biased logits d_{j+1} was chosen from
                (not temperature-scaled)
    confidence  [B, S] fp32: the raw confidence logit of each slot (no sigmoid)
    """

    tokens: mx.array
    logits: mx.array
    confidence: mx.array


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def draft_block(model, cache: DraftCache, token: mx.array, choose: Callable[[mx.array], mx.array] = greedy) -> Draft:
    """Draft one block after position p = cache.offset - 1 (the main model's last position), from
    the chosen token x_{p+1} (`token` [B] int). `choose(logits [B, V]) -> [B]` picks each slot's
    token from its biased logits (argmax, or a sample: its distribution is the Q of speculative
    sampling). Writes the rings' missing entries, up to p, and nothing else.

    With MLX_DSV41_COMPILE=1 a greedy block (`choose` is `greedy`) runs as a compiled step, traced
    once per number of ring rows to write and replayed (compiled_step.compiles_draft); sampling
    stays eager (its random draws would have to be threaded through the trace)."""
    if not model.mtp:
        raise ValueError(f"this model cannot draft: {model.dspark_unavailable}")
    rows = cache.rows_to_write()
    token = token.astype(mx.int32)
    if choose is greedy and compiled_step.compiles_draft():
        for ring in cache.rings:  # every buffer at its final shape before the trace
            ring.reserve(token.shape[0], rows.shape[1], model.args.head_dim, 0, rows.dtype)
        if model._compiled_draft is None:
            quant.hold_cpu_weights(model)  # decoded weights outside the trace, not in every replay
            model._compiled_draft = CompiledDraft(partial(_draft_forward, model, choose=greedy))
        static = (rows.shape[1], "greedy")  # the ring rows to write (1 .. block + 1), the choice
        out = model._compiled_draft.run(cache.rings, static, [rows, token], rows.shape[1])
    else:
        out = _draft_forward(model, cache.rings, mx.array(cache.rings[0].offset, mx.int32), rows, token, choose)
    draft = Draft(*out)
    draft.tokens = mx.depends(draft.tokens, cache.arrays())  # evaluating the tokens writes the rings
    return draft


class CompiledDraft(compiled_step.CompiledStep):
    """The draft block as a compiled step: `forward(rings, position, rows, token)`."""

    def call_forward(self, caches, position, static, arrays) -> list:
        return list(self._forward(caches, position, *arrays))


def _draft_forward(model, rings: list[LayerCache], position: mx.array, rows: mx.array, token: mx.array, choose):
    """The block from the rings at `position` (an int32 array: their offset), the hidden rows they
    write and x_{p+1} (int32 [B]) -> (tokens, logits, confidence) as in `Draft`."""
    args, stages = model.args, model.mtp
    for ring in rings:
        ring.bind(position)
    first, last = stages[0], stages[-1]
    shared = {MAIN_X: first.main_norm(first.main_proj(rows))}  # docs/dspark.md#main-x
    B, S, hc = token.shape[0], args.dspark_block_size, args.hc_mult
    noise = mx.full((B, S - 1), args.dspark_noise_token_id, dtype=mx.int32)
    h = model.embed(mx.concatenate([token[:, None], noise], axis=1))
    streams = mx.broadcast_to(h[:, :, None, :], (B, S, hc, h.shape[-1]))
    mixes = initial_mixes(B, S, hc)
    for stage, ring in zip(stages, rings):
        streams, mixes = stage(streams, mixes, ring, shared)
    z = collapse(formed(streams), mixes)  # with the last stage's ffn pre; not normed (docs/dspark.md#output)
    base = model.head(last.norm(z).astype(mx.float32))  # [B, S, V] fp32
    return _markov_chain(last, z, base, token, choose)


def _markov_chain(last: DSparkStage, z: mx.array, base: mx.array, token: mx.array, choose):
    """Slot by slot (docs/dspark.md#output): the bias and the confidence come from the PREVIOUS
    token (x_{p+1} for slot 0, then the chain's own choices). Returns (tokens, logits,
    confidence) as in `Draft`."""
    out, logits, confidence = [token], [], []
    for i in range(base.shape[1]):
        e = last.markov_head.embed(out[-1])  # [B, R] bf16
        g = base[:, i] + last.markov_head.head(e.astype(mx.float32))  # one fp32 add
        c = last.confidence_head.proj(mx.concatenate([z[:, i], e], axis=-1).astype(mx.float32))
        logits.append(g)
        confidence.append(c[:, 0])
        out.append(choose(g).astype(mx.int32))
    return mx.stack(out, axis=1), mx.stack(logits, axis=1), mx.stack(confidence, axis=1)
