// The tile product of f16_gemm (docs/exl3.md#many-row-gemm): a SIMD group's 32 x 32 outputs as 2 x 4
// MMA tiles of 16 rows x 8 columns, from a's rows and b's columns staged in threadgroup memory.
// On CUDA one mma.m16n8k16 per tile and k16 step (fp16 operands, fp32 accumulation); without MMA
// (Metal) each lane sums its own four outputs of a tile with FMAs over the same 16 k, in k order.
// The C layout is the MMA's either way: lane (q, c) holds rows q, q + 8 x columns 2c, 2c + 1.
#pragma once

#define F16G_BM 64        // rows of a threadgroup's tile
#define F16G_BN 128       // columns of a threadgroup
#define F16G_BK 32        // k per staging step
#define F16G_AS_WORDS 20  // words per staged row of a (16 + 4: conflict-free fragment reads)
#define F16G_BS_WORDS 17  // words per staged column of b (k pairs; odd: fewer bank conflicts)

struct F16GemmAcc {
  float c[2][4][4];
};

KX_INLINE F16GemmAcc f16_gemm_zero() {
  F16GemmAcc acc;
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++)
      for (int e = 0; e < 4; e++) acc.c[i][j][e] = 0.0f;
  return acc;
}

// k16 step s of the staged block: acc += a[rows, 16 s .. +16] · b[16 s .. +16, columns].
KX_INLINE F16GemmAcc f16_gemm_step(F16GemmAcc acc, const KX_THREADGROUP u32* as, const KX_THREADGROUP u32* bs,
                                   u32 w, u32 lane, u32 s) {
  const u32 q = lane >> 2, c = lane & 3u, rbase = 32 * (w / 4), cbase = 32 * (w % 4);
#if KX_HAS_MMA_F16
  u32 b[4][2];
  for (int j = 0; j < 4; j++) {
    const u32 o = (cbase + 8 * j + q) * F16G_BS_WORDS + 8 * s + c;
    b[j][0] = bs[o];
    b[j][1] = bs[o + 4];
  }
  for (int i = 0; i < 2; i++) {
    const u32 o = (rbase + 16 * i + q) * F16G_AS_WORDS + 8 * s + c;
    const u32 a0 = as[o], a1 = as[o + 8 * F16G_AS_WORDS], a2 = as[o + 4], a3 = as[o + 8 * F16G_AS_WORDS + 4];
    for (int j = 0; j < 4; j++) KX_MMA_F16_F32(acc.c[i][j], a0, a1, a2, a3, b[j][0], b[j][1]);
  }
#else
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++)
      for (int e = 0; e < 4; e++) {
        const u32 row = rbase + 16 * i + q + 8 * (e >> 1), col = cbase + 8 * j + 2 * c + (e & 1);
        float sum = acc.c[i][j][e];
        for (u32 kw = 0; kw < 8; kw++) {
          const u32 av = as[row * F16G_AS_WORDS + 8 * s + kw], bv = bs[col * F16G_BS_WORDS + 8 * s + kw];
          sum = KX_FMA(KX_F16_BITS_TO_F32(av & 0xFFFFu), KX_F16_BITS_TO_F32(bv & 0xFFFFu), sum);
          sum = KX_FMA(KX_F16_BITS_TO_F32(av >> 16), KX_F16_BITS_TO_F32(bv >> 16), sum);
        }
        acc.c[i][j][e] = sum;
      }
#endif
  return acc;
}

// The lane's outputs of rows below r1 to y [., N] (float32).
KX_INLINE void f16_gemm_store(F16GemmAcc acc, KX_DEVICE float* y, u32 N, u32 n0, i32 r0, i32 r1, u32 w, u32 lane) {
  const u32 q = lane >> 2, c = lane & 3u;
  for (int i = 0; i < 2; i++)
    for (int h = 0; h < 2; h++) {
      const i32 row = r0 + (i32)(32 * (w / 4) + 16 * i + q + 8 * h);
      if (row >= r1) continue;
      for (int j = 0; j < 4; j++) {
        const u64 o = (u64)row * N + n0 + 32 * (w % 4) + 8 * j + 2 * c;
        y[o] = acc.c[i][j][2 * h];
        y[o + 1] = acc.c[i][j][2 * h + 1];
      }
    }
}
