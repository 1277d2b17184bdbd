// The EXL3 product y = x·W for a few rows, shared by exl3_gemv and the expert kernels
// (exl3 spec §3.3). A threadgroup owns 128 output columns: 8*WPC SIMD groups, group w decoding tile
// column w%8 over every WPC-th tile row of the threadgroup's k range. The input side
// xh = fp16(H128(fp16(x·suh))) is staged in threadgroup memory a chunk of 128-blocks at a time;
// each SIMD group multiplies its decoded tiles into float32 accumulators (tensor-core MMAs where
// KX_HAS_MMA_F16, per-lane FMAs elsewhere); the output side H128 and svh run after all of k.
// Needs exl3_decode.h.
#pragma once

#define EXL3_XS_WORDS 2048   // threadgroup words for xh: [M][EXL3_XS_WORDS / M] fp16 pairs
#define EXL3_XS_STRIDE(M) (EXL3_XS_WORDS / (M))
#define EXL3_CHUNK_BLOCKS(M) (EXL3_XS_WORDS / 64 / (M))  // 128-blocks of xh per chunk
#define EXL3_HAD_SCALE 0.08838834764831845f              // 1/sqrt(128), rounded to float

KX_INLINE float exl3_round_f16(float v) { return KX_F16_BITS_TO_F32(KX_F32_TO_F16_BITS(v)); }

// bfloat16 bits of v rounded to nearest, ties to even (NaN stays NaN).
KX_INLINE u32 exl3_bf16_bits(float v) {
  const u32 u = KX_F32_BITS(v);
  if (KX_ISNAN(v)) return (u >> 16) | 0x40u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

KX_INLINE float exl3_round_bf16(float v) { return KX_BITS_F32(exl3_bf16_bits(v) << 16); }

// out[i] = v for an output of float32 (OUT 0), fp16 (1) or bf16 (2) elements, rounded to nearest
// even. Written as bits so that no backend-specific 16-bit float conversion is involved.
template <int OUT, typename T>
KX_INLINE void exl3_store_out(KX_DEVICE T* out, u64 i, float v) {
  if (OUT == 0) {
    ((KX_DEVICE float*)out)[i] = v;
  } else {
    ((KX_DEVICE u16*)out)[i] = (u16)(OUT == 1 ? KX_F32_TO_F16_BITS(v) : exl3_bf16_bits(v));
  }
}

KX_INLINE u32 exl3_pack_f16(float lo, float hi) {
  return KX_F32_TO_F16_BITS(lo) | (KX_F32_TO_F16_BITS(hi) << 16);
}

// Elements 4*lane .. 4*lane+3 of a 128-block.
struct Exl3Vec4 {
  float v[4];
};

// Scaled H128 of a 128-block held 4 per lane: the 4-point butterfly in registers (element bits
// 0-1), then xor shuffles for element bits 2-6 (= lane bits 0-4), as exllamav3 does (spec §3.1).
KX_INLINE Exl3Vec4 exl3_hadamard128(Exl3Vec4 x, u32 lane) {
  const float a0 = x.v[0] + x.v[1], a1 = x.v[0] - x.v[1];
  const float a2 = x.v[2] + x.v[3], a3 = x.v[2] - x.v[3];
  x.v[0] = a0 + a2;
  x.v[1] = a1 + a3;
  x.v[2] = a0 - a2;
  x.v[3] = a1 - a3;
  for (u32 m = 1; m < 32; m <<= 1) {
    for (int i = 0; i < 4; i++) {
      const float p = KX_SHUFFLE_XOR(x.v[i], m);
      x.v[i] = (lane & m) ? p - x.v[i] : x.v[i] + p;
    }
  }
  for (int i = 0; i < 4; i++) x.v[i] *= EXL3_HAD_SCALE;
  return x;
}

// Round a lane's 4 values to fp16 and store them as 2 pairs of a staged xh row.
KX_INLINE void exl3_store_xh(KX_THREADGROUP u32* row, u32 block, Exl3Vec4 v, u32 lane) {
  row[block * 64 + 2 * lane] = exl3_pack_f16(v.v[0], v.v[1]);
  row[block * 64 + 2 * lane + 1] = exl3_pack_f16(v.v[2], v.v[3]);
}

// Stage xh for rows 0..M-1 of x [rows, in_features] (rows >= `rows` and columns >= in_features
// are zero: spec §1.1 zero-extension), 128-blocks kb0 .. kb0+nb-1. Spec §3.3 steps 1-2: x·suh is
// formed in float32 and rounded once to fp16 (exact products for fp16/bf16 x).
template <int M, typename XT, typename ST>
KX_INLINE void exl3_stage_input(KX_THREADGROUP u32* xs, const KX_DEVICE XT* x, const KX_DEVICE ST* suh,
                                u32 rows, u32 in_features, u32 kb0, u32 nb, u32 warp, u32 warps, u32 lane) {
  for (u32 q = warp; q < M * nb; q += warps) {
    const u32 r = q / nb, b = q % nb;
    const u32 k0 = (kb0 + b) * 128 + 4 * lane;
    Exl3Vec4 v;
    for (int i = 0; i < 4; i++) {
      const u32 k = k0 + i;
      const float xv = (r < rows && k < in_features) ? KX_TO_F32(x[r * in_features + k]) : 0.0f;
      v.v[i] = exl3_round_f16(xv * KX_TO_F32(suh[k]));
    }
    exl3_store_xh(xs + r * EXL3_XS_STRIDE(M), b, exl3_hadamard128(v, lane), lane);
  }
}

// One output owned by a lane after the product: (row, column within the tile column).
struct Exl3Out {
  u32 row, col;
  float v;
};

#if KX_HAS_MMA_F16
// MMA accumulators: the C fragments of the two n-halves; lane (g = lane/4, c = lane%4) holds row g,
// columns 2c, 2c+1 (+8 for the second half). Rows g+8 of the 16-row MMA are unused (M <= 8).
template <int M>
struct Exl3Acc {
  float c[2][4];
};

template <int M>
KX_INLINE Exl3Acc<M> exl3_acc_zero() {
  Exl3Acc<M> acc;
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 4; i++) acc.c[h][i] = 0.0f;
  return acc;
}

