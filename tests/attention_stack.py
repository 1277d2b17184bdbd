"""Test helpers for the attention side: a tiny config covering every attention role, a residual
stack of Attention layers with random non-zero weights, and an independent float64 numpy
reference of docs/model.md#attention for the whole stack, written from the docs without the MLX
code.

The reference rounds to bf16 where the model holds bf16 values (linear outputs, norms, RoPE
outputs, the attention output, the residual) and computes everything else in float64; the fake
quantizers use ml_dtypes' float8_e4m3fn / float4_e2m1fn casts as the oracle.
"""

from __future__ import annotations

import math
import sys

import ml_dtypes
import mlx.core as mx
import mlx.utils
import numpy as np

from mlx_dsv41.cache import make_layer_cache
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.model.attention import Attention
from mlx_dsv41.model.norm import RMSNorm
from mlx_dsv41.synthetic import TINY

# The tiny config's attention stack (mlx_dsv41.synthetic.TINY) without its Engram-only window layer
# 1, Engram and the DSpark head, with a narrower o_lora_rank and 3 candidate blocks kept. Roles:
# 0 window-only | 1 Full r=2 | 2 Reuse r=2 | 3 Full r=1 + candidate source | 4 Reuse r=1 |
# 5 Reindex (uses candidates) | 6 Reuse after the Reindex layer.
ATTENTION_TINY = dict(
    TINY,
    num_hidden_layers=7,
    compress_ratios=(0, 2, 2, 1, 1, 1, 1),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3, 5),
    candidate_source_layer_id=3,
    o_lora_rank=16,
    candidate_topk_blocks=3,
    num_nextn_predict_layers=0,
    engram_layer_ids=(),
    engram_num_embeddings=(),
)


def tiny_args(**overrides) -> ModelArgs:
    return ModelArgs.from_dict({**ATTENTION_TINY, **overrides})


def build_stack(args: ModelArgs, seed: int = 0) -> list[Attention]:
    """Attention layers with random non-zero weights in the checkpoint dtypes
    (docs/numerics.md#dtypes): bf16, except fp32 attn_sink and fp32 compressor wkv / wgate on ratio
    > 1 layers."""
    mx.random.seed(seed)
    layers = []
    for i in range(args.num_hidden_layers):
        layer = Attention(args, i)
        params = []
        for name, v in mlx.utils.tree_flatten(layer.parameters()):
            if name == "attn_sink":
                params.append((name, mx.random.normal(v.shape) * 0.5))
            elif name.endswith("norm.weight"):
                params.append((name, (1.0 + 0.2 * mx.random.normal(v.shape)).astype(mx.bfloat16)))
            else:
                w = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
                fp32 = name.startswith("compressor.w") and layer.role.ratio > 1
                params.append((name, w if fp32 else w.astype(mx.bfloat16)))
        layer.update(mlx.utils.tree_unflatten(params))
        layers.append(layer)
    mx.eval([layer.parameters() for layer in layers])
    return layers


def make_caches(args: ModelArgs, **kw):
    return [make_layer_cache(args, i, **kw) for i in range(args.num_hidden_layers)]


def run_stack(layers, caches, x: mx.array) -> mx.array:
    """h <- h + attn_l(h) over the layers, one shared dict for the pass; caches materialised."""
    shared: dict = {}
    h = x
    for layer, cache in zip(layers, caches):
        h = h + layer(h, cache, shared)
    mx.eval(h, [c.arrays() for c in caches])
    return h


def run_chunks(layers, caches, x: mx.array, sizes) -> mx.array:
    outs, s0 = [], 0
    for n in sizes:
        outs.append(run_stack(layers, caches, x[:, s0 : s0 + n]))
        s0 += n
    assert s0 == x.shape[1]
    return mx.concatenate(outs, axis=1)


# Every row's arithmetic is the same however rows are grouped into calls, chunks or a batch; with
# MLX's Linux CPU backend (row-independent GEMMs) that makes the outputs bit-identical. Other
# backends (Metal / CUDA GEMMs change with the row count) flip bf16 roundings instead.
ROWS_INDEPENDENT = sys.platform == "linux" and mx.default_device().type == mx.cpu


