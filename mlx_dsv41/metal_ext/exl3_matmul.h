// The EXL3 product y = x·W for a few rows, shared by exl3_gemv and the expert kernels
// (docs/exl3.md#forward). Needs exl3_decode.h.
//
// A threadgroup owns 128 output columns (8 tile columns) and a range of nb 128-blocks of k. Its NW
// SIMD groups are 8/NC column groups of NC adjacent tile columns x KG = NW*NC/8 k groups:
// - trellis: the threadgroup's blocks (8 tile rows x its 8 tile columns; a tile row's 8 tiles are
//   contiguous, docs/exl3.md#tiles) stream through a ring of STAGES threadgroup buffers by
// asynchronous
//   16-byte copies, STAGES-1 blocks ahead of the decoding (no registers held while in flight;
//   CUDA). Without asynchronous copies (Metal) the SIMD groups read their tiles from device memory;
// - input: xh = fp16(H128(fp16(x·suh))) (or the experts' SwiGLU input) is staged in threadgroup
//   memory by a stager (XSW words: [M][XSW / M] fp16 pairs), a chunk of EXL3_XS_BLOCKS(XSW, M)
//   blocks at a time;
// - product: SIMD group (cg, kg) decodes tile rows kg, kg+KG, ... of every block for its NC tile
//   columns. On CUDA a decoded tile is the A operand (16 columns x 16 k) of one mma.m16n8k16 whose
//   B operand is xh^T (16 k x 8 rows): the product y^T accumulates in float32, no MMA row idle for
//   M = 8. Without MMA (Metal) the same fragments go through per-lane FMAs.
// - The KG k groups' sums of a column are added in k-group order through threadgroup memory (ys,
//   which reuses the trellis ring); the caller applies the output side (H128, svh).
#pragma once

#define EXL3_XS_STRIDE(XSW, M) ((XSW) / (M))      // words per staged xh row
#define EXL3_XS_BLOCKS(XSW, M) ((XSW) / 64 / (M))  // 128-blocks of xh per chunk
#define EXL3_BLOCK_WORDS(K2) (256 * (K2))          // a block: 8 x 8 tiles of 4*K2 words
#define EXL3_KG(NW, NC) ((NW) * (NC) / 8)
#define EXL3_MAX_WORDS(A, B) ((A) > (B) ? (A) : (B))
// Threadgroup words of the trellis ring (none without asynchronous copies), reused for ys
// [KG][M][128] floats after the product.
#define EXL3_YS_WORDS(NW, NC, M) (EXL3_KG(NW, NC) * (M) * 128)
#if KX_HAS_ASYNC_COPY
#define EXL3_RING_WORDS(K2, STAGES, NW, NC, M)                                                       \
  ((STAGES) * EXL3_BLOCK_WORDS(K2) > EXL3_YS_WORDS(NW, NC, M) ? (STAGES) * EXL3_BLOCK_WORDS(K2) \
                                                               : EXL3_YS_WORDS(NW, NC, M))
#else
#define EXL3_RING_WORDS(K2, STAGES, NW, NC, M) EXL3_YS_WORDS(NW, NC, M)
#endif
#define EXL3_HAD_SCALE 0.08838834764831845f  // 1/sqrt(128), rounded to float

KX_INLINE float exl3_round_f16(float v) { return KX_F16_BITS_TO_F32(KX_F32_TO_F16_BITS(v)); }

KX_INLINE float exl3_round_bf16(float v) { return KX_BITS_F32(kx_bf16_bits(v) << 16); }  // float_bits.h

// out[i] = v for an output of float32 (OUT 0), fp16 (1) or bf16 (2) elements, rounded to nearest
// even. Written as bits so that no backend-specific 16-bit float conversion is involved.
template <int OUT, typename T>
KX_INLINE void exl3_store_out(KX_DEVICE T* out, u64 i, float v) {
  if (OUT == 0) {
    ((KX_DEVICE float*)out)[i] = v;
  } else {
    ((KX_DEVICE u16*)out)[i] = (u16)(OUT == 1 ? KX_F32_TO_F16_BITS(v) : kx_bf16_bits(v));
  }
}

