// Helpers of the mHC kernels (hc_mix, hc_collapse_norm, hc_expand; docs/model.md#mhc).
#pragma once

// The sum over a threadgroup of `warps` SIMD groups of V values per thread, in the order of a
// threadgroup of V · warps SIMD groups holding one each (value j of thread l standing for thread
// l + 32 · warps · j there): an xor butterfly in each SIMD group, then the V · warps group sums
// added in that larger threadgroup's group order (by every thread). `partials` holds V · warps
// floats; the trailing barrier lets a caller reuse it. HcVals: a thread's V values (by value: no
// address space to name).
template <int V>
struct HcVals {
  float v[V];
};
template <int V>
KX_INLINE float hc_threadgroup_sums(HcVals<V> sums, KX_THREADGROUP float* partials, u32 lane, u32 warp, u32 warps) {
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
  HcVals<1> one;
  one.v[0] = v;
  return hc_threadgroup_sums<1>(one, partials, lane, warp, warps);
}

// A value through L2 (CG: another threadgroup of the launch wrote it) or as any load, in fp32.
template <bool CG, typename TS>
KX_INLINE float hc_load(const KX_DEVICE TS* p) {
  return KX_TO_F32(CG ? KX_LOAD_CG(p) : *p);
}

// The collapse Σ_i p[i] · s[i] of one dim's stream values s (FMAs in stream order), rounded to T as
// the reference holds it, in fp32.
template <typename T, int HC>
KX_INLINE float hc_collapse_value(HcVals<HC> p, HcVals<HC> s) {
  float c = p.v[0] * s.v[0];
  KX_UNROLL for (int i = 1; i < HC; i++) c = KX_FMA(p.v[i], s.v[i], c);
  return KX_TO_F32(static_cast<T>(c));
}

// One link of a summing thread's chain (hc_mix_token's order; hc_expanded_chain keeps it): the
// collapse c of one dim's stream values v (hc_collapse_value), then x² += c², then z² += v[i]² in
// stream order, each an FMA.
struct HcLink {
  float c, z, x;
};
template <typename T, int HC>
KX_INLINE HcLink hc_link(HcVals<HC> p, HcVals<HC> v, float z, float x) {
  HcLink l;
  l.c = hc_collapse_value<T, HC>(p, v);
  l.x = KX_FMA(l.c, l.c, x);
  l.z = z;
  KX_UNROLL for (int i = 0; i < HC; i++) l.z = KX_FMA(v.v[i], v.v[i], l.z);
  return l;
}

// 1 / sqrt(sumsq / n + eps): the RMS statistics of an mHC site (hc_mix_token, hc_expand_site_token).
KX_INLINE float hc_inv_rms(float sumsq, u32 n, u32 eps_bits) {
  return 1.0f / KX_SQRT(sumsq / (float)n + KX_BITS_F32(eps_bits));
}

// A site's input at one dim: the rounded collapse c scaled by the RMS statistic and the weight.
template <typename T, typename TW>
KX_INLINE T hc_x_value(float c, float inv, TW w) {
  return static_cast<T>(c * inv * KX_TO_F32(w));
}

// One row's collapse Σ_i p[i] · stream_i as hc_collapse_value gives it, at any dim: a row source
// of hc_rms_norm_row (hc_collapse_norm). streams: the token's HC streams of D values each.
template <typename T, int HC, typename TS>
struct HcCollapseRow {
  const KX_DEVICE TS* streams;
  u32 D;
  HcVals<HC> p;
  KX_INLINE float at(u32 d) const {
    HcVals<HC> s;
    for (int i = 0; i < HC; i++) s.v[i] = KX_TO_F32(streams[(u64)i * D + d]);
    return hc_collapse_value<T, HC>(p, s);
  }
};

template <typename T, int HC, typename TS>
KX_INLINE HcCollapseRow<T, HC, TS> hc_collapse_row(const KX_DEVICE TS* streams, u32 D, HcVals<HC> p) {
  const HcCollapseRow<T, HC, TS> r = {streams, D, p};
  return r;
}

