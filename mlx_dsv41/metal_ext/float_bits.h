// Float roundings written as bits, the same on every backend (no backend's own 16-bit float
// conversion is involved).
#pragma once

// bfloat16 bits of v rounded to nearest, ties to even (NaN stays NaN).
KX_INLINE u32 kx_bf16_bits(float v) {
  const u32 u = KX_F32_BITS(v);
  if (KX_ISNAN(v)) return (u >> 16) | 0x40u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