// The value exl3_store_out<OUT> stores for v, read back in fp32 (v rounded to the output dtype).
template <int OUT>
KX_INLINE float exl3_out_value(float v) {
  if (OUT == 0) return v;
  return OUT == 1 ? KX_F16_BITS_TO_F32(KX_F32_TO_F16_BITS(v)) : KX_BITS_F32(kx_bf16_bits(v) << 16);
}

KX_INLINE u32 exl3_pack_f16(float lo, float hi) {
  return KX_F32_TO_F16_BITS(lo) | (KX_F32_TO_F16_BITS(hi) << 16);
}

// Elements 4*lane .. 4*lane+3 of a 128-block.
struct Exl3Vec4 {
  float v[4];
};

// The 4 floats at p (16-byte aligned), e.g. a lane's elements 4*lane .. +3 of a 128-block.
KX_INLINE Exl3Vec4 exl3_load4(const KX_DEVICE float* p) {
  Exl3Vec4 v;
  KX_LOAD_F32X4(p, v.v);
  return v;
}

// A lane's 4 elements of S k-split partials (split q at p + q*stride), loaded together before any
// is used (the small finishing kernels are latency-bound: one round trip for all of them), through
// L2: in a launch that finishes itself, other threadgroups of the launch wrote them. At most
// EXL3_SPLIT_CHUNK are held at once: the first chunk here, the rest chunk by chunk as they are
// added (`wo_a`'s 8 groups split k 32 ways; holding every split would take 4 registers a split
// from the whole kernel, the product loop's occupancy with them).
#define EXL3_SPLIT_CHUNK 8
template <int S>
struct Exl3Splits {
  Exl3Vec4 v[S < EXL3_SPLIT_CHUNK ? S : EXL3_SPLIT_CHUNK];
  const KX_DEVICE float* rest;  // split EXL3_SPLIT_CHUNK's 4 elements, later ones `stride` apart
  u64 stride;
};

template <int S>
KX_INLINE Exl3Splits<S> exl3_load_splits(const KX_DEVICE float* p, u64 stride) {
  Exl3Splits<S> t;
  KX_UNROLL
  for (int q = 0; q < S && q < EXL3_SPLIT_CHUNK; q++) KX_LOAD_F32X4_CG(p + q * stride, t.v[q].v);
  t.rest = p + EXL3_SPLIT_CHUNK * stride;
  t.stride = stride;
  return t;
}

// The partials added in split order (the later chunks loaded a chunk at a time, each chunk's loads
// together; the sums are the same operations in the same order whatever the chunking).
template <int S>
KX_INLINE Exl3Vec4 exl3_sum_splits(Exl3Splits<S> t) {
  Exl3Vec4 s = t.v[0];
  KX_UNROLL
  for (int q = 1; q < S && q < EXL3_SPLIT_CHUNK; q++)
    for (int i = 0; i < 4; i++) s.v[i] += t.v[q].v[i];
  KX_NO_UNROLL
  for (int c = EXL3_SPLIT_CHUNK; c < S; c += EXL3_SPLIT_CHUNK) {
    Exl3Vec4 w[EXL3_SPLIT_CHUNK];
    const KX_DEVICE float* p = t.rest + (u64)(c - EXL3_SPLIT_CHUNK) * t.stride;
    KX_UNROLL
    for (int q = 0; q < EXL3_SPLIT_CHUNK; q++)
      if (c + q < S) KX_LOAD_F32X4_CG(p + q * t.stride, w[q].v);
    KX_UNROLL
    for (int q = 0; q < EXL3_SPLIT_CHUNK; q++)
      if (c + q < S)
        for (int i = 0; i < 4; i++) s.v[i] += w[q].v[i];
  }
  return s;
}

