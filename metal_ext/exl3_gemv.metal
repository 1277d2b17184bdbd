// exl3_gemv: y = x·W (+ bias) for M <= 8 rows of x, decoding the EXL3 trellis on the fly
// (exl3 spec §3.3; W̃ is never materialised). Threadgroup = 8*WPC SIMD groups for the 128 output
// columns of block KX_TGID_X (see exl3_matmul.h); KX_TGID_Y is the k split.
//   FUSED (one split): applies H128, svh and the bias and writes out = y [m, n] (OUT: 0 float32,
//   1 fp16, 2 bf16).
//   otherwise: writes float32 partial sums out [splits, m, n] for exl3_gemv_out.
// Inputs: x [m, in] (in <= k, zero-extended), suh [k], trellis [k/16, n/16, 16K] int16, svh [n],
// bias [n] (read only if HAS_BIAS), params [1] = 128-blocks of k per split.
// Template: K2, CB, M (1, 2, 4 or 8; rows >= m are zero), WPC, FUSED, HAS_BIAS, OUT.
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, split = KX_TGID_Y;
const u32 rows = x_shape[0], in_features = x_shape[1];
const u32 tiles_k = trellis_shape[0], tiles_n = trellis_shape[1];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const u32 kb_begin = split * (u32)params[0];
const u32 kb_end = min(kb_begin + (u32)params[0], tiles_k / 8);
KX_SHARED(u32, xs, EXL3_XS_WORDS);
KX_SHARED(float, ys, WPC * M * 128);

const Exl3Lane l = exl3_lane<K2>(lane);
const u32 kgroup = warp / 8, col0 = (warp % 8) * 16;
const KX_DEVICE u32* column = (const KX_DEVICE u32*)trellis + (u64)(col_block * 8 + warp % 8) * (4 * K2);
Exl3Acc<M> acc = exl3_acc_zero<M>();
for (u32 kb = kb_begin; kb < kb_end; kb += EXL3_CHUNK_BLOCKS(M)) {
  const u32 nb = min((u32)EXL3_CHUNK_BLOCKS(M), kb_end - kb);
  KX_BARRIER();  // the previous chunk's xh is no longer read
  exl3_stage_input<M>(xs, x, suh, rows, in_features, kb, nb, warp, 8 * WPC, lane);
  KX_BARRIER();
  acc = exl3_tile_column<K2, CB, M, WPC>(acc, column + (u64)kb * 8 * row_words, row_words, xs, nb * 8, kgroup, l, lane);
}
exl3_store_acc<M>(ys, exl3_acc_finish<M>(acc, lane), kgroup, col0, lane);
KX_BARRIER();
if (FUSED) {
  if (warp < M && warp < rows) {
    const Exl3Vec4 v = exl3_hadamard128(exl3_ys_row<M, WPC>(ys, warp, lane), lane);
    for (int i = 0; i < 4; i++) {
      const u32 col = col_block * 128 + 4 * lane + i;
      float y = v.v[i] * KX_TO_F32(svh[col]);
      if (HAS_BIAS) y += KX_TO_F32(bias[col]);
      exl3_store_out<OUT>(out, (u64)warp * n + col, y);
    }
  }
} else {
  for (u32 i = KX_LID_X; i < M * 128; i += 256 * WPC) {
    const u32 r = i / 128, j = i % 128;
    if (r < rows) {
      float s = ys[r * 128 + j];
      for (int g = 1; g < WPC; g++) s += ys[(g * M + r) * 128 + j];
      exl3_store_out<0>(out, ((u64)split * rows + r) * n + col_block * 128 + j, s);
    }
  }
}
