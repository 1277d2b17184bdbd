// mxfp4 values (docs/numerics.md#mxfp4-gemv): E2M1 codes and E8M0 scales, decoded exactly to fp32.
#pragma once

// E2M1 code c (4 bits: sign, 2 exponent bits, 1 mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
// their negatives.
KX_INLINE float mxfp4_e2m1(u32 c) {
  const u32 ex = (c >> 1) & 3u, man = c & 1u;
  const u32 bits = ex ? ((126u + ex) << 23) | (man << 22) : (man ? 0x3F000000u : 0u);
  return KX_BITS_F32(bits | ((c & 8u) << 28));
}

// E8M0 scale s: 2^(s - 127); 255 is NaN.
KX_INLINE float mxfp4_scale(u32 s) {
  if (s == 255u) return KX_NAN_F32;
  return KX_BITS_F32(s ? s << 23 : 0x00400000u);
}