// acc += xh[:, tile row lt] · tile. A fragment: row g, k columns 2c, 2c+1 and 2c+8, 2c+9.
template <int M>
KX_INLINE Exl3Acc<M> exl3_acc_tile(Exl3Acc<M> acc, Exl3Frag f, const KX_THREADGROUP u32* xs, u32 lt, u32 lane) {
  const u32 g = lane >> 2, c = lane & 3u;
  const u32 a_lo = (g < M) ? xs[g * EXL3_XS_STRIDE(M) + lt * 8 + c] : 0u;
  const u32 a_hi = (g < M) ? xs[g * EXL3_XS_STRIDE(M) + lt * 8 + c + 4] : 0u;
  KX_MMA_F16_F32(acc.c[0], a_lo, 0u, a_hi, 0u, f.h[0], f.h[1]);
  KX_MMA_F16_F32(acc.c[1], a_lo, 0u, a_hi, 0u, f.h[2], f.h[3]);
  return acc;
}

template <int M>
KX_INLINE Exl3Acc<M> exl3_acc_finish(Exl3Acc<M> acc, u32 lane) {
  return acc;
}

template <int M>
KX_INLINE Exl3Out exl3_acc_out(Exl3Acc<M> acc, int i, u32 lane) {
  Exl3Out o;
  o.row = lane >> 2;
  o.col = 8 * (i >> 1) + 2 * (lane & 3u) + (i & 1);
  o.v = acc.c[i >> 1][i & 1];
  return o;
}
#else
// Per-lane accumulators: lane (g = lane/4, c = lane%4) sums its 4 rows of the tile into columns
// g and g+8 for each row of x; exl3_acc_finish adds the 4 lanes of a column.
template <int M>
struct Exl3Acc {
  float a[M][2];
};

template <int M>
KX_INLINE Exl3Acc<M> exl3_acc_zero() {
  Exl3Acc<M> acc;
  for (int r = 0; r < M; r++) acc.a[r][0] = acc.a[r][1] = 0.0f;
  return acc;
}