// Scaled H128 of a 128-block held 4 per lane: the 4-point butterfly in registers (element bits
// 0-1), then xor shuffles for element bits 2-6 (= lane bits 0-4), as exllamav3 does
// (docs/exl3.md#hadamard). A stage is one fma per element: p + (+-1)·x is exactly x + p or p - x.
KX_INLINE Exl3Vec4 exl3_hadamard128(Exl3Vec4 x, u32 lane) {
  const float a0 = x.v[0] + x.v[1], a1 = x.v[0] - x.v[1];
  const float a2 = x.v[2] + x.v[3], a3 = x.v[2] - x.v[3];
  x.v[0] = a0 + a2;
  x.v[1] = a1 + a3;
  x.v[2] = a0 - a2;
  x.v[3] = a1 - a3;
  for (u32 m = 1; m < 32; m <<= 1) {
    const float sign = (lane & m) ? -1.0f : 1.0f;
    for (int i = 0; i < 4; i++) x.v[i] = KX_FMA(sign, x.v[i], KX_SHUFFLE_XOR(x.v[i], m));
  }
  for (int i = 0; i < 4; i++) x.v[i] *= EXL3_HAD_SCALE;
  return x;
}

// Round a lane's 4 values (elements 4*lane..+3 of block `block`) to fp16 and store them in a
// staged xh row. Within each 16-element tile row the fp16 pairs are stored in the order
// (0, 4, 1, 5, 2, 6, 3, 7), so that the two pairs a lane's MMA fragment needs (k = 2c, 2c+1 and
// 2c+8, 2c+9) are adjacent words.
// `row` is threadgroup memory (a stager) or device memory (exl3_expert_swiglu).
template <typename P>
KX_INLINE void exl3_store_xh(P row, u32 block, Exl3Vec4 v, u32 lane) {
  const u32 q = lane & 3u, base = block * 64 + (lane >> 2) * 8;
  const u32 p0 = (q < 2) ? 4 * q : 4 * q - 7;  // pair 2q of the tile row
  row[base + p0] = exl3_pack_f16(v.v[0], v.v[1]);
  row[base + p0 + 2] = exl3_pack_f16(v.v[2], v.v[3]);  // pair 2q + 1
}

// The input side of a linear: xh = fp16(H128(fp16(x·suh))) for rows 0..M-1 of x [rows,
// in_features] (rows >= `rows` and columns >= in_features are zero: docs/exl3.md#padding
// zero-extension); x·suh is formed in float32 and rounded once to fp16 (exact products for
// fp16/bf16 x).
template <int M, int XSW, typename XT, typename ST>
struct Exl3InputStager {
  const KX_DEVICE XT* x;
  const KX_DEVICE ST* suh;
  u32 rows, in_features, kb_begin;

  // xh of 128-blocks kb_begin + b0 .. + nb - 1 into xs, spread over the threadgroup's SIMD groups.
  KX_INLINE void stage(KX_THREADGROUP u32* xs, u32 b0, u32 nb, u32 warp, u32 warps, u32 lane) const {
    for (u32 q = warp; q < M * nb; q += warps) {
      const u32 r = q / nb, b = q % nb;
      const u32 k0 = (kb_begin + b0 + b) * 128 + 4 * lane;
      Exl3Vec4 v;
      for (int i = 0; i < 4; i++) {
        const u32 k = k0 + i;
        const float xv = (r < rows && k < in_features) ? KX_TO_F32(x[r * in_features + k]) : 0.0f;
        v.v[i] = exl3_round_f16(xv * KX_TO_F32(suh[k]));
      }
      exl3_store_xh(xs + r * EXL3_XS_STRIDE(XSW, M), b, exl3_hadamard128(v, lane), lane);
    }
  }
};

template <int M, int XSW, typename XT, typename ST>
KX_INLINE Exl3InputStager<M, XSW, XT, ST> exl3_input_stager(const KX_DEVICE XT* x, const KX_DEVICE ST* suh,
                                                            u32 rows, u32 in_features, u32 kb_begin) {
  const Exl3InputStager<M, XSW, XT, ST> s = {x, suh, rows, in_features, kb_begin};
  return s;
}