// A row of values at p in fp32, through L2 where CG (another threadgroup of the launch wrote them): a
// row source of hc_rms_norm_row (exl3_gemv's NORM).
template <bool CG, typename TS>
struct HcLoadedRow {
  const KX_DEVICE TS* p;
  KX_INLINE float at(u32 d) const { return hc_load<CG>(p + d); }
};

template <bool CG, typename TS>
KX_INLINE HcLoadedRow<CG, TS> hc_loaded_row(const KX_DEVICE TS* p) {
  const HcLoadedRow<CG, TS> r = {p};
  return r;
}

// A row of values at p rounded to T, in fp32, through L2 where CG: a row source of hc_rms_inv (the
// rope kernel's NORM, whose input may be wider than the dtype the reference rounds it to; exl3_gemv's
// RING, whose input other threadgroups of the launch wrote).
template <typename T, bool CG, typename TS>
struct HcRoundedRow {
  const KX_DEVICE TS* p;
  KX_INLINE float at(u32 d) const { return KX_TO_F32(static_cast<T>(hc_load<CG>(p + d))); }
};

template <typename T, bool CG, typename TS>
KX_INLINE HcRoundedRow<T, CG, TS> hc_rounded_row(const KX_DEVICE TS* p) {
  const HcRoundedRow<T, CG, TS> r = {p};
  return r;
}

// The model's RMSNorm statistic 1 / sqrt(mean(x²) + eps) of one row of D values
// (docs/numerics.md#dtypes) by a threadgroup of 8 SIMD groups: x² summed with FMAs over d = lid,
// lid + 256, .. in each thread, then over the threadgroup (hc_threadgroup_sum). src.at(d) is the
// row's value at d in fp32. Every RMSNorm of a kernel here takes it from this function
// (hc_collapse_norm, exl3_gemv's NORM, the rope kernel's NORM), so all give the same bytes.
// partials: 8 floats of threadgroup memory.
template <typename Src>
KX_INLINE float hc_rms_inv(Src src, u32 D, float eps, KX_THREADGROUP float* partials, u32 lid, u32 lane, u32 warp) {
  float acc = 0.0f;
  for (u32 d = lid; d < D; d += 256) {
    const float x = src.at(d);
    acc = KX_FMA(x, x, acc);
  }
  return 1.0f / KX_SQRT(hc_threadgroup_sum(acc, partials, lane, warp, 8) / (float)D + eps);
}

// The model's RMSNorm of one row (hc_rms_inv's threadgroup and statistic): out[d] = TO(x · inv ·
// weight[d]), src.at(d) read a second time (the same bits). Shared by hc_collapse_norm and
// exl3_gemv's NORM.
template <typename Src, typename TW, typename TO>
KX_INLINE void hc_rms_norm_row(Src src, const KX_DEVICE TW* weight, KX_DEVICE TO* out, u32 D, float eps,
                               KX_THREADGROUP float* partials, u32 lid, u32 lane, u32 warp) {
  const float inv = hc_rms_inv(src, D, eps, partials, lid, lane, warp);
  for (u32 d = lid; d < D; d += 256) out[d] = static_cast<TO>(src.at(d) * inv * KX_TO_F32(weight[d]));
}

// hc_expand's value of new stream j at one dim (docs/model.md#mhc expand): post[j] · y + Σ_i
// comb[i][j] · s[i] in fp32 with FMAs in stream order, rounded to T; s: the old streams' values at
// the dim, comb: column j of comb (hc_comb_column), post: post[j]. Shared by hc_expand and
// hc_expand_site.
template <typename T, int HC>
KX_INLINE T hc_expand_value(HcVals<HC> s, float y, HcVals<HC> comb, float post) {
  float acc = comb.v[0] * s.v[0];
  for (int i = 1; i < HC; i++) acc = KX_FMA(comb.v[i], s.v[i], acc);
  return static_cast<T>(KX_FMA(post, y, acc));
}

// Column j of comb (comb[i][j], i = 0 .. HC - 1) in a token's mixes row (pre | post | comb).
template <int HC>
KX_INLINE HcVals<HC> hc_comb_column(const KX_DEVICE float* mixes, u32 j) {
  HcVals<HC> c;
  for (int i = 0; i < HC; i++) c.v[i] = mixes[2 * HC + (u32)i * HC + j];
  return c;
}

