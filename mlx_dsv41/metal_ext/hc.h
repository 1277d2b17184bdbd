// Helpers of the mHC kernels (hc_mix, hc_collapse_norm, hc_expand; docs/model.md#mhc).
#pragma once

// The sum over a threadgroup of `warps` SIMD groups of V values per thread, in the order of a
// threadgroup of V · warps SIMD groups holding one each (value j of thread l standing for thread
// l + 32 · warps · j there): an xor butterfly in each SIMD group, then the V · warps group sums
// added in that larger threadgroup's group order (by every thread). `partials` holds V · warps
// floats; the trailing barrier lets a caller reuse it. HcSums: a thread's V values (by value: no
// address space to name).
template <int V>
struct HcSums {
  float v[V];
};
template <int V>
KX_INLINE float hc_threadgroup_sums(HcSums<V> sums, KX_THREADGROUP float* partials, u32 lane, u32 warp, u32 warps) {
  KX_UNROLL for (int j = 0; j < V; j++) {
    float x = sums.v[j];
    for (u32 m = 16; m > 0; m >>= 1) x += KX_SHUFFLE_XOR(x, m);
    if (lane == 0) partials[warp + warps * j] = x;
  }
  KX_BARRIER();
  float s = partials[0];
  for (u32 w = 1; w < V * warps; w++) s += partials[w];
  KX_BARRIER();
  return s;
}

// The sum of v over a threadgroup of `warps` SIMD groups in a fixed order (hc_threadgroup_sums with
// one value a thread).
KX_INLINE float hc_threadgroup_sum(float v, KX_THREADGROUP float* partials, u32 lane, u32 warp, u32 warps) {
  HcSums<1> one;
  one.v[0] = v;
  return hc_threadgroup_sums<1>(one, partials, lane, warp, warps);
}

