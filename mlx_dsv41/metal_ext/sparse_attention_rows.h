// Sparse attention for many query rows on tensor cores (docs/model.md#attention-rows): the
// formula of sparse_attention.h, with the heads of one query row as the rows of MMA tiles. The
// sums run in another order than the serial and parallel kernels' (tensor-core fp32
// accumulation; P·V as bf16(p) · v + bf16(p - bf16(p)) · v), so its bytes are not theirs: it is
// bounded against float64 instead (tests/gpu/test_sparse_attention_rows_gpu.py).
#pragma once

#define SAR_HEADS 16  // heads of a threadgroup: the 16 rows of an MMA tile
#define SAR_KEYS 16   // keys per tile: two 8-column logit tiles, one k16 step of P·V
#define SAR_WARPS 4   // SIMD groups; group w owns the dims w·DIM/4 .. +DIM/4 of the logit sums and of the output
#define SAR_WORDS(DIM) ((DIM) / 2 + 4)  // words per staged bf16 row (+16 bytes: ldmatrix without bank conflicts)

// p as bf16 hi + lo (kx_bf16_bits: float_bits.h) (hi = bf16(p), lo = bf16(p - hi): p - hi is exact), packed in pairs.
struct sar_split {
  u32 hi, lo;
};

KX_INLINE sar_split sar_split2(float a, float b) {
  const u32 ha = kx_bf16_bits(a), hb = kx_bf16_bits(b);
  const u32 la = kx_bf16_bits(KX_FSUB(a, KX_BITS_F32(ha << 16))), lb = kx_bf16_bits(KX_FSUB(b, KX_BITS_F32(hb << 16)));
  sar_split s;
  s.hi = ha | (hb << 16);
  s.lo = la | (lb << 16);
  return s;
}

// Element e (0..DIM) of a staged bf16 row, as float.
KX_INLINE float sar_elem(const KX_THREADGROUP u32* row, u32 e) {
  const u32 w = row[e / 2];
  return KX_BITS_F32((e & 1u) ? (w & 0xffff0000u) : (w << 16));
}
