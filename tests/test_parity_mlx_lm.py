"""Parity with mlx-lm 0.32.2's `mlx_lm.models.deepseek_v41` on an Engram-free tiny config.

Same random weights, in official names, go through each model's own `sanitize` (mlx-lm renames and
stacks them itself). The differences between the two implementations, and how each is handled:

1. Routed weights: mlx-lm multiplies after `w2`; the reference (and we) before it
   (docs/model.md#moe). It acts only through the bf16 rounding of w2's input: it vanishes in fp32.
   [known]
2. RMSNorm: mlx-lm's `nn.RMSNorm` on bf16 input rounds the normalised value before the weight
   multiply; the reference computes in fp32 and rounds once (docs/numerics.md#dtypes). 1 bf16 ulp.
   [found]
3. CPU only: mlx-lm's grouped `wo_a` and routed experts use `mx.gather_mm`, which runs only in
   fp32 on the CPU, so their weights are given to it in fp32 and those paths skip the bf16
   rounding of their outputs. (On GPU they would run in bf16.)                       [found]
4. Top-k when fewer candidate entries than index_topk survive the candidate mask: both keep
   visible picks whose masked score is -inf (as the reference, docs/model.md#attention), but among
   those tied entries mlx-lm's argpartition picks in backend order and ours by lowest index.
   Impossible at Flash sizes (2048 blocks of 8 ≫ 512), so the parity config keeps 3 blocks of 2 >=
   index_topk 4 + 1, where it cannot happen.
   [found]
5. The head: mlx-lm computes logits in the head weight's dtype; given the fp32 head the reference
   asks for (docs/model.md#head), it matches.
   [neutralised]
6. Official FP8 / FP4 weights (not in the bf16 runs below): mlx-lm keeps them packed (mxfp8 /
   mxfp4) and runs MLX's quantized kernels on bf16 activations, which on the CPU keep bf16
   running sums (~0.7 % per linear at these widths, 1.5 % at K = 5120); ours give those kernels
   fp32 activations and round once (quant/accumulation.py), as the reference's linears do. [found]
Everything else (mHC, attention with window / compressor / indexer / candidates, RoPE flavours,
fake quantization, router, shared expert) must agree to fp32 rounding.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_dsv41.model.hyper_connections import formed, initial_mixes
from mlx_dsv41.quant.experts import sum_slots
from mlx_dsv41.synthetic import hf_config, random_weights, tiny_args, tiny_model
from mlx_dsv41.synthetic_checkpoints import write_official_checkpoint

ref = pytest.importorskip("mlx_lm.models.deepseek_v41")
L = 24


def _args():
    return tiny_args(engram_layer_ids=(), engram_num_embeddings=(), candidate_topk_blocks=3)


def _pair(weights):
    args = _args()
    ours = tiny_model(args, weights=weights)
    theirs = ref.Model(ref.ModelArgs.from_dict(hf_config(args)))
    mapped = theirs.sanitize(dict(weights))
    for k in mapped:
        if ".switch_mlp." in k or ".o_a_proj." in k or k == "lm_head.weight":  # items 3 and 5
            mapped[k] = mapped[k].astype(mx.float32)
    theirs.load_weights(list(mapped.items()), strict=True)
    mx.eval(theirs.parameters())
    return ours, theirs


def _ids(seed=1, batch=2):
    return mx.array(np.random.default_rng(seed).integers(0, 159, (batch, L)))


def test_fp32_teacher_forced_logits_match():
    """fp32 weights and activations: items 1-3 vanish, so the two must agree to fp32 rounding
    (plus the rare fp4/fp8 fake-quant boundary flip that fp32 summation order can cause)."""
    weights = {k: v.astype(mx.float32) for k, v in random_weights(_args(), seed=0).items()}
    ours, theirs = _pair(weights)
    ids = _ids()
    a, b = np.array(ours(ids)), np.array(theirs(ids).astype(mx.float32))
    scale = np.abs(a).max()
    err = np.abs(a - b)
    assert err.max() <= 2e-3 * scale, (err.max(), scale)  # measured: 7.8e-4 · scale
    assert err[:, :8].max() <= 1e-5 * scale  # before the 8-slot window wraps: summation order only
    assert np.array_equal(a.argmax(-1), b.argmax(-1))


# ------------------------------------------------------------------ bf16, the checkpoint dtype


class _SlotSum(nn.Module):
    """mlx-lm's experts call, served by our experts module: weight before w2 (item 1)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def __call__(self, x, indices, weights):
        return sum_slots(self.experts(x, indices.astype(mx.int32), weights.astype(mx.float32)))


