// The MoE part of exl3_expert_down's input stage (needs exl3_matmul.h).
#pragma once

// h = bf16(weight * (silu(min(g, L)) * clamp(u, -L, L))), float32 math, no clamp for L <= 0
// (model spec §4.5: the routing weight multiplies the SwiGLU product, before w2). NaN propagates.
KX_INLINE float exl3_routed_swiglu(float g, float u, float weight, float limit) {
  if (limit > 0.0f) {
    g = (g > limit) ? limit : g;
    u = (u > limit) ? limit : ((u < -limit) ? -limit : u);
  }
  const float silu = g / (1.0f + KX_EXP(-g));
  return exl3_round_bf16(weight * (silu * u));
}

// Stage w2's xh for one slot, 128-blocks kb0 .. kb0+nb-1 of the intermediate dim: g and u are
// finished from the gate/up partials gu [2][splits][inter_padded] (splits added in order, H128,
// svh), then h = exl3_routed_swiglu (zero for columns >= inter, the zero-extension of w2's input)
// and xh = fp16(H128(fp16(h * suh2))) (exl3 spec §3.3).
template <typename VT>
KX_INLINE void exl3_stage_swiglu(KX_THREADGROUP u32* xs, const KX_DEVICE float* gu, u32 splits, u32 inter_padded,
                                 u32 inter, const KX_DEVICE VT* svh1, const KX_DEVICE VT* svh3,
                                 const KX_DEVICE VT* suh2, float weight, float limit, u32 kb0, u32 nb,
                                 u32 warp, u32 warps, u32 lane) {
  for (u32 b = warp; b < nb; b += warps) {
    const u32 c0 = (kb0 + b) * 128 + 4 * lane;
    Exl3Vec4 g, u;
    for (int i = 0; i < 4; i++) {
      float sg = 0.0f, su = 0.0f;
      for (u32 p = 0; p < splits; p++) {
        sg += gu[(u64)p * inter_padded + c0 + i];
        su += gu[(u64)(splits + p) * inter_padded + c0 + i];
      }
      g.v[i] = sg;
      u.v[i] = su;
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
    exl3_store_xh(xs, b, exl3_hadamard128(xv, lane), lane);
  }
}