// The input side when xh is already formed in device memory (exl3_expert_swiglu's output, in the
// staged word order): 128-blocks kb_begin + b0 .. + nb - 1 of the row, 64 words each, copied.
struct Exl3CopyStager {
  const KX_DEVICE u32* xh;
  u32 kb_begin;

  KX_INLINE void stage(KX_THREADGROUP u32* xs, u32 b0, u32 nb, u32 warp, u32 warps, u32 lane) const {
    const KX_DEVICE u32* src = xh + (u64)(kb_begin + b0) * 64;
    for (u32 i = warp * 32 + lane; i < nb * 64; i += warps * 32) xs[i] = src[i];
  }
};

KX_INLINE Exl3CopyStager exl3_copy_stager(const KX_DEVICE u32* xh, u32 kb_begin) {
  const Exl3CopyStager s = {xh, kb_begin};
  return s;
}

// One output owned by a lane after the product: (row, column within the threadgroup's 128).
struct Exl3Out {
  u32 row, col;
  float v;
};

#if KX_HAS_MMA_F16
// xh^T as the MMA B operand for one tile row: lane (g, c) holds xh[g][2c, 2c+1] and
// xh[g][2c+8, 2c+9] of the tile row, the two words at p (rows g >= M read row g % M: they only
// feed outputs that are dropped).
template <int M>
struct Exl3X {
  u32 lo, hi;
};

// Where lane's words sit in a staged tile row.
template <int M, int XSW>
KX_INLINE u32 exl3_x_offset(u32 lane) {
  return ((lane >> 2) & (M - 1)) * EXL3_XS_STRIDE(XSW, M) + 2 * (lane & 3u);
}

template <int M, int XSW>
KX_INLINE Exl3X<M> exl3_x(const KX_THREADGROUP u32* p) {
  Exl3X<M> x;
  x.lo = p[0];
  x.hi = p[1];
  return x;
}

// Accumulators: the C fragment of y^T (16 columns x 8 rows) per tile column: lane (g, c) holds
// columns g, g+8 of rows 2c, 2c+1.
template <int M, int NC>
struct Exl3Acc {
  float c[NC][4];
};

template <int M, int NC>
KX_INLINE Exl3Acc<M, NC> exl3_acc_zero() {
  Exl3Acc<M, NC> acc;
  for (int t = 0; t < NC; t++)
    for (int i = 0; i < 4; i++) acc.c[t][i] = 0.0f;
  return acc;
}

// acc[t] += tile^T · xh^T: the tile's A fragment is the decoded pairs in the order h0, h2, h1, h3.
template <int M, int NC>
KX_INLINE Exl3Acc<M, NC> exl3_acc_tile(Exl3Acc<M, NC> acc, int t, Exl3Frag f, Exl3X<M> x) {
  KX_MMA_F16_F32(acc.c[t], f.h[0], f.h[2], f.h[1], f.h[3], x.lo, x.hi);
  return acc;
}

template <int M, int NC>
KX_INLINE Exl3Acc<M, NC> exl3_acc_finish(Exl3Acc<M, NC> acc) {
  return acc;
}

template <int M, int NC>
KX_INLINE Exl3Out exl3_acc_out(Exl3Acc<M, NC> acc, int t, int i, u32 lane) {
  Exl3Out o;
  o.row = 2 * (lane & 3u) + (i & 1);
  o.col = 16 * t + (lane >> 2) + 8 * (i >> 1);
  o.v = acc.c[t][i];
  return o;
}
#else
// Per-lane FMAs: lane (g, c) multiplies its tile rows 2c, 2c+1, 2c+8, 2c+9 of columns g, g+8 with
// every row of xh; exl3_acc_finish adds the 4 lanes of a column.
template <int M>
struct Exl3X {
  u32 lo[M], hi[M];
};