class _GroupedBf16(nn.Module):
    """mlx-lm's o_a_proj call, served by our bf16 grouped linear (item 3)."""

    def __init__(self, wo_a):
        super().__init__()
        self.wo_a = wo_a

    def __call__(self, x, group_ids):  # x [B·S, G, 1, in]
        return self.wo_a(x.squeeze(-2))[..., None, :]


def _neutralise(ours, theirs, items):
    for o, t in zip(ours.layers, theirs.model.layers):
        if 1 in items:
            t.mlp.experts = _SlotSum(o.ffn.experts)
        if 2 in items:
            t.input_layernorm, t.post_attention_layernorm = o.attn_norm, o.ffn_norm
            t.self_attn.q_a_norm, t.self_attn.kv_norm = o.attn.q_norm, o.attn.kv_norm
            if o.attn.role.owns_kv:
                t.self_attn.compressor.kv_norm = o.attn.compressor.norm
                t.self_attn.indexer.k_norm = o.attn.indexer.k_norm
        if 3 in items:
            t.self_attn.o_a_proj = _GroupedBf16(o.attn.wo_a)
    if 2 in items:
        theirs.model.norm = ours.norm


def _layerwise(ours, theirs, ids):
    """Each layer of both models on the SAME input streams (ours): per layer, the fraction of output
    elements that differ and the largest difference relative to the row rms."""
    B, S = ids.shape
    h = ours.embed(ids)
    streams = mx.broadcast_to(h[:, :, None, :], (B, S, 4, h.shape[-1]))
    mixes = initial_mixes(B, S, 4)  # ours: a site's mixes (pre | post | comb); mlx-lm: the pre
    window = mx.broadcast_to(
        ref._window_indices(previous=0, length=S, window=ours.args.sliding_window), (B, S, ours.args.sliding_window)
    )
    caches, their_caches = ours.make_cache(), theirs.model.make_cache()
    shared, their_shared, out = {}, {}, []
    for o, t, c, tc in zip(ours.layers, theirs.model.layers, caches, their_caches):
        nxt, nxt_mixes = o(streams, mixes, c, shared)
        nxt = formed(nxt)  # a block hands on its output streams unformed (an Expansion)
        other, _ = t(streams, mixes[..., :4], start_pos=0, window_idx=window, cache=tc, shared=their_shared)
        a, b = np.array(nxt.astype(mx.float32)), np.array(other.astype(mx.float32))
        rms = np.sqrt((a**2).mean(-1, keepdims=True))
        out.append(((a != b).mean(), (np.abs(a - b) / rms).max()))
        streams, mixes = nxt, nxt_mixes
    return np.array(out)


def test_bf16_layers_differ_only_by_the_listed_items():
    ours, theirs = _pair(random_weights(_args(), seed=0))
    ids = _ids()
    as_is = _layerwise(ours, theirs, ids)
    _neutralise(ours, theirs, {1, 2, 3})
    neutral = _layerwise(ours, theirs, ids)
    # As is, a large share of every layer's outputs differ by a few bf16 ulps ...
    assert as_is[:, 0].min() > 0.2, as_is
    # ... and with items 1-3 neutralised, what is left is fp32 summation order flipping an
    # occasional bf16 rounding (measured: <= 1.3 % of elements, <= 1.8 % of the row rms).
    assert neutral[:, 0].max() < 0.03 and neutral[:, 1].max() < 0.05, neutral