def assert_rounding_level(got, want, what: str) -> None:
    """Two runs of the stack that differ only by rounding: bf16 flips leave most rows within ~1%
    of the output scale (growing layer by layer), and a rare flipped FP8/FP4 value or top-k pick
    moves a few rows by up to ~10% (measured: float64 reference vs the model, 7 layers). A broken
    mechanism (window rows, open groups, RoPE positions, stale keys) moves most rows by >= 10%."""
    g, w = (
        np.asarray(got, np.float64).reshape(-1, got.shape[-1]),
        np.asarray(want, np.float64).reshape(-1, want.shape[-1]),
    )
    row_err = np.abs(g - w).max(-1) / np.abs(w).max()
    assert np.median(row_err) <= 0.02, f"{what}: median row error {np.median(row_err):.4f} of the output scale"
    assert row_err.max() <= 0.25, f"{what}: worst row error {row_err.max():.4f} of the output scale"


def assert_rows_match(got: mx.array, want: mx.array, what: str) -> None:
    g, w = f64(got), f64(want)
    if ROWS_INDEPENDENT:
        assert np.array_equal(g, w), f"{what}: max |diff| {np.abs(g - w).max()} (expected bit-exact)"
    else:
        assert_rounding_level(g, w, what)


def check_against_reference(args: ModelArgs, layers, x: mx.array) -> None:
    """The stack on one sequence x [1, S, hidden] against ReferenceStack.

    Teacher-forced (each reference layer gets the model's input to that layer), a layer is within
    2^-7 of its output scale and publishes the same FP8 / FP4 values, top-k and candidate blocks
    (measured on Linux CPU over 12 seeds: at most 0.27%, and the state always identical; with
    other GEMMs a flip can move a value, so there each layer only has to be at rounding level).
    End to end, the two runs drift apart by rounding only (assert_rounding_level)."""
    caches, shared, h = make_caches(args), {}, x
    inputs, outputs = [], []
    for layer, cache in zip(layers, caches):
        y = layer(h, cache, shared)
        inputs.append(f64(h)[0]), outputs.append(f64(y)[0])
        h = h + y
    ref = ReferenceStack(args, layers)
    ref_shared: dict = {}
    for i in range(args.num_hidden_layers):
        want = ref.layer(i, inputs[i], ref_shared)
        if ROWS_INDEPENDENT:
            assert np.abs(outputs[i] - want).max() <= 2.0**-7 * np.abs(want).max(), f"layer {i}"
        else:
            assert_rounding_level(outputs[i], want, f"layer {i}")
    for key, want in ref_shared.items():
        kind = key.split(".")[0]
        if not ROWS_INDEPENDENT or kind == "scores":
            continue
        if kind in ("kv", "index_keys"):  # the published buffer's valid entries
            assert np.array_equal(f64(shared[key])[0, : len(want)], want), key
        elif kind == "topk":
            assert np.array(shared[key])[0].tolist() == want, key
        elif kind == "candidates":
            assert [set(np.flatnonzero(r)) for r in np.array(shared[key])[0]] == want, key
    full, _ = ref(f64(x)[0])
    assert_rounding_level(f64(h)[0], full, "whole stack")