// Where lane's words of xh row 0 sit in a staged tile row (rows are EXL3_XS_STRIDE apart).
template <int M, int XSW>
KX_INLINE u32 exl3_x_offset(u32 lane) {
  return 2 * (lane & 3u);
}

template <int M, int XSW>
KX_INLINE Exl3X<M> exl3_x(const KX_THREADGROUP u32* p) {
  Exl3X<M> x;
  for (int r = 0; r < M; r++) {
    x.lo[r] = p[r * EXL3_XS_STRIDE(XSW, M)];
    x.hi[r] = p[r * EXL3_XS_STRIDE(XSW, M) + 1];
  }
  return x;
}

template <int M, int NC>
struct Exl3Acc {
  float a[NC][M][2];
};

template <int M, int NC>
KX_INLINE Exl3Acc<M, NC> exl3_acc_zero() {
  Exl3Acc<M, NC> acc;
  for (int t = 0; t < NC; t++)
    for (int r = 0; r < M; r++) acc.a[t][r][0] = acc.a[t][r][1] = 0.0f;
  return acc;
}

template <int M, int NC>
KX_INLINE Exl3Acc<M, NC> exl3_acc_tile(Exl3Acc<M, NC> acc, int t, Exl3Frag f, Exl3X<M> x) {
  float w[8];
  for (int i = 0; i < 4; i++) {
    w[2 * i] = KX_F16_BITS_TO_F32(f.h[i] & 0xFFFFu);
    w[2 * i + 1] = KX_F16_BITS_TO_F32(f.h[i] >> 16);
  }
  for (int r = 0; r < M; r++) {
    const float x0 = KX_F16_BITS_TO_F32(x.lo[r] & 0xFFFFu), x1 = KX_F16_BITS_TO_F32(x.lo[r] >> 16);  // k 2c, 2c+1
    const float x8 = KX_F16_BITS_TO_F32(x.hi[r] & 0xFFFFu), x9 = KX_F16_BITS_TO_F32(x.hi[r] >> 16);  // k 2c+8, +9
    for (int h = 0; h < 2; h++) {  // columns g, g+8
      float s = acc.a[t][r][h];
      s = KX_FMA(w[4 * h], x0, s);
      s = KX_FMA(w[4 * h + 1], x1, s);
      s = KX_FMA(w[4 * h + 2], x8, s);
      s = KX_FMA(w[4 * h + 3], x9, s);
      acc.a[t][r][h] = s;
    }
  }
  return acc;
}

template <int M, int NC>
KX_INLINE Exl3Acc<M, NC> exl3_acc_finish(Exl3Acc<M, NC> acc) {
  for (int t = 0; t < NC; t++)
    for (int r = 0; r < M; r++)
      for (int h = 0; h < 2; h++) {
        acc.a[t][r][h] += KX_SHUFFLE_XOR(acc.a[t][r][h], 1);
        acc.a[t][r][h] += KX_SHUFFLE_XOR(acc.a[t][r][h], 2);
      }
  return acc;
}

// After the finish every lane of a column holds all rows; lane c keeps rows c and c+4.
template <int M, int NC>
KX_INLINE Exl3Out exl3_acc_out(Exl3Acc<M, NC> acc, int t, int i, u32 lane) {
  Exl3Out o;
  o.row = (lane & 3u) + 4u * (i >> 1);
  o.col = 16 * t + (lane >> 2) + 8u * (i & 1);
  o.v = 0.0f;
  for (int r = 0; r < M; r++)
    if ((u32)r == o.row) o.v = acc.a[t][r][i & 1];
  return o;
}
#endif

#if KX_HAS_ASYNC_COPY
// A thread's share of the asynchronous copies of consecutive blocks: a block's 64*K2 16-byte
// pieces (8 tile rows of 8*K2; tile row r at r*row_words words in the trellis, at 32*K2*r in the
// ring) are dealt out round-robin, piece q to thread q % (NW*32). The thread keeps one source
// pointer per piece and moves them to the next block after each copy.
#define EXL3_PIECES(K2, NW) ((64 * (K2) + 32 * (NW) - 1) / (32 * (NW)))

