// Helpers of the mHC kernels (hc_mix, hc_collapse_norm, hc_expand; docs/model.md#mhc).
#pragma once

// The sum of v over a threadgroup of `warps` SIMD groups, in a fixed order: an xor butterfly in each
// SIMD group, then the group sums added in group order (by every thread). `partials` holds one
// float per SIMD group; the trailing barrier lets a caller reuse it.
KX_INLINE float hc_threadgroup_sum(float v, KX_THREADGROUP float* partials, u32 lane, u32 warp, u32 warps) {
  for (u32 m = 16; m > 0; m >>= 1) v += KX_SHUFFLE_XOR(v, m);
  if (lane == 0) partials[warp] = v;
  KX_BARRIER();
  float s = partials[0];
  for (u32 w = 1; w < warps; w++) s += partials[w];
  KX_BARRIER();
  return s;
}
