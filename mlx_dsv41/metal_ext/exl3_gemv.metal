// exl3_gemv: y = x·W (+ bias) for M <= 8 rows of x, decoding the EXL3 trellis on the fly
// (docs/exl3.md#forward; W̃ is never materialised). Threadgroup: NW SIMD groups for the 128 output
// columns of block KX_TGID_X and the k split KX_TGID_Y (see exl3_matmul.h).
//   FUSED (one split): applies H128, svh and the bias and writes out = y [.., n] (OUT: 0 float32,
//   1 fp16, 2 bf16).
//   otherwise: writes float32 partial sums out [splits, m, n] for exl3_gemv_out; with FINISH (where
//   KX_HAS_GRID_FINISH) the last threadgroup of each column block to finish does exl3_gemv_out's
//   work itself, with its operations in its order (NW = 8), and writes y [.., n] (one launch
//   instead of two): counters[col_block] counts the finished splits and is set back to 0 by that
//   last threadgroup, so it is 0 again for the next launch (counters is scratch state of the
//   linear; launches that share it never run at once). y is a 1-element stand-in otherwise.
// Inputs: x [.., in] (m rows: the leading dims; in <= k, zero-extended), suh [k], trellis
// [k/16, n/16, 16K] int16, svh [n], bias [n] (read only if HAS_BIAS), counters [n/128] uint32.
// Template: K2, CB, M (1, 2, 4 or 8; rows >= m are zero), NC, NW, STAGES, XSW (exl3_matmul.h),
// FUSED, FINISH, HAS_BIAS, OUT, PER_SPLIT (128-blocks of k per split). Launch constants are
// template values, never small arrays: see docs/design.md, "Launch constants".
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, split = KX_TGID_Y;
u32 rows = 1;
for (int d = 0; d + 1 < x_ndim; d++) rows *= x_shape[d];
const u32 in_features = x_shape[x_ndim - 1];
const u32 tiles_k = trellis_shape[0], tiles_n = trellis_shape[1];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const u32 kb_begin = split * (u32)PER_SPLIT;
const u32 nb = min((u32)PER_SPLIT, tiles_k / 8 - kb_begin);
KX_SHARED16(u32, ring, EXL3_RING_WORDS(K2, STAGES, NW, NC, M));
KX_SHARED(u32, xs, XSW);
KX_SHARED(u32, last, 1);  // FINISH: whether this threadgroup is its column block's last

const KX_DEVICE u32* src = (const KX_DEVICE u32*)trellis + (u64)kb_begin * 8 * row_words + col_block * 32 * K2;
const Exl3Acc<M, NC> acc = exl3_product<K2, CB, M, NC, NW, STAGES, XSW, PER_SPLIT>(
    src, row_words, nb, exl3_input_stager<M, XSW>(x, suh, rows, in_features, kb_begin), ring, xs, warp, lane);
const KX_THREADGROUP float* ys = exl3_gather_acc<M, NC, NW>(acc, ring, warp, lane);
if (FUSED) {
  for (u32 r = warp; r < M && r < rows; r += NW) {
    const Exl3Vec4 v = exl3_hadamard128(exl3_ys_row<M, EXL3_KG(NW, NC)>(ys, r, lane), lane);
    for (int i = 0; i < 4; i++) {
      const u32 col = col_block * 128 + 4 * lane + i;
      float y = v.v[i] * KX_TO_F32(svh[col]);
      if (HAS_BIAS) y += KX_TO_F32(bias[col]);
      exl3_store_out<OUT>(out, (u64)r * n + col, y);
    }
  }
} else {
  for (u32 i = KX_LID_X; i < M * 128; i += NW * 32) {
    const u32 r = i / 128, j = i % 128;
    if (r < rows)
      exl3_store_out<0>(out, ((u64)split * rows + r) * n + col_block * 128 + j, exl3_ys_sum<M, EXL3_KG(NW, NC)>(ys, r, j));
  }
  if (FINISH && KX_HAS_GRID_FINISH) {
    const u32 splits = (tiles_k / 8 + PER_SPLIT - 1) / PER_SPLIT;
    if (grid_finish_arrival(counters, col_block, splits, last, KX_LID_X)) {
      for (u32 r = 0; r < rows; r++)  // xs is free: the product is done
        exl3_finish_row<OUT, HAS_BIAS>((const KX_DEVICE float*)out, svh, bias, y, (KX_THREADGROUP float*)xs, splits, rows,
                                       n, r, col_block, warp, lane);
    }
  }
}
