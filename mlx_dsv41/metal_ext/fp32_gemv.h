// fp32_gemv's work (fp32_gemv.metal: what it computes, in which order) for one threadgroup of 8 SIMD
// groups: threadgroup `group`'s outputs of y [M, N] = x [M, K] · w [N, K]ᵀ (x read through a row
// source: Fp32Rows, or rows held in threadgroup memory). sums: 8 x 8 x 4 floats of threadgroup
// memory (SPLIT > 1: SIMD groups x M x COLS range sums). Shared by fp32_gemv and the launches that
// finish its outputs in their last threadgroup (hc_site, moe_gate; hc_expand_site runs one SIMD
// group's sums, fp32_gemv_sums, on its own threadgroups), so all give the same bytes.
#pragma once

// Eight consecutive values of a row of x, in fp32.
struct Fp32Eight {
  float v[8];
};

// x [M, K] as stored: the rows fp32_gemv reads, through the row-source contract: load8(m, k) issues
// the loads of row m's columns k .. k + 7 (a Raw), values8(raw, m, k) makes their fp32 values
// (.v[0 .. 7]). A launch that holds x elsewhere passes its own source (hc.h: HcPartRows, the streams
// hc_expand_site formed in threadgroup memory); fp32_gemv_sums issues every load of a pass before
// any values8.
template <typename TX>
struct Fp32Rows {
  typedef Fp32Eight Raw;
  const KX_DEVICE TX* x;
  u32 K;
  KX_INLINE Fp32Eight load8(u32 m, u32 k) const {
    Fp32Eight r;
    for (int e = 0; e < 8; e++) r.v[e] = KX_TO_F32(x[(u64)m * K + k + e]);
    return r;
  }
  KX_INLINE Fp32Eight values8(Fp32Eight raw, u32, u32) const { return raw; }
};

template <typename TX>
KX_INLINE Fp32Rows<TX> fp32_rows(const KX_DEVICE TX* x, u32 K) {
  const Fp32Rows<TX> rows = {x, K};
  return rows;
}

// A SIMD group's sums of M rows x COLS outputs (by value: no address space to name).
template <int M, int COLS>
struct Fp32Sums {
  float v[M][COLS];
};

// One SIMD group's sums: outputs n0 .. n0 + COLS - 1 (those below N) over part `part` of SPLIT
// ranges of K's chunks of eight, each output's lane sums added by an xor butterfly (every lane holds
// them after). `live` is the same for the whole SIMD group (the butterfly has every lane).
template <int M, int COLS, int SPLIT, int W, int UMAX = 8, typename XS, typename TW>
KX_INLINE Fp32Sums<M, COLS> fp32_gemv_sums(XS x, const KX_DEVICE TW* w, u32 N, u32 K, u32 n0, u32 part, bool live,
                                           u32 lane) {
  const u32 C = K / 8;
  Fp32Sums<M, COLS> acc;
  for (int m = 0; m < M; m++)
    for (int j = 0; j < COLS; j++) acc.v[m][j] = 0.0f;
  const KX_DEVICE u32* words = (const KX_DEVICE u32*)w;
  const u32 c_end = live ? (part + 1) * C / SPLIT : 0;
  // U chunks per lane per pass, every load of a pass issued before its FMAs (one memory round trip
  // per pass: a one-output SIMD group of the mHC mixes' fn walks 10 chunks a lane; UMAX: a source
  // whose loads take many registers); the FMAs keep the chunk order, so the sums are the same
  // operations in the same order whatever U.
  constexpr int U0 = (M * 8 + COLS * 8) <= 16 ? 8 : (M * 8 + COLS * 8) <= 40 ? 2 : 1;
  constexpr int U = U0 < UMAX ? U0 : UMAX;
  for (u32 c0 = part * C / SPLIT + lane; c0 < c_end; c0 += U * KX_SIMD_WIDTH) {
    typename XS::Raw raw[U][M];
    float xv[U][M][8];
    float wf[U][COLS][8];
    KX_UNROLL for (int u = 0; u < U; u++) {
      const u32 c = c0 + u * KX_SIMD_WIDTH;
      if (c >= c_end) break;
      for (int m = 0; m < M; m++) raw[u][m] = x.load8(m, c * 8);
      for (int j = 0; j < COLS; j++) {
        const u32 n = n0 + j < N ? n0 + j : N - 1;  // past the end: read the last row, write nothing
        if (W == 0) {
          KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8, wf[u][j]);
          KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8 + 4, wf[u][j] + 4);
        } else {
          u32 wv[4];
          KX_LOAD_U32X4(words + ((u64)n * K + c * 8) / 2, wv);
          for (int e = 0; e < 8; e++) {
            const u32 bits = (e & 1) ? (wv[e >> 1] >> 16) : (wv[e >> 1] & 0xFFFFu);
            wf[u][j][e] = W == 2 ? KX_BITS_F32(bits << 16) : KX_F16_BITS_TO_F32(bits);
          }
        }
      }
    }
    KX_UNROLL for (int u = 0; u < U; u++) {
      const u32 c = c0 + u * KX_SIMD_WIDTH;
      if (c >= c_end) break;
      for (int m = 0; m < M; m++) {
        const auto e8 = x.values8(raw[u][m], m, c * 8);
        for (int e = 0; e < 8; e++) xv[u][m][e] = e8.v[e];
      }
    }
    KX_UNROLL for (int u = 0; u < U; u++) {
      if (c0 + u * KX_SIMD_WIDTH >= c_end) break;
      for (int j = 0; j < COLS; j++)
        for (int e = 0; e < 8; e++)
          for (int m = 0; m < M; m++) acc.v[m][j] = KX_FMA(xv[u][m][e], wf[u][j][e], acc.v[m][j]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int j = 0; j < COLS; j++)
      for (u32 o = KX_SIMD_WIDTH / 2; o > 0; o >>= 1) acc.v[m][j] += KX_SHUFFLE_XOR(acc.v[m][j], o);
  return acc;
}

