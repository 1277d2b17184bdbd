// The tile product of f16_gemm (docs/exl3.md#many-row-gemm): a pipeline of F16G_STAGES buffers
// of a's BM x BK rows and b's BK x BN block in threadgroup memory, and a SIMD group's 32 x 32
// outputs as 2 x 4 MMA tiles of 16 rows x 8 columns.
// On CUDA the buffers fill by asynchronous copies, fragments load with ldmatrix (b's transposed:
// it is staged k-major as stored) and each tile and k16 step is one mma.m16n8k16 (fp16 operands,
// fp32 accumulation); without MMA (Metal) the copies are plain and each lane sums its own four
// outputs of a tile with FMAs over the same 16 k, in k order.
// The C layout is the MMA's either way: lane (q, c) holds rows q, q + 8 x columns 2c, 2c + 1.
#pragma once

#define F16G_BM 64  // rows of a threadgroup's tile
#define F16G_BN 128 // columns of a threadgroup
#define F16G_BK 32  // k per pipeline step
// Words per staged row: 16 bytes of padding put the 8 rows an ldmatrix phase reads in 8
// different 4-bank groups (a: 20 words apart, b: 68; both multiples of 4 for 16-byte copies).
#define F16G_A_WORDS (F16G_BK / 2 + 4)
#define F16G_B_WORDS (F16G_BN / 2 + 4)
#define F16G_A_STAGE (F16G_BM * F16G_A_WORDS)
#define F16G_B_STAGE (F16G_BK * F16G_B_WORDS)
#if KX_HAS_ASYNC_COPY
#define F16G_STAGES 3  // 41.5 KiB: copies of two steps in flight while one is multiplied
#define F16G_COMMIT() KX_ASYNC_COMMIT()
#define F16G_WAIT(n) KX_ASYNC_WAIT(n)
#else
#define F16G_STAGES 2  // 27 KiB: Apple GPUs have 32 KiB of threadgroup memory
#define F16G_COMMIT()  // plain copies: the barrier alone makes them visible
#define F16G_WAIT(n)
#endif

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

// 16 bytes at src to words i..i+3 of a threadgroup buffer (asynchronous where there is a copy
// engine; the step's wait and barrier make them visible either way).
KX_INLINE void f16_gemm_copy16(KX_THREADGROUP u32* base, u32 i, const KX_DEVICE u32* src) {
#if KX_HAS_ASYNC_COPY
  KX_ASYNC_COPY16(base, i, src);
#else
  u32 v[4];
  KX_LOAD_U32X4(src, v);
  for (int j = 0; j < 4; j++) base[i + j] = v[j];
#endif
}

// Thread t's share of pipeline step k0 (256 threads): a's row t / 4, 16 bytes t % 4 of the step
// (a row past the tile reads row r1 - 1 instead: its outputs are never stored), and b's k rows
// t / 16 and t / 16 + 16, 16 bytes t % 16 of the BN columns.
KX_INLINE void f16_gemm_stage(KX_THREADGROUP u32* as, KX_THREADGROUP u32* bs, const KX_DEVICE u32* aw,
                              const KX_DEVICE u32* bw, u32 K, u32 N, u32 n0, i32 r0, i32 r1, u32 k0, u32 t) {
  const i32 row = min(r0 + (i32)(t / 4), r1 - 1);
  f16_gemm_copy16(as, (t / 4) * F16G_A_WORDS + 4 * (t % 4), aw + ((u64)row * K + k0) / 2 + 4 * (t % 4));
  for (u32 h = 0; h < 2; h++) {
    const u32 k = t / 16 + 16 * h;
    f16_gemm_copy16(bs, k * F16G_B_WORDS + 4 * (t % 16), bw + ((u64)(k0 + k) * N + n0) / 2 + 4 * (t % 16));
  }
}

// k16 step s of a staged buffer: acc += a[rows, 16 s .. +16] · b[16 s .. +16, columns].
KX_INLINE F16GemmAcc f16_gemm_step(F16GemmAcc acc, const KX_THREADGROUP u32* as, const KX_THREADGROUP u32* bs,
                                   u32 w, u32 lane, u32 s) {
  const u32 rbase = 32 * (w / 4), cbase = 32 * (w % 4);
#if KX_HAS_MMA_F16
  // lane l addresses row l % 16 of its 16 x 16 block at column half l / 16 (ldmatrix's four
  // 8 x 8 matrices in the order of the MMA's a0..a3, and b0, b1 of two column tiles)
  u32 b[4][2];
  KX_UNROLL
  for (int jj = 0; jj < 2; jj++) {
    u32 r[4];
    KX_LDMATRIX_X4_TRANS(bs, (16 * s + (lane & 15u)) * F16G_B_WORDS + (cbase + 16 * jj + 8 * (lane >> 4)) / 2, r);
    b[2 * jj][0] = r[0], b[2 * jj][1] = r[1], b[2 * jj + 1][0] = r[2], b[2 * jj + 1][1] = r[3];
  }
  KX_UNROLL
  for (int i = 0; i < 2; i++) {
    u32 a[4];
    KX_LDMATRIX_X4(as, (rbase + 16 * i + (lane & 15u)) * F16G_A_WORDS + 8 * s + 4 * (lane >> 4), a);
    KX_UNROLL
    for (int j = 0; j < 4; j++) KX_MMA_F16_F32(acc.c[i][j], a[0], a[1], a[2], a[3], b[j][0], b[j][1]);
  }
#else
  const u32 q = lane >> 2, c = lane & 3u;
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++)
      for (int e = 0; e < 4; e++) {
        const u32 row = rbase + 16 * i + q + 8 * (e >> 1), col = cbase + 8 * j + 2 * c + (e & 1);
        float sum = acc.c[i][j][e];
        for (u32 k = 16 * s; k < 16 * s + 16; k++) {
          const u32 av = as[row * F16G_A_WORDS + k / 2] >> (16 * (k & 1));
          const u32 bv = bs[k * F16G_B_WORDS + col / 2] >> (16 * (col & 1));
          sum = KX_FMA(KX_F16_BITS_TO_F32(av & 0xFFFFu), KX_F16_BITS_TO_F32(bv & 0xFFFFu), sum);
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