template <int M>
KX_INLINE Exl3Acc<M> exl3_acc_tile(Exl3Acc<M> acc, Exl3Frag f, const KX_THREADGROUP u32* xs, u32 lt, u32 lane) {
  const u32 c = lane & 3u;
  float w[8];
  for (int i = 0; i < 4; i++) {
    w[2 * i] = KX_F16_BITS_TO_F32(f.h[i] & 0xFFFFu);
    w[2 * i + 1] = KX_F16_BITS_TO_F32(f.h[i] >> 16);
  }
  for (int r = 0; r < M; r++) {
    const u32 p = xs[r * EXL3_XS_STRIDE(M) + lt * 8 + c];      // k rows 2c, 2c+1
    const u32 q = xs[r * EXL3_XS_STRIDE(M) + lt * 8 + c + 4];  // k rows 2c+8, 2c+9
    const float x0 = KX_F16_BITS_TO_F32(p & 0xFFFFu), x1 = KX_F16_BITS_TO_F32(p >> 16);
    const float x8 = KX_F16_BITS_TO_F32(q & 0xFFFFu), x9 = KX_F16_BITS_TO_F32(q >> 16);
    for (int h = 0; h < 2; h++) {
      float s = acc.a[r][h];
      s = KX_FMA(w[4 * h], x0, s);
      s = KX_FMA(w[4 * h + 1], x1, s);
      s = KX_FMA(w[4 * h + 2], x8, s);
      s = KX_FMA(w[4 * h + 3], x9, s);
      acc.a[r][h] = s;
    }
  }
  return acc;
}

template <int M>
KX_INLINE Exl3Acc<M> exl3_acc_finish(Exl3Acc<M> acc, u32 lane) {
  for (int r = 0; r < M; r++)
    for (int h = 0; h < 2; h++) {
      acc.a[r][h] += KX_SHUFFLE_XOR(acc.a[r][h], 1);
      acc.a[r][h] += KX_SHUFFLE_XOR(acc.a[r][h], 2);
    }
  return acc;
}

// After the finish every lane of a column holds all rows; lane c keeps rows c and c+4.
template <int M>
KX_INLINE Exl3Out exl3_acc_out(Exl3Acc<M> acc, int i, u32 lane) {
  Exl3Out o;
  o.row = (lane & 3u) + 4u * (i >> 1);
  o.col = (lane >> 2) + 8u * (i & 1);
  o.v = 0.0f;
  for (int r = 0; r < M; r++)
    if ((u32)r == o.row) o.v = acc.a[r][i & 1];
  return o;
}
#endif

// Multiply one SIMD group's tile rows lt = kgroup, kgroup+WPC, ... < n_lt of the staged chunk into
// acc. `tiles` points at the chunk's first tile of this column; tile rows are row_words apart.
// n_lt covers whole 128-blocks (a multiple of 8), so every group has a multiple of 8/WPC tiles: the
// loads of 8/WPC tiles are issued before any of them is decoded, with no remainder (WPC is 1 or 2).
template <int K2, int CB, int M, int WPC>
KX_INLINE Exl3Acc<M> exl3_tile_column(Exl3Acc<M> acc, const KX_DEVICE u32* tiles, u32 row_words,
                                      const KX_THREADGROUP u32* xs, u32 n_lt, u32 kgroup, Exl3Lane l, u32 lane) {
  const int U = 8 / WPC;
  u32 offset = kgroup * row_words;
  for (u32 lt = kgroup; lt < n_lt; lt += 8) {
    Exl3Words words[8 / WPC];
    for (int u = 0; u < U; u++) words[u] = exl3_load<K2>(tiles + offset + u * WPC * row_words, l);
    offset += 8 * row_words;
    for (int u = 0; u < U; u++) acc = exl3_acc_tile<M>(acc, exl3_decode<K2, CB>(words[u], l), xs, lt + u * WPC, lane);
  }
  return acc;
}

// Store a SIMD group's finished accumulators into ys [WPC][M][128] (its k group, its 16 columns).
template <int M>
KX_INLINE void exl3_store_acc(KX_THREADGROUP float* ys, Exl3Acc<M> acc, u32 kgroup, u32 col0, u32 lane) {
  for (int i = 0; i < 4; i++) {
    const Exl3Out o = exl3_acc_out<M>(acc, i, lane);
    if (o.row < (u32)M) ys[(kgroup * M + o.row) * 128 + col0 + o.col] = o.v;
  }
}

// Row r of ys summed over the k groups in order, as a lane's 4 elements.
template <int M, int WPC>
KX_INLINE Exl3Vec4 exl3_ys_row(const KX_THREADGROUP float* ys, u32 r, u32 lane) {
  Exl3Vec4 v;
  for (int i = 0; i < 4; i++) {
    float s = ys[r * 128 + 4 * lane + i];
    for (int g = 1; g < WPC; g++) s += ys[(g * M + r) * 128 + 4 * lane + i];
    v.v[i] = s;
  }
  return v;
}
