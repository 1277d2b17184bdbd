// Float arithmetic that rounds the same on every backend: plain IEEE operations no compiler may
// contract, and roundings written as bits (no backend's own 16-bit float conversion is involved).
#pragma once

// Plain float operations that no compiler may fuse into an fma, so that a kernel's surroundings
// (inlining, unrolling) cannot change a rounding: CUDA's _rn intrinsics are never contracted;
// Metal contracts only within one statement under math_mode "safe" (and here not at all); the
// simulator (tests) is built without contraction.
#if defined(KX_CUDA)
#define KX_FADD(a, b) __fadd_rn((a), (b))
#define KX_FSUB(a, b) __fsub_rn((a), (b))
#define KX_FMUL(a, b) __fmul_rn((a), (b))
#define KX_FDIV(a, b) __fdiv_rn((a), (b))
#elif defined(KX_SIM)
#define KX_FADD(a, b) ((a) + (b))
#define KX_FSUB(a, b) ((a) - (b))
#define KX_FMUL(a, b) ((a) * (b))
#define KX_FDIV(a, b) ((a) / (b))
#else
#pragma METAL fp contract(off)
#define KX_FADD(a, b) ((a) + (b))
#define KX_FSUB(a, b) ((a) - (b))
#define KX_FMUL(a, b) ((a) * (b))
#define KX_FDIV(a, b) metal::precise::divide((a), (b))
#endif

// bfloat16 bits of v rounded to nearest, ties to even (NaN stays NaN).
KX_INLINE u32 kx_bf16_bits(float v) {
  const u32 u = KX_F32_BITS(v);
  if (KX_ISNAN(v)) return (u >> 16) | 0x40u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
