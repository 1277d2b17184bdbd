// The MoE parts of the expert kernels (needs exl3_matmul.h): which slots a launch serves, their
// k-split partial sums, and the routed SwiGLU of exl3_expert_swiglu.
#pragma once

// Whether a slot's local expert e (indices[slot] - LO) is in the held range.
KX_INLINE bool exl3_held(int e, u32 n_local) { return e >= 0 && e < (int)n_local; }

// Which launch writes a slot: the EXL3_SLOT_* values (negative: not this launch) are defined once,
// by the launcher (mlx_dsv41/kernels/exl3.py: SlotStack), in the source it hands to MLX.
#if !defined(EXL3_SLOT_OTHER_GROUP) || !defined(EXL3_SLOT_NOT_HELD)
#error "EXL3_SLOT_* come from the launcher (mlx_dsv41/kernels/exl3.py: SlotStack)"
#endif

// The slot's expert in this launch's (K, codebook) stack: p[e] (EXL3_SLOT_OTHER_GROUP: its
// projection is in another group) for a held expert, EXL3_SLOT_NOT_HELD for one outside the held
// range.
KX_INLINE int exl3_stack_position(int e, u32 n_local, const KX_DEVICE int* p) {
  return exl3_held(e, n_local) ? p[e] : EXL3_SLOT_NOT_HELD;
}

// A threadgroup's 128 outputs at out + base for a slot this launch does not compute (pos < 0):
// prev's (HAS_PREV and EXL3_SLOT_OTHER_GROUP: another group's launch computed them) or 0 (a slot
// outside the held range).
// Without HAS_PREV, prev is a stand-in input of another type and is never read. tid: the thread's
// index in the (one-dimensional) threadgroup.
template <bool HAS_PREV, int NW, typename P>
KX_INLINE void exl3_pass_slot(KX_DEVICE float* out, P prev, u64 base, int pos, u32 tid) {
  for (u32 i = tid; i < 128; i += NW * 32) out[base + i] = (HAS_PREV && pos == EXL3_SLOT_OTHER_GROUP) ? prev[base + i] : 0.0f;
}

// A threadgroup's 128 k-split partial sums (one row) at out + base: its k groups' accumulators
// added in order (tid as for exl3_pass_slot).
template <int NC, int NW>
KX_INLINE void exl3_store_partials(KX_DEVICE float* out, u64 base, Exl3Acc<1, NC> acc, KX_THREADGROUP u32* ring,
                                   u32 warp, u32 lane, u32 tid) {
  const KX_THREADGROUP float* ys = exl3_gather_acc<1, NC, NW>(acc, ring, warp, lane);
  for (u32 j = tid; j < 128; j += NW * 32) out[base + j] = exl3_ys_sum<1, EXL3_KG(NW, NC)>(ys, 0, j);
}

// h = bf16(weight * (silu(min(g, L)) * clamp(u, -L, L))), float32 math, no clamp for L <= 0
// (docs/model.md#moe: the routing weight multiplies the SwiGLU product, before w2). g and u arrive
// rounded to bf16, as the reference's w1 / w3 linears return them. NaN propagates.
KX_INLINE float exl3_routed_swiglu(float g, float u, float weight, float limit) {
  g = exl3_round_bf16(g);
  u = exl3_round_bf16(u);
  if (limit > 0.0f) {
    g = (g > limit) ? limit : g;
    u = (u > limit) ? limit : ((u < -limit) ? -limit : u);
  }
  const float silu = g / (1.0f + KX_EXP(-g));
  return exl3_round_bf16(weight * (silu * u));
}

// The gate/up partials gu [2][SPLITS][inter_padded] of one slot's 128-block `block`, the lane's 4
// elements of each. They do not depend on the slot's expert: exl3_expert_swiglu loads them before
// indices[slot] is known, so that both share one round trip (the kernel is latency-bound).
template <int SPLITS>
struct Exl3GateUp {
  Exl3Splits<SPLITS> g, u;
};

template <int SPLITS>
KX_INLINE Exl3GateUp<SPLITS> exl3_load_gate_up(const KX_DEVICE float* gu, u32 inter_padded, u32 block, u32 lane) {
  const KX_DEVICE float* p = gu + block * 128 + 4 * lane;
  Exl3GateUp<SPLITS> t;
  t.g = exl3_load_splits<SPLITS>(p, inter_padded);
  t.u = exl3_load_splits<SPLITS>(p + (u64)SPLITS * inter_padded, inter_padded);
  return t;
}

// w2's xh for the lane's 4 elements of 128-block `block` of one slot: g and u are finished from the
// partials (splits added in order, H128, svh), then h = exl3_routed_swiglu (zero for columns >=
// inter, the zero-extension of w2's input) and xh = H128(fp16(h * suh2)) (docs/exl3.md#forward; the
// caller rounds it to fp16 as it stores it).
template <int SPLITS, typename VT>
KX_INLINE Exl3Vec4 exl3_swiglu_xh(Exl3GateUp<SPLITS> p, u32 inter, const KX_DEVICE VT* svh1, const KX_DEVICE VT* svh3,
                                  const KX_DEVICE VT* suh2, float weight, float limit, u32 block, u32 lane) {
  const u32 c0 = block * 128 + 4 * lane;
  float s1[4], s3[4], s2[4];
  for (int i = 0; i < 4; i++) {
    s1[i] = KX_TO_F32(svh1[c0 + i]);
    s3[i] = KX_TO_F32(svh3[c0 + i]);
    s2[i] = KX_TO_F32(suh2[c0 + i]);
  }
  const Exl3Vec4 g = exl3_hadamard128(exl3_sum_splits<SPLITS>(p.g), lane);
  const Exl3Vec4 u = exl3_hadamard128(exl3_sum_splits<SPLITS>(p.u), lane);
  Exl3Vec4 xv;
  for (int i = 0; i < 4; i++) {
    const float h = (c0 + i < inter) ? exl3_routed_swiglu(g.v[i] * s1[i], u.v[i] * s3[i], weight, limit) : 0.0f;
    xv.v[i] = exl3_round_f16(h * s2[i]);
  }
  return exl3_hadamard128(xv, lane);
}