// Eight consecutive values of a row, 16-byte aligned: one or two vector loads.
template <typename T>
struct alignas(16) HcEight {
  T v[8];
};

// Eight values at p (8-element aligned in its row): vector loads where `aligned`.
template <typename T>
KX_INLINE HcEight<T> hc_load_eight(const KX_DEVICE T* p, bool aligned) {
  if (aligned) return *(const KX_DEVICE HcEight<T>*)p;
  HcEight<T> r;
  for (int e = 0; e < 8; e++) r.v[e] = p[e];
  return r;
}

// The new streams [M, HC, D] an expand makes (hc_expand_site), eight values of one stream at a
// time: each value hc_expand_value's of y [M, D], the old streams [M, HC, D] and the expanding
// site's mixes [M, (2+HC)·HC]; where `write`, stored to `out` as well. 8 divides D. `aligned`: y,
// the old streams and out allow 16-byte vector loads and stores.
template <typename T, int HC, typename TY>
struct HcExpander {
  const KX_DEVICE TY* y;
  const KX_DEVICE T* residual;
  const KX_DEVICE float* mixes;
  KX_DEVICE T* out;
  u32 D;
  bool write, aligned;
  // Row m's values at flat columns k .. k + 7 of [HC·D] (stream k / D).
  KX_INLINE HcEight<T> make8(u32 m, u32 k) const {
    const u32 j = k / D, d = k - j * D;
    HcEight<T> s[HC];
    KX_UNROLL for (int i = 0; i < HC; i++) s[i] = hc_load_eight(residual + ((u64)m * HC + i) * D + d, aligned);
    const HcEight<TY> yv = hc_load_eight(y + (u64)m * D + d, aligned);
    const KX_DEVICE float* row = mixes + (u64)m * (2 + HC) * HC;
    const HcVals<HC> comb = hc_comb_column<HC>(row, j);
    const float post = row[HC + j];
    HcEight<T> made;
    for (int e = 0; e < 8; e++) {
      HcVals<HC> v;
      KX_UNROLL for (int i = 0; i < HC; i++) v.v[i] = KX_TO_F32(s[i].v[e]);
      made.v[e] = hc_expand_value<T, HC>(v, KX_TO_F32(yv.v[e]), comb, post);
    }
    if (write) {
      KX_DEVICE T* dst = out + ((u64)m * HC + j) * D + d;
      if (aligned) {
        *(KX_DEVICE HcEight<T>*)dst = made;
      } else {
        for (int e = 0; e < 8; e++) dst[e] = made.v[e];
      }
    }
    return made;
  }
  // Row m's old streams at dim d, in fp32.
  KX_INLINE HcVals<HC> old_at(u32 m, u32 d) const {
    HcVals<HC> s;
    KX_UNROLL for (int i = 0; i < HC; i++) s.v[i] = KX_TO_F32(residual[((u64)m * HC + i) * D + d]);
    return s;
  }
  // The new streams at a dim of row m from its old streams s and y's value there, in fp32: each
  // make8's value (hc_expand_value, rounded to T).
  KX_INLINE HcVals<HC> new_at(u32 m, HcVals<HC> s, float yv) const {
    const KX_DEVICE float* row = mixes + (u64)m * (2 + HC) * HC;
    HcVals<HC> made;
    KX_UNROLL for (int j = 0; j < HC; j++) {
      const T v = hc_expand_value<T, HC>(s, yv, hc_comb_column<HC>(row, j), row[HC + j]);
      made.v[j] = KX_TO_F32(v);
    }
    return made;
  }
};

template <typename T, int HC, typename TY>
KX_INLINE HcExpander<T, HC, TY> hc_expander(const KX_DEVICE TY* y, const KX_DEVICE T* residual,
                                            const KX_DEVICE float* mixes, KX_DEVICE T* out, u32 D, bool write,
                                            bool aligned) {
  const HcExpander<T, HC, TY> e = {y, residual, mixes, out, D, write, aligned};
  return e;
}

