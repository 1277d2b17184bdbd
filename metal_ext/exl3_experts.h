// The MoE part of exl3_expert_swiglu (needs exl3_matmul.h).
#pragma once

// h = bf16(weight * (silu(min(g, L)) * clamp(u, -L, L))), float32 math, no clamp for L <= 0
// (model spec §4.5: the routing weight multiplies the SwiGLU product, before w2). g and u arrive
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

// w2's xh for 128-block `block` of one slot, the lane's 4 elements: g and u are finished from the
// gate/up partials gu [2][SPLITS][inter_padded] (splits added in order, H128, svh), then
// h = exl3_routed_swiglu (zero for columns >= inter, the zero-extension of w2's input) and
// xh = H128(fp16(h * suh2)) (exl3 spec §3.3; the caller rounds it to fp16 as it stores it).
// SPLITS is a constant so that every partial's load is issued before the first sum.
template <int SPLITS, typename VT>
KX_INLINE Exl3Vec4 exl3_swiglu_xh(const KX_DEVICE float* gu, u32 inter_padded, u32 inter,
                                  const KX_DEVICE VT* svh1, const KX_DEVICE VT* svh3, const KX_DEVICE VT* suh2,
                                  float weight, float limit, u32 block, u32 lane) {
  const u32 c0 = block * 128 + 4 * lane;
  Exl3Vec4 g = exl3_load4(gu + c0), u = exl3_load4(gu + (u64)SPLITS * inter_padded + c0);
  KX_UNROLL
  for (int p = 1; p < SPLITS; p++) {
    const Exl3Vec4 gp = exl3_load4(gu + (u64)p * inter_padded + c0);
    const Exl3Vec4 up = exl3_load4(gu + (u64)(SPLITS + p) * inter_padded + c0);
    for (int i = 0; i < 4; i++) {
      g.v[i] += gp.v[i];
      u.v[i] += up.v[i];
    }
  }
  g = exl3_hadamard128(g, lane);
  u = exl3_hadamard128(u, lane);
  Exl3Vec4 xv;
  for (int i = 0; i < 4; i++) {
    const u32 c = c0 + i;
    const float h = (c < inter) ? exl3_routed_swiglu(g.v[i] * KX_TO_F32(svh1[c]), u.v[i] * KX_TO_F32(svh3[c]),
                                                     weight, limit)
                                : 0.0f;
    xv.v[i] = exl3_round_f16(h * KX_TO_F32(suh2[c]));
  }
  return exl3_hadamard128(xv, lane);
}