def test_routing_weight_order_is_the_whole_moe_difference():
    ours, theirs = _pair(random_weights(_args(), seed=0))
    x = mx.array(np.random.default_rng(2).standard_normal((2, L, 64)).astype(np.float32)).astype(mx.bfloat16)
    o, t = ours.layers[3].ffn, theirs.model.layers[3].mlp
    a = np.array(o(x).astype(mx.float32))
    as_is = (a != np.array(t(x).astype(mx.float32))).mean()
    t.experts = _SlotSum(o.experts)
    neutral = (a != np.array(t(x).astype(mx.float32))).mean()
    # With top-2 the fp32 slot sum does not depend on slot order, so nothing else may differ.
    assert as_is > 0.2 and neutral == 0, (as_is, neutral)


def test_bf16_teacher_forced_logits():
    """End to end in bf16, the tiny random model amplifies per-layer ulp differences (a near-tie in
    routing or top-k flips a whole expert or entry), so the bound is on average closeness and
    greedy agreement. Measured over 4 seeds: as is, mean |Δ| = 0.11-0.19 of the logit std and
    73-81 % equal greedy tokens; with items 1-3 neutralised, 0.005-0.04 and 94-98 %."""
    ours, theirs = _pair(random_weights(_args(), seed=0))
    ids = _ids()
    a = np.array(ours(ids))
    b = np.array(theirs(ids).astype(mx.float32))
    _neutralise(ours, theirs, {1, 2, 3})
    c = np.array(theirs(ids).astype(mx.float32))
    agree = lambda x: (a.argmax(-1) == x.argmax(-1)).mean()  # noqa: E731
    as_is, neutral = np.abs(a - b).mean() / a.std(), np.abs(a - c).mean() / a.std()
    assert as_is < 0.25 and agree(b) > 0.65, (as_is, agree(b))
    assert neutral < 0.06 and agree(c) > 0.9, (neutral, agree(c))
    assert neutral < as_is / 3  # the listed differences account for most of the gap


def test_official_fp8_linears_sum_in_fp32_where_mlx_lm_sums_in_bf16(tmp_path):
    """Item 6, on the same official checkpoint loaded by each side's own loader: every FP8 linear
    is within one bf16 rounding of float64 in ours (<= 0.3 %), and ~0.7 % off in mlx-lm's."""
    from mlx_lm.utils import load_model

    ckpt = write_official_checkpoint(tmp_path, _args())
    theirs, _ = load_model(tmp_path)
    ours = ckpt.source_model()
    rng = np.random.default_rng(3)
    sites = {
        "attn.wq_a": "self_attn.q_a_proj",
        "attn.wq_b": "self_attn.q_b_proj",
        "attn.wo_b": "self_attn.o_b_proj",
        "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    }
    for layer in (0, 3):
        for site, their_site in sites.items():
            w = np.array(ckpt.reference[f"layers.{layer}.{site}.weight"].astype(mx.float32), np.float64)
            x = mx.array(rng.standard_normal((8, w.shape[1])).astype(np.float32)).astype(mx.bfloat16)
            want = np.array(x.astype(mx.float32), np.float64) @ w.T
            mine = ours.layers[layer]
            for part in site.split("."):
                mine = getattr(mine, part)
            other = theirs.model.layers[layer]
            for part in their_site.split("."):
                other = getattr(other, part)
            err = {
                name: np.linalg.norm(np.array(m(x).astype(mx.float32), np.float64) - want) / np.linalg.norm(want)
                for name, m in (("ours", mine), ("mlx-lm", other))
            }
            assert err["ours"] <= 3e-3 and err["mlx-lm"] > 4e-3, (layer, site, err)