template <int K2, int NW>
struct Exl3BlockCopy {
  const KX_DEVICE u32* src[EXL3_PIECES(K2, NW)];
  u32 tid, block_step;

  // Start copying the next block into the ring buffer at word `dst` of `ring`.
  KX_INLINE void issue(KX_THREADGROUP u32* ring, u32 dst) const {
    const int full = 64 * K2 / (NW * 32), rem = 64 * K2 % (NW * 32);
    KX_UNROLL
    for (int i = 0; i < EXL3_PIECES(K2, NW); i++)
      if (i < full || tid < (u32)rem) KX_ASYNC_COPY16(ring, dst + 4 * (tid + i * NW * 32), src[i]);
  }

  KX_INLINE void advance() {
    KX_UNROLL
    for (int i = 0; i < EXL3_PIECES(K2, NW); i++) src[i] += block_step;
  }
};

template <int K2, int NW>
KX_INLINE Exl3BlockCopy<K2, NW> exl3_block_copy(const KX_DEVICE u32* src, u32 row_words, u32 tid) {
  Exl3BlockCopy<K2, NW> c;
  c.tid = tid;
  c.block_step = 8 * row_words;
  KX_UNROLL
  for (int i = 0; i < EXL3_PIECES(K2, NW); i++) {
    const u32 q = tid + i * NW * 32, r = q / (8 * K2);
    c.src[i] = src + (u64)r * row_words + 4 * (q - r * 8 * K2);
  }
  return c;
}
#endif

// One block's products for a SIMD group: tile rows kg + KG*j (j < 8/KG) of its NC tile columns.
// `tiles` points at the group's first tile (tile row kg, tile column cg*NC), tile rows `stride`
// words apart (in the ring or in device memory); `l` holds the lane's word indices from it; `xb`
// points at the lane's xh pair of tile row kg.
template <int K2, int CB, int M, int NC, int KG, int XSW, typename P>
KX_INLINE Exl3Acc<M, NC> exl3_block_product(Exl3Acc<M, NC> acc, P tiles, u32 stride, Exl3Lane l,
                                            const KX_THREADGROUP u32* xb) {
  KX_UNROLL
  for (int j = 0; j < 8 / KG; j++) {
    const Exl3X<M> x = exl3_x<M, XSW>(xb + j * KG * 8);
    KX_UNROLL
    for (int t = 0; t < NC; t++) {
      const Exl3Words w = exl3_load<K2>(tiles + j * KG * stride + t * 4 * K2, l);
      acc = exl3_acc_tile<M, NC>(acc, t, exl3_decode<K2, CB>(w, l.shift), x);
    }
  }
  return acc;
}

