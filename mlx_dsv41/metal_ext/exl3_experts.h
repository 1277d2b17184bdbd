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

// exl3_expert_swiglu's work for one slot's 128-block `block` (one SIMD group): w2's input xh from
// the gate/up partials gu [slots, 2, SPLITS, inter_padded] (exl3_swiglu_xh; 0 for a slot whose
// expert is not held), stored in the staged word order at xh [slots, inter_padded / 2]. Shared by
// exl3_expert_swiglu and exl3_expert_gate_up's FINISH, so both give the same bytes. No branch on
// the expert before the partials' loads: the compiler would sink them into it, after indices[slot]'s
// round trip (a slot whose expert is not held computes with expert LO's vectors and stores zeros).
template <int SPLITS, typename VT>
KX_INLINE void exl3_swiglu_block(const KX_DEVICE float* gu, const KX_DEVICE float* weights, const KX_DEVICE int* indices,
                                 const KX_DEVICE VT* svh1, const KX_DEVICE VT* svh3, const KX_DEVICE VT* suh2,
                                 KX_DEVICE u32* xh, u32 inter_padded, u32 n_local, int lo, u32 inter, float limit,
                                 u32 slot, u32 block, u32 lane) {
  const Exl3GateUp<SPLITS> parts =
      exl3_load_gate_up<SPLITS>(gu + (u64)slot * 2 * SPLITS * inter_padded, inter_padded, block, lane);
  const float weight = weights[slot];
  const int e = indices[slot] - lo;
  const bool held = exl3_held(e, n_local);
  const u64 mid = (u64)(held ? e : 0) * inter_padded;
  Exl3Vec4 v = exl3_swiglu_xh<SPLITS>(parts, inter, svh1 + mid, svh3 + mid, suh2 + mid, weight, limit, block, lane);
  for (int i = 0; i < 4; i++) v.v[i] = held ? v.v[i] : 0.0f;
  exl3_store_xh(xh + (u64)slot * (inter_padded / 2), block, v, lane);
}

// exl3_expert_down_finish's work for one slot's 128-column block (one SIMD group): y = bf16(H128(the
// k-split partials [slots, SPLITS, n] added in split order) * svh2[e]) for a held slot, 0 for the
// others (docs/exl3.md#forward steps 4-6), stored in T at out [slots, n]. With ADD (the shared
// expert: one slot per token) the MoE's output instead (docs/model.md#moe): T((sum of add[t, s]
// over the add_k routed slots, in slot order) + y), add [T, add_k, n] fp32. Shared by
// exl3_expert_down_finish and exl3_expert_down's FINISH, so both give the same bytes. The partials'
// loads do not wait for the slot's expert (see exl3_swiglu_block).
template <int SPLITS, bool ADD, typename T, typename VS, typename VA>
KX_INLINE void exl3_down_finish_block(const KX_DEVICE float* partial, const KX_DEVICE int* indices,
                                      const KX_DEVICE VS* svh2, const KX_DEVICE VA* add, u32 add_k, KX_DEVICE T* out,
                                      u32 n, u32 n_local, int lo, u32 slot, u32 col_block, u32 lane) {
  const u32 c0 = col_block * 128 + 4 * lane;
  const Exl3Splits<SPLITS> t = exl3_load_splits<SPLITS>(partial + (u64)slot * SPLITS * n + c0, n);
  const int e = indices[slot] - lo;
  const bool held = exl3_held(e, n_local);
  float sv[4];  // loaded whether or not the slot is held: no branch around each load
  for (int i = 0; i < 4; i++) sv[i] = KX_TO_F32(svh2[(u64)(held ? e : 0) * n + c0 + i]);
  const Exl3Vec4 s = exl3_hadamard128(exl3_sum_splits<SPLITS>(t), lane);
  KX_DEVICE T* y = out + (u64)slot * n + c0;
  if (ADD) {
    const u64 routed = (u64)slot * add_k * n + c0;
    for (int i = 0; i < 4; i++) {
      float acc = KX_TO_F32(add[routed + i]);
      for (u32 r = 1; r < add_k; r++) acc += KX_TO_F32(add[routed + (u64)r * n + i]);
      y[i] = static_cast<T>(acc + exl3_round_bf16(s.v[i] * sv[i]));
    }
  } else {
    for (int i = 0; i < 4; i++) y[i] = static_cast<T>(held ? exl3_round_bf16(s.v[i] * sv[i]) : 0.0f);
  }
}

// The MoE's output for one token's 128-column block (one SIMD group), after every y row of the token
// is finished in this launch (exl3_expert_down's SHARED): moe[t] = TM((the routed rows y[t * top_k +
// r] added in slot order) + the shared expert's row y[routed + t]), the operations of
// exl3_down_finish_block's ADD (whose y is the row stored here, exactly: a bf16 value in fp32), so
// the same bytes (docs/model.md#moe). The rows are read through L2: other threadgroups stored them.
template <typename TM>
KX_INLINE void exl3_moe_combine(const KX_DEVICE float* y, KX_DEVICE TM* moe, u32 top_k, u32 routed, u32 n, u32 token,
                                u32 col_block, u32 lane) {
  const u32 c0 = col_block * 128 + 4 * lane;
  const u64 first = (u64)token * top_k * n + c0;
  for (int i = 0; i < 4; i++) {
    float acc = KX_LOAD_CG(y + first + i);
    for (u32 r = 1; r < top_k; r++) acc += KX_LOAD_CG(y + first + (u64)r * n + i);
    moe[(u64)token * n + c0 + i] = static_cast<TM>(acc + KX_LOAD_CG(y + ((u64)routed + token) * n + c0 + i));
  }
}
