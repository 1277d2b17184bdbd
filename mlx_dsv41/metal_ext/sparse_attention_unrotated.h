// sparse_attention_unrotated's output (sparse_attention_unrotated.metal): the attention kernels'
// values turned back at their query position as the rope kernel turns their float32 output
// (rope.h: rope_angle, rope_turn, rope_turned; INVERSE, STEP 1), in the same launch.
#pragma once

// Output [B, S, H, D] in T; period [D / 2] (rope's whole-width periods); offset: the position of
// query row s = 0.
template <typename T, typename TP>
struct SaUnrotated {
  KX_DEVICE T* out;
  const KX_DEVICE TP* period;
  i32 offset;
  u32 D, H, S;
};

template <typename T, typename TP>
KX_INLINE SaUnrotated<T, TP> sa_unrotated(KX_DEVICE T* out, const KX_DEVICE TP* period, i32 offset, u32 D, u32 H,
                                          u32 S) {
  const SaUnrotated<T, TP> o = {out, period, offset, D, H, S};
  return o;
}

// Four consecutive values from element i (i % 4 == 0: two whole pairs of one row (b, s, h)): each
// rounded to T as the rope kernel reads its input, the pair turned by its angle (its cosine and
// sine computed once for both elements), rounded to T.
template <typename T, typename TP>
KX_INLINE void sa_store4(SaUnrotated<T, TP> o, i64 i, float4 f) {
  const u64 row = (u64)i / o.D;
  const u32 d = (u32)((u64)i - row * o.D);
  const float L = rope_angle<1, 1>(o.offset, (u32)((row / o.H) % o.S));
  float v[4];
  v[0] = KX_TO_F32(static_cast<T>(f.x));
  v[1] = KX_TO_F32(static_cast<T>(f.y));
  v[2] = KX_TO_F32(static_cast<T>(f.z));
  v[3] = KX_TO_F32(static_cast<T>(f.w));
  for (u32 p = 0; p < 2; p++) {
    const RopeTurn t = rope_turn(L, KX_TO_F32(o.period[(d >> 1) + p]));
    o.out[i + 2 * p] = static_cast<T>(rope_turned(v[2 * p], v[2 * p + 1], t, 0u));
    o.out[i + 2 * p + 1] = static_cast<T>(rope_turned(v[2 * p], v[2 * p + 1], t, 1u));
  }
}
