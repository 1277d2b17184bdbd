// Helpers of the fake_quant kernel: mlx_dsv41/model/fake_quant.py's operations, one for one.
#pragma once

// NaN-propagating abs / max / min (MLX's abs, maximum, minimum and max reduction propagate NaN).
KX_INLINE float fq_abs(float a) { return KX_BITS_F32(KX_F32_BITS(a) & 0x7FFFFFFFu); }
KX_INLINE float fq_max(float a, float b) { return KX_ISNAN(a) ? a : (KX_ISNAN(b) ? b : (a < b ? b : a)); }
KX_INLINE float fq_min(float a, float b) { return KX_ISNAN(a) ? a : (KX_ISNAN(b) ? b : (b < a ? b : a)); }
// floor(log2(a)) from the exponent field (int32 arithmetic shift, as mx.right_shift), and 2^k
// built in it (the shift wraps as a 32-bit integer).
KX_INLINE i32 fq_floor_log2(float a) { return (((i32)KX_F32_BITS(a)) >> 23) - 127; }
KX_INLINE float fq_exp2(i32 k) { return KX_BITS_F32(((u32)(k + 127)) << 23); }

// The nearest grid value (mantissa bits, smallest normal exponent, largest value) to v, ties to
// even, saturating; the sign of v kept (also for -0 and NaN with the sign bit set).
KX_INLINE float fq_round_to_grid(float v, i32 mantissa_bits, i32 min_exponent, float max_value) {
  const float a = fq_min(fq_abs(v), max_value);
  const i32 e = fq_floor_log2(a);
  const float quantum = fq_exp2((e > min_exponent ? e : min_exponent) - mantissa_bits);
  const float r = KX_RINT(a / quantum) * quantum;
  return ((i32)KX_F32_BITS(v)) < 0 ? -r : r;
}

// 2^ceil(log2(amax / max_value)) for positive normal quotients: the exponent, plus one unless
// the quotient is a power of two.
KX_INLINE float fq_ue8m0_scale(float amax, float max_value) {
  const float y = amax / max_value;
  const i32 inexact = (KX_F32_BITS(y) & 0x7FFFFFu) != 0u ? 1 : 0;
  return fq_exp2(fq_floor_log2(y) + inexact);
}

// v rounded to the block float format MODE (0: e4m3, ue8m0 scale; 1: e2m1, ue8m0 scale; 2: e2m1,
// e4m3 scale) with one scale per `block` (16 or 32) consecutive lanes: the block's amax meets in a
// xor butterfly over those lanes, so every lane of the SIMD group must call it (lanes without an
// element pass 0). mlx_dsv41/model/fake_quant.py's operations, one for one.
KX_INLINE float fq_quantize(float v, u32 block, int mode) {
  float amax = fq_abs(v);
  for (u32 m = block / 2; m > 0; m >>= 1) amax = fq_max(amax, KX_SHUFFLE_XOR(amax, m));
  if (mode == 0) {
    const float s = fq_ue8m0_scale(fq_max(amax, 1e-4f), 448.0f);
    return fq_round_to_grid(v / s, 3, -6, 448.0f) * s;
  }
  if (mode == 1) {
    const float s = fq_ue8m0_scale(fq_max(amax, 6.0f * KX_BITS_F32(0x00800000u)), 6.0f);  // amax/6 >= 2^-126
    return fq_round_to_grid(v / s, 1, 0, 6.0f) * s;
  }
  const float s = fq_round_to_grid(fq_max(amax, 6.0f * KX_BITS_F32(0x3B000000u)) / 6.0f, 3, -6, 448.0f);  // 2^-9
  return fq_round_to_grid(v / s, 1, 0, 6.0f) * s;
}
