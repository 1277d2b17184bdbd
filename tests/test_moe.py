"""Router, dense experts and the MoE block against float64 references written from
docs/model.md#moe."""

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import rb

from mlx_dsv41.config import ModelArgs
from mlx_dsv41.model.moe import MoE
from mlx_dsv41.quant import DenseExperts, FormatError, make_experts

rng = np.random.default_rng(5)
E, K, D, INTER, LIMIT = 8, 2, 32, 24, 10.0


def _args(**kw):
    base = dict(
        hidden_size=D,
        moe_intermediate_size=INTER,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        num_nextn_predict_layers=0,
        compress_ratios=(0,),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=-1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
    )
    base.update(kw)
    return ModelArgs(**base)


def _silu(v):
    return v / (1 + np.exp(-v))


def _slot_ref(x, w1, w3, w2, e, weight, weight_before_w2=True):
    """One slot, float64 with the reference's bf16 roundings (linear outputs, w2 input, w2 output)."""
    g = rb(w1[e] @ x)
    u = rb(w3[e] @ x)
    a = _silu(np.minimum(g, LIMIT)) * np.clip(u, -LIMIT, LIMIT)
    if weight_before_w2:
        return rb(w2[e] @ rb(weight * a))
    return rb(weight * rb(w2[e] @ rb(a)))  # rounded too, so only the order differs


def _experts(n=E, lo_hi=None):
    w1 = rb(rng.standard_normal((n, INTER, D)) / np.sqrt(D))
    w3 = rb(rng.standard_normal((n, INTER, D)) / np.sqrt(D))
    w2 = rb(rng.standard_normal((n, D, INTER)) / np.sqrt(INTER))
    tensors = {}
    for e in range(n):
        for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
            tensors[f"ffn.experts.{e}.{name}.weight"] = mx.array(w[e].astype(np.float32)).astype(mx.bfloat16)
    return tensors, (w1, w3, w2)


@pytest.mark.parametrize("gate_temp", [1.0, 0.5, 2.5])  # the logits are divided by gate_temp
def test_router_matches_float64_and_bias_only_selects(gate_temp):
    args = _args(gate_temp=gate_temp)
    moe = MoE(args)
    T = 64
    x = rb(rng.standard_normal((T, D)))
    w = rb(rng.standard_normal((E, D)) / np.sqrt(D))
    bias = rng.standard_normal(E).astype(np.float32) * 0.5
    moe.gate.weight = mx.array(w.astype(np.float32)).astype(mx.bfloat16)
    moe.gate.bias = mx.array(bias)
    idx, wts = moe.gate(mx.array(x.astype(np.float32)).astype(mx.bfloat16))
    assert idx.dtype == mx.int32 and wts.dtype == mx.float32
    idx, wts = np.array(idx), np.array(wts)

    scores = np.sqrt(np.log1p(np.exp(x @ w.T / gate_temp)))
    chosen = np.sort(np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :K], axis=-1)
    assert np.array_equal(idx, chosen)  # ascending expert id = the reference's accumulation order
    sel = np.take_along_axis(scores, chosen, -1)
    np.testing.assert_allclose(wts, sel / (sel.sum(-1, keepdims=True) + 1e-20) * 1.5, rtol=2e-6)
    # The bias changed the choice for some tokens, but never the weights' source (unbiased scores).
    unbiased = np.sort(np.argsort(-scores, axis=-1)[:, :K], axis=-1)
    assert (chosen != unbiased).any(axis=-1).sum() > 5


@pytest.mark.parametrize("x_scale", [1.0, 12.0])  # 12: pushes g and u past the ±10 clamp
def test_dense_experts_per_slot_weight_before_w2(x_scale):
    tensors, (w1, w3, w2) = _experts()
    experts = make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT)
    assert isinstance(experts, DenseExperts) and experts.w1.dtype == mx.float32
    T = 40
    x = rb(rng.standard_normal((T, D)) * x_scale)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.05, 1.5, (T, K)).astype(np.float32)
    y = experts(mx.array(x.astype(np.float32)).astype(mx.bfloat16), mx.array(idx), mx.array(wts))
    assert y.shape == (T, K, D) and y.dtype == mx.float32
    y = np.array(y, np.float64)
    before = np.stack([[_slot_ref(x[t], w1, w3, w2, idx[t, s], wts[t, s]) for s in range(K)] for t in range(T)])
    after = np.stack([[_slot_ref(x[t], w1, w3, w2, idx[t, s], wts[t, s], False) for s in range(K)] for t in range(T)])
    if x_scale > 1:
        g = np.einsum("eid,td->tei", w1, x)
        assert (g > LIMIT).any() and (np.einsum("eid,td->tei", w3, x) < -LIMIT).any()
    # Same roundings as the float64 reference: equal except where fp32 accumulation crosses a bf16
    # rounding boundary; the weight-after-w2 order (mlx-lm's) misses far more often.
    np.testing.assert_allclose(y, before, rtol=2**-7, atol=1e-6)
    match_before, match_after = np.mean(y == before), np.mean(y == after)
    assert match_before > 0.97 and match_after < match_before - 0.1, (match_before, match_after)