// Rows of x held in threadgroup memory for the chunks of eight c0 .. c0 + CAP - 1 of every row
// (rows[m · CAP + c - c0]): a row source (fp32_gemv.h's contract) for fp32_gemv_sums over the part
// of K that starts at chunk c0 (hc_expand_site: the streams its threadgroup formed).
template <typename T>
struct HcPartRows {
  typedef HcEight<T> Raw;
  const KX_THREADGROUP HcEight<T>* rows;
  u32 cap, c0;
  KX_INLINE HcEight<T> load8(u32 m, u32 k) const { return rows[m * cap + k / 8 - c0]; }
  KX_INLINE HcVals<8> values8(HcEight<T> raw, u32, u32) const {
    HcVals<8> r;
    for (int e = 0; e < 8; e++) r.v[e] = KX_TO_F32(raw.v[e]);
    return r;
  }
};

template <typename T>
KX_INLINE HcPartRows<T> hc_part_rows(const KX_THREADGROUP HcEight<T>* rows, u32 cap, u32 c0) {
  const HcPartRows<T> r = {rows, cap, c0};
  return r;
}

// The sum of v over the HC lanes L ^ (k · stride), k < HC (a row of comb: stride 1; a column: HC),
// as an xor butterfly over masks stride, 2 · stride, .. adds it: each lane's value plus its
// partner's, then pairs plus pairs (the same additions, so the same bits on every lane), from the
// HC - 1 values shuffled at once (one shuffle's wait instead of log2 HC: the Sinkhorn's chain).
template <int HC>
KX_INLINE float hc_lane_sum(float v, u32 stride) {
  float w[HC];
  w[0] = v;
  KX_UNROLL for (int k = 1; k < HC; k++) w[k] = KX_SHUFFLE_XOR(v, (u32)k * stride);
  KX_UNROLL for (int width = 1; width < HC; width *= 2)
    KX_UNROLL for (int k = 0; k < HC; k += 2 * width) w[k] = w[k] + w[k + width];
  return w[0];
}

// SIMD group 0's share of an mHC site (hc_mix.metal: what it computes, in which order): token row
// `row`'s mixes pre' | post | comb into out from mm's values (mm_pre, mm_post: lanes < HC; mm_comb:
// lane L's comb[L % HC·HC]) and the streams' Σ z² over HC·D values. Shared by hc_mix_token and
// hc_expand_site_token, so both give the same bytes.
template <int HC, int ITERS>
KX_INLINE void hc_mixes(float mm_pre, float mm_post, float mm_comb, float z_sumsq, u32 D, const KX_DEVICE float* base,
                        const KX_DEVICE float* scale, KX_DEVICE float* out, u64 row, u32 hc_eps_bits,
                        u32 norm_eps_bits, u32 lane) {
  const float inv = hc_inv_rms(z_sumsq, HC * D, norm_eps_bits);
  const float hc_eps = KX_BITS_F32(hc_eps_bits);
  if (lane < HC) {
    const float a = KX_FMA(mm_pre * inv, scale[0], base[lane]);
    const float b = KX_FMA(mm_post * inv, scale[1], base[HC + lane]);
    out[row + lane] = 1.0f / (1.0f + KX_EXP(-a)) + hc_eps;
    out[row + HC + lane] = 2.0f / (1.0f + KX_EXP(-b));
  }
  const u32 k = lane % (HC * HC);
  float c = KX_FMA(mm_comb * inv, scale[2], base[2 * HC + k]);
  float top = c;
  for (u32 m = 1; m < HC; m <<= 1) top = KX_FMAX(top, KX_SHUFFLE_XOR(top, m));
  c = KX_EXP(c - top);
  c = c / hc_lane_sum<HC>(c, 1) + hc_eps;
  c = c / (hc_lane_sum<HC>(c, HC) + hc_eps);
  for (int it = 1; it < ITERS; it++) {
    c = c / (hc_lane_sum<HC>(c, 1) + hc_eps);  // rows
    c = c / (hc_lane_sum<HC>(c, HC) + hc_eps);  // columns
  }
  if (lane < HC * HC) out[row + 2 * HC + lane] = c;
}