// y [M, N] as fp32_gemv stores it, through the output-sink contract: store(m, n, v) puts output n
// of row m. A launch that stores the outputs elsewhere passes its own sink (compressor_raw.h: the
// open group's rows and the raw ring), with the same sums.
struct Fp32Out {
  KX_DEVICE float* y;
  u32 N;
  KX_INLINE void store(u32 m, u32 n, float v) const { y[(u64)m * N + n] = v; }
};

// Threadgroup `group`'s SIMD groups' sums, stored through `out` (SPLIT > 1: each output's SPLIT
// part sums added in part order).
template <int M, int COLS, int SPLIT, int W, int UMAX = 8, typename XS, typename TW, typename YS>
KX_INLINE void fp32_gemv_group_into(XS x, const KX_DEVICE TW* w, YS out, u32 N, u32 K, KX_THREADGROUP float* sums,
                                    u32 group, u32 warp, u32 lane) {
  const u32 part = warp % SPLIT;
  const u32 n0 = (group * (8 / SPLIT) + warp / SPLIT) * COLS;
  const bool live = n0 < N;
  const Fp32Sums<M, COLS> acc = fp32_gemv_sums<M, COLS, SPLIT, W, UMAX>(x, w, N, K, n0, part, live, lane);
  if (SPLIT == 1) {
    if (live && lane == 0)
      for (int m = 0; m < M; m++)
        for (int j = 0; j < COLS; j++)
          if (n0 + j < N) out.store(m, n0 + j, acc.v[m][j]);
  } else {
    // The range sums of the threadgroup's SIMD groups, then the first group of each SPLIT adds its
    // outputs' SPLIT sums in range order.
    if (lane == 0)
      for (int m = 0; m < M; m++)
        for (int j = 0; j < COLS; j++) sums[(warp * M + m) * COLS + j] = acc.v[m][j];
    KX_BARRIER();
    if (live && part == 0 && lane < M * COLS) {
      const u32 m = lane / COLS, j = lane % COLS;
      float v = sums[(warp * M + m) * COLS + j];
      for (u32 s = 1; s < SPLIT; s++) v += sums[((warp + s) * M + m) * COLS + j];
      if (n0 + j < N) out.store(m, n0 + j, v);
    }
  }
}

// fp32_gemv_group_into y [M, N].
template <int M, int COLS, int SPLIT, int W, int UMAX = 8, typename XS, typename TW>
KX_INLINE void fp32_gemv_group(XS x, const KX_DEVICE TW* w, KX_DEVICE float* y, u32 N, u32 K,
                               KX_THREADGROUP float* sums, u32 group, u32 warp, u32 lane) {
  const Fp32Out out = {y, N};
  fp32_gemv_group_into<M, COLS, SPLIT, W, UMAX>(x, w, out, N, K, sums, group, warp, lane);
}

// Threadgroups of an fp32_gemv launch over N outputs.
template <int COLS, int SPLIT>
KX_INLINE u32 fp32_gemv_groups(u32 N) {
  return (N + COLS * (8 / SPLIT) - 1) / (COLS * (8 / SPLIT));
}