// The threadgroup's product over nb blocks: `src` points at the first tile of its 8 tile columns in
// its first block, tile rows row_words apart; `stager.stage` fills xh (see Exl3InputStager).
// `ring` has EXL3_RING_WORDS words, `xs` XSW. Returns this SIMD group's finished accumulators for
// tile columns cg*NC .. cg*NC + NC - 1 over its k group's tile rows.
// With asynchronous copies the blocks stream through the ring; without (Metal), each SIMD group
// reads its tiles from device memory.
// MAXB (a constant) bounds nb: when one chunk of xh holds MAXB blocks, xh is staged once before
// the block loop and the loop has no staging branch (fewer registers, a shorter loop).
template <int K2, int CB, int M, int NC, int NW, int STAGES, int XSW, int MAXB, typename Stager>
KX_INLINE Exl3Acc<M, NC> exl3_product(const KX_DEVICE u32* src, u32 row_words, u32 nb, Stager stager,
                                      KX_THREADGROUP u32* ring, KX_THREADGROUP u32* xs, u32 warp, u32 lane) {
  const int KG = EXL3_KG(NW, NC), XB = EXL3_XS_BLOCKS(XSW, M);
  const bool one_chunk = MAXB <= XB;
  const u32 cg = warp % (8 / NC), kg = warp / (8 / NC);
  Exl3Acc<M, NC> acc = exl3_acc_zero<M, NC>();
  // The lane's xh pair of tile row kg in the current block of xh, advanced block by block.
  u32 xo = kg * 8 + exl3_x_offset<M, XSW>(lane);
  Exl3Lane l = exl3_lane<K2>(lane);
#if KX_HAS_ASYNC_COPY
  const int BW = EXL3_BLOCK_WORDS(K2);
  Exl3BlockCopy<K2, NW> copy = exl3_block_copy<K2, NW>(src, row_words, warp * 32 + lane);
  KX_UNROLL
  for (int s = 0; s < STAGES - 1; s++) {
    if ((u32)s < nb) copy.issue(ring, s * BW);
    copy.advance();
    KX_ASYNC_COMMIT();
  }
  // The lane's words of its first tile as indices from `ring` into the current buffer, advanced
  // block by block (rather than recomputed from the lane, which the compiler would otherwise do
  // in every block).
  const u32 first = kg * 32 * K2 + cg * NC * 4 * K2;
  l.w0 += first;
  l.w1 += first;
  l.w2 += first;
#else
  const KX_DEVICE u32* tiles = src + (u64)kg * row_words + cg * NC * 4 * K2;
#endif
  if (one_chunk) {
    stager.stage(xs, 0, nb, warp, NW, lane);
#if !KX_HAS_ASYNC_COPY
    KX_BARRIER();
#endif
  }
  // Two blocks per loop trip: the loop's own work (barrier, copy issue, ring indices) is shared
  // by 16 tiles instead of 8 (sass_exl3.py: down 52.4 -> 48.6 instructions per tile).
  KX_UNROLL_2
  for (u32 b = 0; b < nb; b++) {
    if (!one_chunk && b % XB == 0) {
      if (b > 0) KX_BARRIER();  // every SIMD group is done with the previous chunk of xh
      stager.stage(xs, b, min((u32)XB, nb - b), warp, NW, lane);
      if (b > 0) xo -= XB * 64;
#if !KX_HAS_ASYNC_COPY
      KX_BARRIER();
#endif
    }
#if KX_HAS_ASYNC_COPY
    KX_ASYNC_WAIT(STAGES - 2);  // this thread's pieces of block b have landed
    KX_BARRIER();               // ... everyone's; block b - 1's buffer is free; xh is staged
    if (b + STAGES - 1 < nb) copy.issue(ring, ((b + STAGES - 1) % STAGES) * BW);
    copy.advance();
    KX_ASYNC_COMMIT();
    acc = exl3_block_product<K2, CB, M, NC, KG, XSW>(acc, (const KX_THREADGROUP u32*)ring, 32 * K2, l, xs + xo);
    const u32 step = (b % STAGES == STAGES - 1) ? 0u - (STAGES - 1) * BW : (u32)BW;  // the next buffer
    l.w0 += step;
    l.w1 += step;
    l.w2 += step;
#else
    acc = exl3_block_product<K2, CB, M, NC, KG, XSW>(acc, tiles, row_words, l, xs + xo);
    tiles += 8 * (u64)row_words;
#endif
    xo += 64;
  }
  return exl3_acc_finish<M, NC>(acc);
}

// Store a SIMD group's accumulators into ys [KG][M][128] (after a barrier: ys reuses the ring).
template <int M, int NC, int NW>
KX_INLINE void exl3_store_acc(KX_THREADGROUP float* ys, Exl3Acc<M, NC> acc, u32 warp, u32 lane) {
  const u32 cg = warp % (8 / NC), kg = warp / (8 / NC);
  for (int t = 0; t < NC; t++)
    for (int i = 0; i < 4; i++) {
      const Exl3Out o = exl3_acc_out<M, NC>(acc, t, i, lane);
      if (o.row < (u32)M) ys[(kg * M + o.row) * 128 + cg * NC * 16 + o.col] = o.v;
    }
}