// hc_mix's work for token t (hc_mix.metal: what it computes, in which order) by a threadgroup of
// THREADS threads, summing in the order of ORDER threads (1,024: thread l keeps the sums of
// threads l, l + THREADS, .. of that order, ORDER / THREADS of them, in 1, 2 or 4 accumulators);
// partials: 32 floats of threadgroup memory. mm is read through L2: in hc_site the other
// threadgroups of the launch wrote it. Shared by hc_mix (1,024 threads) and hc_site (fp32_gemv's
// 256), so both give the same bytes; hc_expand_site keeps the same chains (hc_link, hc_expanded_chain)
// and mixes (hc_mixes). The dims come in blocks of 4 · ORDER (Flash's D, 5,120: a block and a
// quarter), thread lid's of a block in R = ORDER /
// THREADS passes of four: every load of a block is issued before its sums (one memory round trip),
// and the first block's rounded collapse stays in registers for the output (later blocks load again:
// the same operations give the same bits).
template <typename T, int HC, int ITERS, int THREADS, int ORDER, typename TS, typename TW>
KX_INLINE void hc_mix_token(const KX_DEVICE float* mm, const KX_DEVICE TS* streams, const KX_DEVICE float* base,
                            const KX_DEVICE float* scale, const KX_DEVICE float* pre, u32 pre_w,
                            const KX_DEVICE TW* weight, KX_DEVICE float* out, KX_DEVICE T* x, u32 D, u32 t,
                            u32 hc_eps_bits, u32 norm_eps_bits, u32 eps_bits, KX_THREADGROUP float* partials,
                            u32 lid, u32 lane, u32 warp) {
  const u32 mix_width = (2 + HC) * HC;
  const u64 row = (u64)t * mix_width;
  // mm's values for SIMD group 0's mixes, loaded with the streams' (one round trip)
  float mm_pre = 0.0f, mm_post = 0.0f, mm_comb = 0.0f;
  if (warp == 0) {
    if (lane < HC) {
      mm_pre = KX_LOAD_CG(mm + row + lane);
      mm_post = KX_LOAD_CG(mm + row + HC + lane);
    }
    mm_comb = KX_LOAD_CG(mm + row + 2 * HC + lane % (HC * HC));
  }
  HcVals<HC> p;
  KX_UNROLL for (int i = 0; i < HC; i++) p.v[i] = pre[(u64)t * pre_w + i];
  const u64 first = (u64)t * HC * D;
  // Dim lid + (4r + u) · THREADS of a block goes to accumulator u % V: the dims of thread
  // lid + j · THREADS of ORDER's threadgroup, in their order (V divides 4).
  constexpr int V = ORDER / THREADS, R = V;
  static_assert(V == 1 || V == 2 || V == 4, "hc_mix_token sums in the order of 1, 2 or 4 times its threads");
  constexpr u32 BLOCK = 4 * THREADS * R;
  HcVals<V> zsq, xsq;
  KX_UNROLL for (int j = 0; j < V; j++) zsq.v[j] = xsq.v[j] = 0.0f;
  float kept[R][4];  // the first block's rounded collapse
  for (u32 b0 = lid; b0 < D; b0 += BLOCK) {
    HcVals<HC> v[R][4];
    KX_UNROLL for (int r = 0; r < R; r++) KX_UNROLL for (u32 u = 0; u < 4; u++) {
      const u32 d = b0 + (4 * r + u) * THREADS;
      KX_UNROLL for (int i = 0; i < HC; i++) v[r][u].v[i] = d < D ? hc_load<false>(streams + first + (u64)i * D + d) : 0.0f;
    }
    KX_UNROLL for (int r = 0; r < R; r++) KX_UNROLL for (u32 u = 0; u < 4; u++) {
      float c = 0.0f;
      if (b0 + (4 * r + u) * THREADS < D) {
        const HcLink l = hc_link<T, HC>(p, v[r][u], zsq.v[u % V], xsq.v[u % V]);
        c = l.c;
        zsq.v[u % V] = l.z;
        xsq.v[u % V] = l.x;
      }
      if (b0 == lid) kept[r][u] = c;
    }
  }
  const float z_sumsq = hc_threadgroup_sums<V>(zsq, partials, lane, warp, THREADS / 32);
  const float x_sumsq = hc_threadgroup_sums<V>(xsq, partials, lane, warp, THREADS / 32);
  const float x_inv = hc_inv_rms(x_sumsq, D, eps_bits);
  // SIMD group 0 makes the mixes (the Sinkhorn's chain) while the others store x; then its share of x.
  if (warp == 0)
    hc_mixes<HC, ITERS>(mm_pre, mm_post, mm_comb, z_sumsq, D, base, scale, out, row, hc_eps_bits, norm_eps_bits, lane);
  for (u32 b0 = lid; b0 < D; b0 += BLOCK) {
    float c[R][4];
    KX_UNROLL for (int r = 0; r < R; r++) KX_UNROLL for (u32 u = 0; u < 4; u++) {
      const u32 d = b0 + (4 * r + u) * THREADS;
      if (b0 == lid) {
        c[r][u] = kept[r][u];
      } else {
        HcVals<HC> s;
        KX_UNROLL for (int i = 0; i < HC; i++) s.v[i] = d < D ? hc_load<false>(streams + first + (u64)i * D + d) : 0.0f;
        c[r][u] = hc_collapse_value<T, HC>(p, s);
      }
    }
    KX_UNROLL for (int r = 0; r < R; r++) KX_UNROLL for (u32 u = 0; u < 4; u++) {
      const u32 d = b0 + (4 * r + u) * THREADS;
      if (d < D) x[(u64)t * D + d] = hc_x_value<T>(c[r][u], x_inv, weight[d]);
    }
  }
}

