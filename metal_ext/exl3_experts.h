// The MoE part of exl3_expert_down's input stage (needs exl3_matmul.h).
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

// w2's xh for one slot (a stager for exl3_product): g and u are finished from the gate/up
// partials gu [2][splits][inter_padded] (splits added in order, H128, svh), then
// h = exl3_routed_swiglu (zero for columns >= inter, the zero-extension of w2's input) and
// xh = fp16(H128(fp16(h * suh2))) (exl3 spec §3.3).
template <typename VT>
struct Exl3SwigluStager {
  const KX_DEVICE float* gu;
  u32 splits, inter_padded, inter;
  const KX_DEVICE VT* svh1;
  const KX_DEVICE VT* svh3;
  const KX_DEVICE VT* suh2;
  float weight, limit;

  KX_INLINE void stage(KX_THREADGROUP u32* xs, u32 b0, u32 nb, u32 warp, u32 warps, u32 lane) const {
    for (u32 b = warp; b < nb; b += warps) {
      const u32 c0 = (b0 + b) * 128 + 4 * lane;
      Exl3Vec4 g, u;
      for (int i = 0; i < 4; i++) g.v[i] = u.v[i] = 0.0f;
      for (u32 p = 0; p < splits; p++)
        for (int i = 0; i < 4; i++) {
          g.v[i] += gu[(u64)p * inter_padded + c0 + i];
          u.v[i] += gu[(u64)(splits + p) * inter_padded + c0 + i];
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
};

template <typename VT>
KX_INLINE Exl3SwigluStager<VT> exl3_swiglu_stager(const KX_DEVICE float* gu, u32 splits, u32 inter_padded, u32 inter,
                                                  const KX_DEVICE VT* svh1, const KX_DEVICE VT* svh3,
                                                  const KX_DEVICE VT* suh2, float weight, float limit) {
  Exl3SwigluStager<VT> s;
  s.gu = gu;
  s.splits = splits;
  s.inter_padded = inter_padded;
  s.inter = inter;
  s.svh1 = svh1;
  s.svh3 = svh3;
  s.suh2 = suh2;
  s.weight = weight;
  s.limit = limit;
  return s;
}