def test_expert_range_zero_outside_and_bit_exact_inside():
    tensors, _ = _experts()
    full = make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT)
    low = make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT, expert_range=(0, 3))
    high = make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT, expert_range=(3, E))
    assert low.w1.shape[0] == 3 and high.w1.shape[0] == E - 3
    T = 30
    x = mx.array(rng.standard_normal((T, D)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
    wts = mx.array(rng.uniform(0.1, 1.0, (T, K)).astype(np.float32))
    yf, yl, yh = (np.array(m(x, idx, wts)) for m in (full, low, high))
    inside_low = (np.array(idx) < 3)[..., None]
    assert np.all(yl[~np.broadcast_to(inside_low, yl.shape)] == 0)
    assert np.all(yh[np.broadcast_to(inside_low, yh.shape)] == 0)
    assert np.array_equal(np.where(inside_low, yl, yh), yf)
    assert np.array_equal(yl + yh, yf)  # each slot from exactly one rank: combining is exact


def test_expert_errors_are_precise():
    tensors, _ = _experts()
    with pytest.raises(ValueError, match=r"expert_range \(3, 3\)"):
        make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT, expert_range=(3, 3))
    del tensors["ffn.experts.5.w2.weight"]
    with pytest.raises(FormatError, match=r"missing tensor ffn\.experts\.5\.w2\.weight"):
        make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT)
    # The missing expert is outside this range, so it is never read.
    make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT, expert_range=(0, 5))
    tensors["ffn.experts.5.w2.weight"] = mx.zeros((D, INTER + 1), mx.bfloat16)
    with pytest.raises(ValueError, match=r"ffn\.experts\.5\.w2\.weight: expected a float tensor of shape \[32, 24\]"):
        make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT)


def test_moe_block_matches_float64():
    args = _args()
    moe = MoE(args)
    tensors, (w1, w3, w2) = _experts()
    moe.experts = make_experts(tensors, "ffn.experts", E, D, INTER, LIMIT)
    gw = rb(rng.standard_normal((E, D)) / np.sqrt(D))
    bias = rng.standard_normal(E).astype(np.float32) * 0.3
    moe.gate.weight = mx.array(gw.astype(np.float32)).astype(mx.bfloat16)
    moe.gate.bias = mx.array(bias)
    sw = {
        n: rb(rng.standard_normal(s) / np.sqrt(s[1]))
        for n, s in (("w1", (INTER, D)), ("w3", (INTER, D)), ("w2", (D, INTER)))
    }
    for n, v in sw.items():
        getattr(moe.shared_experts, n).weight = mx.array(v.astype(np.float32)).astype(mx.bfloat16)
    x = rb(rng.standard_normal((2, 7, D)))
    out = moe(mx.array(x.astype(np.float32)).astype(mx.bfloat16))
    assert out.dtype == mx.bfloat16 and out.shape == (2, 7, D)

    flat = x.reshape(-1, D)
    scores = np.sqrt(np.log1p(np.exp(flat @ gw.T)))
    ref = []
    for t in range(flat.shape[0]):
        sel = np.sort(np.argsort(-(scores[t] + bias))[:K])
        wt = scores[t, sel] / (scores[t, sel].sum() + 1e-20) * 1.5
        routed = sum(_slot_ref(flat[t], w1, w3, w2, e, wt[s]) for s, e in enumerate(sel))
        g, u = rb(sw["w1"] @ flat[t]), rb(sw["w3"] @ flat[t])
        shared = rb(sw["w2"] @ rb(_silu(np.minimum(g, LIMIT)) * np.clip(u, -LIMIT, LIMIT)))
        ref.append(routed + shared)
    ref = np.stack(ref).reshape(x.shape)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), ref, rtol=2**-7, atol=2e-3)