// After exl3_product: every SIMD group's accumulators in ys [KG][M][128], which reuses the trellis
// ring (hence the barrier before); on return the whole threadgroup may read ys.
template <int M, int NC, int NW>
KX_INLINE const KX_THREADGROUP float* exl3_gather_acc(Exl3Acc<M, NC> acc, KX_THREADGROUP u32* ring, u32 warp,
                                                     u32 lane) {
  KX_BARRIER();
  KX_THREADGROUP float* ys = (KX_THREADGROUP float*)ring;
  exl3_store_acc<M, NC, NW>(ys, acc, warp, lane);
  KX_BARRIER();
  return ys;
}

// Column j of row r summed over the k groups in order.
template <int M, int KG>
KX_INLINE float exl3_ys_sum(const KX_THREADGROUP float* ys, u32 r, u32 j) {
  float s = ys[r * 128 + j];
  for (int g = 1; g < KG; g++) s += ys[(g * M + r) * 128 + j];
  return s;
}

// Row r of ys summed over the k groups, as a lane's 4 elements.
template <int M, int KG>
KX_INLINE Exl3Vec4 exl3_ys_row(const KX_THREADGROUP float* ys, u32 r, u32 lane) {
  Exl3Vec4 v;
  for (int i = 0; i < 4; i++) v.v[i] = exl3_ys_sum<M, KG>(ys, r, 4 * lane + i);
  return v;
}

// exl3_gemv_out's work for one row (docs/exl3.md#forward steps 4-6): the k-split partials
// [splits, rows, pn] added (SIMD group w adds splits w, w + 8, ... with all their loads independent;
// group 0 adds the 8 sums in group order), then H128, svh and the bias -> out [rows, n] (OUT as
// exl3_store_out). partial points at the linear's first column (a paired exl3_gemv's partials hold
// both linears' columns in rows of pn; otherwise pn = n). 8 SIMD groups; sums: 8 x 128 floats of
// threadgroup memory, reusable on return. Shared by exl3_gemv_out and exl3_gemv's FINISH, so both
// give the same bytes; the partials are read through L2 (another threadgroup of the launch may have
// written them).
template <int OUT, bool HAS_BIAS, typename TS, typename TB, typename TO>
KX_INLINE void exl3_finish_row(const KX_DEVICE float* partial, u32 pn, const KX_DEVICE TS* svh,
                               const KX_DEVICE TB* bias, KX_DEVICE TO* out, KX_THREADGROUP float* sums, u32 splits,
                               u32 rows, u32 n, u32 row, u32 col_block, u32 warp, u32 lane) {
  const u32 c0 = col_block * 128 + 4 * lane;
  Exl3Vec4 s;
  for (int i = 0; i < 4; i++) s.v[i] = 0.0f;
  for (u32 p = warp; p < splits; p += 8)
    for (int i = 0; i < 4; i++) s.v[i] += KX_LOAD_CG(partial + ((u64)p * rows + row) * pn + c0 + i);
  for (int i = 0; i < 4; i++) sums[warp * 128 + 4 * lane + i] = s.v[i];
  KX_BARRIER();
  if (warp == 0) {
    Exl3Vec4 v;
    for (int i = 0; i < 4; i++) {
      float t = sums[4 * lane + i];
      for (int w = 1; w < 8; w++) t += sums[w * 128 + 4 * lane + i];
      v.v[i] = t;
    }
    v = exl3_hadamard128(v, lane);
    for (int i = 0; i < 4; i++) {
      float y = v.v[i] * KX_TO_F32(svh[c0 + i]);
      if (HAS_BIAS) y += KX_TO_F32(bias[c0 + i]);
      exl3_store_out<OUT>(out, (u64)row * n + c0 + i, y);
    }
  }
  KX_BARRIER();
}