// Summing thread o's chain of hc_mix_token for token t, on streams an expand makes (hc_expand_site):
// dims o, o + ORDER, .. below D, each dim's new streams made as HcExpander makes them, each linked as
// hc_mix_token links it (hc_link): the same operations in the same order, so the same z² and x².
// Stores them to chains[(t · 2 + 0 | 1) · ORDER + o], and each dim's rounded collapse (hc_x_value's
// c) to collapse[t · D + d]. The loads of 8 dims are issued before their links (one round trip at
// Flash's D).
template <typename T, int HC, int ORDER, typename TY>
KX_INLINE void hc_expanded_chain(HcExpander<T, HC, TY> e, const KX_DEVICE float* pre, u32 pre_w, u32 t, u32 o,
                                 KX_DEVICE float* chains, KX_DEVICE float* collapse) {
  HcVals<HC> p;
  KX_UNROLL for (int i = 0; i < HC; i++) p.v[i] = pre[(u64)t * pre_w + i];
  constexpr u32 B = 8;
  float z = 0.0f, x = 0.0f;
  for (u32 d0 = o; d0 < e.D; d0 += B * ORDER) {
    HcVals<HC> s[B];
    float yv[B];
    KX_UNROLL for (u32 k = 0; k < B; k++) {
      const u32 d = d0 + k * ORDER;
      if (d < e.D) {
        s[k] = e.old_at(t, d);
        yv[k] = KX_TO_F32(e.y[(u64)t * e.D + d]);
      }
    }
    KX_UNROLL for (u32 k = 0; k < B; k++) {
      const u32 d = d0 + k * ORDER;
      if (d < e.D) {
        const HcLink l = hc_link<T, HC>(p, e.new_at(t, s[k], yv[k]), z, x);
        z = l.z;
        x = l.x;
        collapse[(u64)t * e.D + d] = l.c;
      }
    }
  }
  chains[(u64)t * 2 * ORDER + o] = z;
  chains[((u64)t * 2 + 1) * ORDER + o] = x;
}

// mm[i] from its SPLIT part sums (parts[i · SPLIT + s], another threadgroup's: through L2), added in
// part order as fp32_gemv adds them.
template <int SPLIT>
KX_INLINE float hc_part_sum(const KX_DEVICE float* parts, u64 i) {
  float v = KX_LOAD_CG(parts + i * SPLIT);
  for (u32 s = 1; s < SPLIT; s++) v += KX_LOAD_CG(parts + i * SPLIT + s);
  return v;
}

