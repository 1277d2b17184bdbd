// rope's work for one output row (rope.metal: what it computes, in which order), shared by rope and
// rope_pair so that a row has the same bytes from either (docs/numerics.md#rope-launch); its angle
// and rotation also serve sparse_attention_unrotated's output (sparse_attention.h).
#pragma once

// The angle of position offset + s before a pair's period: ±STEP · (offset + s).
template <int STEP, int INVERSE>
KX_INLINE float rope_angle(i32 offset, u32 s) {
  return (INVERSE ? -(float)STEP : (float)STEP) * (float)(offset + (i32)s);
}

// The cosine and sine of a pair's angle L / period (MLX's rope: its expressions).
struct RopeTurn {
  float c, sn;
};
KX_INLINE RopeTurn rope_turn(float L, float period) {
  const float theta = L * KX_ROPE_INV(period);
  RopeTurn t;
  t.c = KX_ROPE_COS(theta);
  t.sn = KX_ROPE_SIN(theta);
  return t;
}

// Element `odd` of interleaved pair (x1, x2) turned by t: MLX's rope expressions x1·c - x2·s and
// x1·s + x2·c with the roundings its CUDA build makes (x2·s rounded, then fma(x1, c, ·); x1·s
// rounded, then fma(x2, c, ·): measured on the H200, docs/numerics.md#rope-launch). Written out, not
// left to the compiler, which fused either product depending on the surrounding code: the attention
// launch's turned output then differed from the rope kernel's in an element's last bit.
KX_INLINE float rope_turned(float x1, float x2, RopeTurn t, u32 odd) {
  return odd ? KX_FMA(x2, t.c, KX_FMUL(x1, t.sn)) : KX_FMA(x1, t.c, -KX_FMUL(x2, t.sn));
}

// The value rope_row stores for element `odd` of pair (x1, x2) (each already rounded to T) before
// its fake quantization: the pair turned by t (rope_turn of its angle and period), rounded to T, in
// fp32. Also
// exl3_gemv's ROPE, which turns the rows it stores with it (docs/design.md#roped-linears).
template <typename T>
KX_INLINE float rope_value(float x1, float x2, RopeTurn t, u32 odd) {
  return KX_TO_F32(static_cast<T>(rope_turned(x1, x2, t, odd)));
}

// With a ring: row s of the new rows that slot `slot` of a ring of R receives when rows are written at
// slots (offset + s) % R (as many rows as there are: S or more where the slot keeps its old row).
KX_INLINE u32 rope_ring_row(u32 slot, u32 R, i32 offset) {
  return (slot + R - (u32)offset % R) % R;
}

// Slot r % R of ring r / R ([B, R, D]) copied to out by a threadgroup of 256 threads if no new row
// reaches it (rope_ring_row); whether it was. exl3_gemv's RING copies these slots in threadgroups of
// its own while the new rows are still being computed.
template <typename T, typename TR>
KX_INLINE bool rope_ring_copy(const KX_DEVICE TR* ring, KX_DEVICE T* out, u32 r, u32 D, u32 S, u32 R, i32 offset,
                              u32 lid) {
  if (rope_ring_row(r % R, R, offset) < S) return false;
  const u64 dst = (u64)r * D;
  for (u32 d = lid; d < D; d += 256) out[dst + d] = static_cast<T>(ring[dst + d]);
  return true;
}

// Output row r by a threadgroup of 256 threads: row r of x [.., S, H, D] (H = 1 for [B, S, D]) at
// position offset + s; with RING, slot r % R of ring r / R ([B, R, D]). x is read through L2 where CG
// (exl3_gemv's RING: other threadgroups of the launch wrote it). partials: 8 floats of threadgroup
// memory.
template <typename T, int STEP, int INVERSE, int NORM, int QUANT, int BLOCK, int MODE, int RING, bool CG = false,
          typename TX, typename TP, typename TW, typename TR>
KX_INLINE void rope_row(const KX_DEVICE TX* x, i32 offset, const KX_DEVICE TP* period, const KX_DEVICE TW* weight,
                        const KX_DEVICE TR* ring, KX_DEVICE T* out, u32 r, u32 D, u32 H, u32 S, u32 R, u32 eps_bits,
                        KX_THREADGROUP float* partials, u32 lid, u32 lane, u32 warp) {
  u64 row = (u64)r * D;
  u32 s = (r / H) % S;
  const u64 dst = row;
  if (RING) {  // a slot the new rows do not reach: the whole threadgroup copies it
    if (rope_ring_copy(ring, out, r, D, S, R, offset, lid)) return;
    s = rope_ring_row(r % R, R, offset);
    row = ((u64)(r / R) * S + s) * D;
  }
  const float inv =
      NORM ? hc_rms_inv(hc_rounded_row<T, CG>(x + row), D, KX_BITS_F32(eps_bits), partials, lid, lane, warp) : 1.0f;
  const float L = rope_angle<STEP, INVERSE>(offset, s);
  for (u32 d = lid; d < D; d += 256) {
    float v = KX_TO_F32(static_cast<T>(hc_load<CG>(x + row + d)));
    if (NORM) v = KX_TO_F32(static_cast<T>(v * inv * KX_TO_F32(weight[d])));
    const float other = KX_SHUFFLE_XOR(v, 1);
    const float x1 = (d & 1u) ? other : v, x2 = (d & 1u) ? v : other;
    float q = rope_value<T>(x1, x2, rope_turn(L, KX_TO_F32(period[d >> 1])), d & 1u);
    if (QUANT) q = fq_quantize(q, BLOCK, MODE);
    out[dst + d] = static_cast<T>(q);
  }
}