// hc_mix's work for token t (hc_mix.metal: what it computes, in which order) by a threadgroup of
// THREADS threads, summing in the order of ORDER threads (1,024: thread l keeps the sums of
// threads l, l + THREADS, .. of that order, ORDER / THREADS of them, in 1, 2 or 4 accumulators);
// partials: 32 floats of threadgroup memory. mm is read through L2: in hc_site the other
// threadgroups of the launch wrote it. Shared by hc_mix (1,024 threads) and hc_site (fp32_gemv's
// 256), so both give the same bytes.
template <typename T, int HC, int ITERS, int THREADS, int ORDER, typename TS, typename TW>
KX_INLINE void hc_mix_token(const KX_DEVICE float* mm, const KX_DEVICE TS* streams, const KX_DEVICE float* base,
                            const KX_DEVICE float* scale, const KX_DEVICE float* pre, u32 pre_w,
                            const KX_DEVICE TW* weight, KX_DEVICE float* out, KX_DEVICE T* x, u32 D, u32 t,
                            u32 hc_eps_bits, u32 norm_eps_bits, u32 eps_bits, KX_THREADGROUP float* partials,
                            u32 lid, u32 lane, u32 warp) {
  const u32 mix_width = (2 + HC) * HC;
  float p[HC];
  KX_UNROLL for (int i = 0; i < HC; i++) p[i] = pre[(u64)t * pre_w + i];
  const u64 first = (u64)t * HC * D;
  // Dims d0 + u · THREADS go to accumulator u % V: the dims of thread lid + j · THREADS of ORDER's
  // threadgroup, in their order (d0 advances by 4 · THREADS and V divides 4).
  constexpr int V = ORDER / THREADS;
  static_assert(V == 1 || V == 2 || V == 4, "hc_mix_token sums in the order of 1, 2 or 4 times its threads");
  HcSums<V> zsq, xsq;
  KX_UNROLL for (int j = 0; j < V; j++) zsq.v[j] = xsq.v[j] = 0.0f;
  for (u32 d0 = lid; d0 < D; d0 += 4 * THREADS) {
    float v[4][HC];
    KX_UNROLL for (u32 u = 0; u < 4; u++) {
      const u32 d = d0 + u * THREADS;
      KX_UNROLL for (int i = 0; i < HC; i++) v[u][i] = d < D ? KX_TO_F32(streams[first + (u64)i * D + d]) : 0.0f;
    }
    KX_UNROLL for (u32 u = 0; u < 4; u++) {
      if (d0 + u * THREADS < D) {
        float c = p[0] * v[u][0];
        KX_UNROLL for (int i = 1; i < HC; i++) c = KX_FMA(p[i], v[u][i], c);
        const float x = KX_TO_F32(static_cast<T>(c));
        xsq.v[u % V] = KX_FMA(x, x, xsq.v[u % V]);
        KX_UNROLL for (int i = 0; i < HC; i++) zsq.v[u % V] = KX_FMA(v[u][i], v[u][i], zsq.v[u % V]);
      }
    }
  }
  const float z_sumsq = hc_threadgroup_sums<V>(zsq, partials, lane, warp, THREADS / 32);
  const float x_sumsq = hc_threadgroup_sums<V>(xsq, partials, lane, warp, THREADS / 32);
  const float x_inv = 1.0f / KX_SQRT(x_sumsq / (float)D + KX_BITS_F32(eps_bits));
  for (u32 d0 = lid; d0 < D; d0 += 4 * THREADS) {
    float c[4];
    KX_UNROLL for (u32 u = 0; u < 4; u++) {
      const u32 d = d0 + u * THREADS;
      float v[HC];
      KX_UNROLL for (int i = 0; i < HC; i++) v[i] = d < D ? KX_TO_F32(streams[first + (u64)i * D + d]) : 0.0f;
      c[u] = p[0] * v[0];
      KX_UNROLL for (int i = 1; i < HC; i++) c[u] = KX_FMA(p[i], v[i], c[u]);
    }
    KX_UNROLL for (u32 u = 0; u < 4; u++) {
      const u32 d = d0 + u * THREADS;
      if (d < D) x[(u64)t * D + d] = static_cast<T>(KX_TO_F32(static_cast<T>(c[u])) * x_inv * KX_TO_F32(weight[d]));
    }
  }
  if (warp == 0) {
    const float inv = 1.0f / KX_SQRT(z_sumsq / (float)(HC * D) + KX_BITS_F32(norm_eps_bits));
    const float hc_eps = KX_BITS_F32(hc_eps_bits);
    const u64 row = (u64)t * mix_width;
    if (lane < HC) {
      const float a = KX_FMA(KX_LOAD_CG(mm + row + lane) * inv, scale[0], base[lane]);
      const float b = KX_FMA(KX_LOAD_CG(mm + row + HC + lane) * inv, scale[1], base[HC + lane]);
      out[row + lane] = 1.0f / (1.0f + KX_EXP(-a)) + hc_eps;
      out[row + HC + lane] = 2.0f / (1.0f + KX_EXP(-b));
    }
    const u32 k = lane % (HC * HC);
    float c = KX_FMA(KX_LOAD_CG(mm + row + 2 * HC + k) * inv, scale[2], base[2 * HC + k]);
    float top = c;
    for (u32 m = 1; m < HC; m <<= 1) top = KX_FMAX(top, KX_SHUFFLE_XOR(top, m));
    c = KX_EXP(c - top);
    float s = c;
    for (u32 m = 1; m < HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
    c = c / s + hc_eps;
    s = c;
    for (u32 m = HC; m < HC * HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
    c = c / (s + hc_eps);
    for (int it = 1; it < ITERS; it++) {
      s = c;
      for (u32 m = 1; m < HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
      c = c / (s + hc_eps);
      s = c;
      for (u32 m = HC; m < HC * HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
      c = c / (s + hc_eps);
    }
    if (lane < HC * HC) out[row + 2 * HC + lane] = c;
  }
}