// One pass of hc_expand_site_token's x loads: the rounded collapse and the weight at dims d0 + k · XT
// (k < XB) below D, issued together so that a pass waits on one round trip (by value, as HcVals).
template <int XB>
struct HcXPass {
  float c[XB], w[XB];
};
template <int XB, int XT, typename TW>
KX_INLINE HcXPass<XB> hc_x_loads(const KX_DEVICE float* collapse, const KX_DEVICE TW* weight, u32 d0, u32 D) {
  HcXPass<XB> p;
  KX_UNROLL for (u32 k = 0; k < XB; k++) {
    const u32 d = d0 + k * XT;
    if (d < D) {
      p.c[k] = KX_LOAD_CG(collapse + d);
      p.w[k] = KX_TO_F32(weight[d]);
    }
  }
  return p;
}

// hc_mix's work for token t once a launch's threadgroups have made its sums (hc_expand_site, after
// the count): mm's values from the part sums (hc_part_sum, in SIMD group 0's lanes: the adds that
// give the stored mm, made again so as not to wait on its store), z² and x² from the ORDER chains
// (hc_expanded_chain) summed as hc_mix_token sums its threads' (hc_threadgroup_sums); SIMD group 0
// makes the mixes (hc_mixes) while the others write x from the rounded collapse (hc_x_value). The
// bytes of hc_mix_token on the streams; no stream is read again. Every load of the others' x values
// (XB a thread: Flash's D in one round trip) is issued before the sums. partials: 32 floats.
template <typename T, int HC, int ITERS, int THREADS, int ORDER, int SPLIT, typename TW>
KX_INLINE void hc_expand_site_token(const KX_DEVICE float* parts, const KX_DEVICE float* chains,
                                    const KX_DEVICE float* collapse, const KX_DEVICE float* base,
                                    const KX_DEVICE float* scale, const KX_DEVICE TW* weight, KX_DEVICE float* out,
                                    KX_DEVICE T* x, u32 D, u32 t, u32 hc_eps_bits, u32 norm_eps_bits, u32 eps_bits,
                                    KX_THREADGROUP float* partials, u32 lid, u32 lane, u32 warp) {
  constexpr int V = ORDER / THREADS;
  constexpr u32 XB = 24, XT = THREADS - 32;  // x by SIMD groups 1 ..: XB values a thread a pass
  const u64 row = (u64)t * (2 + HC) * HC;
  HcVals<V> zsq, xsq;
  KX_UNROLL for (int j = 0; j < V; j++) {
    zsq.v[j] = KX_LOAD_CG(chains + (u64)t * 2 * ORDER + lid + j * THREADS);
    xsq.v[j] = KX_LOAD_CG(chains + ((u64)t * 2 + 1) * ORDER + lid + j * THREADS);
  }
  float mm_pre = 0.0f, mm_post = 0.0f, mm_comb = 0.0f;
  HcXPass<XB> xp;
  const u32 xt = lid - 32;  // x's thread index (SIMD groups 1 ..; unused in SIMD group 0)
  if (warp == 0) {
    if (lane < HC) {
      mm_pre = hc_part_sum<SPLIT>(parts, row + lane);
      mm_post = hc_part_sum<SPLIT>(parts, row + HC + lane);
    }
    mm_comb = hc_part_sum<SPLIT>(parts, row + 2 * HC + lane % (HC * HC));
  } else {
    xp = hc_x_loads<XB, XT>(collapse + (u64)t * D, weight, xt, D);
  }
  const float z_sumsq = hc_threadgroup_sums<V>(zsq, partials, lane, warp, THREADS / 32);
  const float x_sumsq = hc_threadgroup_sums<V>(xsq, partials, lane, warp, THREADS / 32);
  if (warp == 0) {
    hc_mixes<HC, ITERS>(mm_pre, mm_post, mm_comb, z_sumsq, D, base, scale, out, row, hc_eps_bits, norm_eps_bits, lane);
    return;
  }
  const float x_inv = hc_inv_rms(x_sumsq, D, eps_bits);
  for (u32 d0 = xt; d0 < D; d0 += XB * XT) {
    if (d0 != xt) xp = hc_x_loads<XB, XT>(collapse + (u64)t * D, weight, d0, D);
    KX_UNROLL for (u32 k = 0; k < XB; k++) {
      const u32 d = d0 + k * XT;
      if (d < D) x[(u64)t * D + d] = hc_x_value<T>(xp.c[k], x_inv, xp.w[k]);
    }
  }
}