def random_input(args: ModelArgs, batch: int, length: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((batch, length, args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)


# ---------------------------------------------------------------- float64 reference
# (docs/model.md#attention)

BF16 = ml_dtypes.bfloat16


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def rb(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (the model holds this value in bf16)."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float64)


def ref_rms_norm(x, w, eps):
    return rb(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w)


# Flash's rope_scaling (docs/model.md#attention), written out rather than read from ModelArgs'
# defaults.
FLASH_YARN = {
    "rope_type": "yarn",
    "factor": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 65536,
}


def ref_frequencies(dims, theta, yarn):
    k = np.arange(dims // 2)
    f = theta ** (-2.0 * k / dims)
    if yarn:

        def corr(rot):
            return (
                dims * math.log(yarn["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(theta))
            )

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), dims - 1)
        ramp = np.clip((k - low) / max(high - low, 1e-3), 0, 1)
        f = f * (1 - ramp) + f / yarn["factor"] * ramp
    return f


def ref_rope(x, positions, freqs, inverse=False):
    """Interleaved rotation of the last 2·len(freqs) dims; positions broadcast over axis 0 of x."""
    d = 2 * len(freqs)
    ang = np.asarray(positions, np.float64).reshape(-1, *([1] * (x.ndim - 2)), 1) * freqs
    if inverse:
        ang = -ang
    c, s = np.cos(ang), np.sin(ang)
    y = x.copy()
    ev, od = x[..., -d::2], x[..., -d + 1 :: 2]
    y[..., -d::2] = ev * c - od * s
    y[..., -d + 1 :: 2] = ev * s + od * c
    return y


def ref_fq8(x, block=32):
    b = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    q = np.clip(b / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * scale).reshape(x.shape)


def ref_fq4(x, block, scale_kind="ue8m0"):
    b = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(b).max(-1, keepdims=True)
    if scale_kind == "ue8m0":
        scale = 2.0 ** np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126) / 6.0))
    else:
        s = np.minimum(np.maximum(amax, 6 * 2.0**-9) / 6.0, 448.0)
        scale = s.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    q = np.clip((b / scale).astype(np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (q * scale).reshape(x.shape)


def ref_select_topk(scores_row, k, visible):
    """Best k by (score desc, index asc), ascending; picks >= visible -> -1 (sorted last)."""
    order = sorted(range(len(scores_row)), key=lambda j: (-scores_row[j], j))[:k]
    keep = sorted(j for j in order if j < visible)
    return keep + [-1] * (k - len(keep))


def ref_candidate_blocks(scores_row, visible, block, keep):
    T = len(scores_row)
    nb = -(-T // block)
    bscore = [max(scores_row[b * block : (b + 1) * block]) for b in range(nb)]
    if visible > 0:
        bscore[(visible - 1) // block] = np.inf
    order = sorted(range(nb), key=lambda b: (-bscore[b], b))[: min(keep, nb)]
    return {b for b in order if bscore[b] != -np.inf}


class ReferenceStack:
    """The attention stack of `build_stack` over one whole sequence (prefill semantics), float64.

    `bf16_probs` / `bf16_index_scores` model two roundings of DeepSeek's reference that the model
    does not make (docs/design.md, "Linear arithmetic"): attention probabilities rounded to bf16
    before P·V, and indexer scores formed in bf16 (q·k, the head weighting and the head sum each
    rounded). benchmarks/reference_roundings.py measures what they change."""

    bf16_probs = False
    bf16_index_scores = False

    def __init__(self, args: ModelArgs, layers):
        self.args = args
        self.w = [{k: f64(v) for k, v in mlx.utils.tree_flatten(layer.parameters())} for layer in layers]
        self.roles = [layer.role for layer in layers]
        self.attend_compressed = [layer.attend_compressed for layer in layers]

    def freqs(self, layer):
        a = self.args
        if a.compress_ratios[layer] == 0:
            return ref_frequencies(a.qk_rope_head_dim, a.rope_theta, None)
        return ref_frequencies(a.qk_rope_head_dim, a.compress_rope_theta, a.rope_scaling)

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, dict]:
        """x [S, hidden] (one batch row) -> (output [S, hidden], published state per source)."""
        h = x
        shared: dict = {}
        for i in range(self.args.num_hidden_layers):
            h = rb(h + self.layer(i, h, shared))
        return h, shared

    def layer(self, i, x, shared):
        a, w, role = self.args, self.w[i], self.roles[i]
        S, H, Dh, W = x.shape[0], a.num_attention_heads, a.head_dim, a.sliding_window
        eps, fr, pos = a.rms_norm_eps, self.freqs(i), np.arange(S)
        qr = ref_rms_norm(rb(x @ w["wq_a.weight"].T), w["q_norm.weight"], eps)
        q = rb(ref_rope(rb(qr @ w["wq_b.weight"].T).reshape(S, H, Dh), pos, fr))
        kv = ref_fq8(rb(ref_rope(ref_rms_norm(rb(x @ w["wkv.weight"].T), w["kv_norm.weight"], eps), pos, fr)))
        selected = [[] for _ in range(S)]
        pool = np.zeros((0, Dh))
        if role.ratio:
            r = role.ratio
            if role.owns_kv:
                lat = self.latents(w, x, r)
                gpos = np.arange(len(lat)) * r
                shared[f"kv.{i}"] = ref_fq4(rb(ref_rope(lat, gpos, fr)), 16, "e4m3")
                k = ref_rms_norm(rb(lat @ w["indexer.wk.weight"].T), w["indexer.k_norm.weight"], eps)
                shared[f"index_keys.{i}"] = ref_fq4(rb(ref_rope(k, gpos, fr)), 32)
            pool = shared[f"kv.{role.kv_source}"]
            if role.runs_indexer:
                shared[f"topk.{i}"] = self.indexer(i, x, qr, shared, fr)
            if self.attend_compressed[i]:
                selected = shared[f"topk.{role.index_source}"]
        out = np.zeros((S, H, Dh))
        for t in range(S):
            keys = np.concatenate([kv[max(0, t - W + 1) : t + 1], pool[[j for j in selected[t] if j >= 0]]])
            logits = q[t] @ keys.T * Dh**-0.5  # [H, N]
            m = np.maximum(logits.max(-1), w["attn_sink"])
            p = np.exp(logits - m[:, None])
            denom = (p.sum(-1) + np.exp(w["attn_sink"] - m))[:, None]
            out[t] = rb(p / denom) @ keys if self.bf16_probs else (p @ keys) / denom
        o = rb(ref_rope(rb(out), pos, fr, inverse=True))
        G = a.o_groups
        wo_a = w["wo_a.weight"].reshape(G, a.o_lora_rank, -1)
        o = rb(np.einsum("sgi,goi->sgo", o.reshape(S, G, -1), wo_a)).reshape(S, -1)
        return rb(o @ w["wo_b.weight"].T)

    def latents(self, w, x, r):
        eps = self.args.rms_norm_eps
        if r == 1:
            return ref_rms_norm(rb(x @ w["compressor.wkv.weight"].T), w["compressor.norm.weight"], eps)
        n = x.shape[0] // r
        a = (x[: n * r] @ w["compressor.wkv.weight"].T).reshape(n, r, -1)
        g = (x[: n * r] @ w["compressor.wgate.weight"].T).reshape(n, r, -1)
        p = np.exp(g - g.max(1, keepdims=True))
        pooled = (a * p / p.sum(1, keepdims=True)).sum(1)
        return ref_rms_norm(rb(pooled), w["compressor.norm.weight"], eps)

    def indexer(self, i, x, qr, shared, fr):
        a, w, role = self.args, self.w[i], self.roles[i]
        S, Hi, Di, r = x.shape[0], a.index_n_heads, a.index_head_dim, role.ratio
        K = shared[f"index_keys.{role.kv_source}"]
        qi = ref_fq4(rb(ref_rope(rb(qr @ w["indexer.wq_b.weight"].T).reshape(S, Hi, Di), np.arange(S), fr)), 32)
        wt = rb(x @ w["indexer.weights_proj.weight"].T) * Di**-0.5 * Hi**-0.5
        if self.bf16_index_scores:
            dots = np.maximum(rb(np.einsum("shd,jd->shj", qi, K)), 0)
            scores = rb((rb(wt[..., None] * dots)).sum(1))
        else:
            scores = np.einsum("sh,shj->sj", wt, np.maximum(np.einsum("shd,jd->shj", qi, K), 0))
        k = min(a.index_topk, len(K))
        out, blocks = [], []
        for t in range(S):
            vis = (t + 1) // r
            row = [scores[t, j] if j < vis else -np.inf for j in range(len(K))]
            if role.builds_candidates:
                blocks.append(ref_candidate_blocks(row, vis, a.candidate_block_size, a.candidate_topk_blocks))
            elif role.uses_candidates:
                cand = shared[f"candidates.{a.candidate_source_layer_id}"][t]
                row = [s if j // a.candidate_block_size in cand else -np.inf for j, s in enumerate(row)]
            out.append(ref_select_topk(row, k, vis))
        if role.builds_candidates:
            shared[f"candidates.{i}"] = blocks
        shared[f"scores.{i}"] = scores
        return out


def random_norm(width: int):
    """An RMSNorm of `width` (eps 1e-20) with a random fp32 weight near 1 (seeded by the width)."""
    norm = RMSNorm(width, 1e-20)
    norm.weight = mx.array((1 + 0.1 * np.random.default_rng(width).standard_normal(width)).astype(np.float32))
    return norm
