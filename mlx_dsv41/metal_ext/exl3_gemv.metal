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
//   PAIR (with FINISH; the first linear's column blocks, 0: none): column blocks PAIR.. are a second
//   linear's (suh2, trellis2, svh2 -> y2 [.., n2]) of the same x and k, its k split in blocks of
//   PER_SPLIT2, in the same launch (docs/design.md#paired-linears): each threadgroup does what its
//   linear's own launch would (the grid has the larger split count; the other linear's extra
//   threadgroups return at once), so y and y2 have those launches' bytes; the partials out
//   [splits, m, n + n2] hold both. y2 is a 1-element stand-in without PAIR.
//   NORM (with FINISH): the first linear's column blocks' finishing threadgroups then count on the
//   counter past every column block's, and the last of those replaces each row of y by its RMSNorm
//   with norm_w and EPS_BITS (hc_rms_norm_row: hc_collapse_norm's operations over one stream, so y
//   has the bytes of this launch then that one; docs/design.md#normed-linear).
//   ROPE (FUSED): y's rows are stored turned as the rope kernel turns a linear's output
//   (exl3_store_roped, exl3_rope.h; docs/design.md#roped-linears): row r of x [.., S, in] at position
//   offset + r % S, pair k of each D = 2 · |period| columns by period[k].
//   RING (with PAIR and FINISH): the second linear's rows are the window keys of x's tokens:
//   window_out is the window ring [B, R, n2] with row (b, s) of y2 through the rope kernel's norm
//   (norm2_w, EPS2_BITS), rope (offset + s, period) and fake quantization (QBLOCK, QMODE) at slot
//   (offset + s) % R of ring b, and window's own rows at every other slot: the second linear's
//   blocks' finishing threadgroups count on the counter after NORM's (or the column blocks'), the
//   last writes the new rows (exl3_window_row), and threadgroups of the whole grid copy the other
//   slots beforehand. window_out is a 1-element stand-in without RING.
// Inputs: x [.., in] (m rows: the leading dims; in <= k, zero-extended), suh [k], trellis
// [k/16, n/16, 16K] int16, svh [n], bias [n] (read only if HAS_BIAS), counters [column blocks (+ 1
// with NORM, + 1 with RING)] uint32, norm_w [n] (read only if NORM), suh2 / trellis2 / svh2 (read
// only if PAIR), offset (0-d int32), period [D / 2] (ROPE or RING), norm2_w [n2] and window [B, R, n2]
// (RING).
// Template: K2, CB, M (1, 2, 4 or 8; rows >= m are zero), NC, NW, STAGES, XSW (exl3_matmul.h),
// FUSED, FINISH, HAS_BIAS, OUT, PER_SPLIT (128-blocks of k per split), NORM, EPS_BITS, PAIR,
// PER_SPLIT2, ROPE, RING, EPS2_BITS, QBLOCK, QMODE. Launch constants are template values, never
// small arrays: see docs/design.md, "Launch constants".
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, split = KX_TGID_Y;
u32 rows = 1;
for (int d = 0; d + 1 < x_ndim; d++) rows *= x_shape[d];
const u32 in_features = x_shape[x_ndim - 1];
const bool second = PAIR > 0 && col_block >= (u32)PAIR;
const u32 block = second ? col_block - (u32)PAIR : col_block;  // the column block in its linear
const u32 first_blocks = PAIR > 0 ? (u32)PAIR : trellis_shape[1] / 8;
const u32 all_blocks = first_blocks + (PAIR > 0 ? trellis2_shape[1] / 8 : 0u);
const u32 tiles_k = trellis_shape[0], tiles_n = second ? trellis2_shape[1] : trellis_shape[1];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2, pn = all_blocks * 128;
const u32 per_split = second ? (u32)PER_SPLIT2 : (u32)PER_SPLIT;
const u32 splits = (tiles_k / 8 + per_split - 1) / per_split;  // this linear's
const u32 kb_begin = split * per_split;
KX_SHARED16(u32, ring, EXL3_RING_WORDS(K2, STAGES, NW, NC, M));
KX_SHARED(u32, xs, XSW);
KX_SHARED(u32, last, 1);  // FINISH: whether this threadgroup is its column block's last
const u32 S = x_ndim >= 2 ? x_shape[x_ndim - 2] : 1u;  // ROPE and RING: rows r at offset + r % S
if (RING && PAIR > 0) {  // the ring's slots no new row reaches, copied by every threadgroup in turn
  const u32 kb = tiles_k / 8, R = window_shape[1];
  const u32 tgs = all_blocks * max((kb + PER_SPLIT - 1) / PER_SPLIT, (kb + PER_SPLIT2 - 1) / PER_SPLIT2);
  for (u32 t = col_block + split * all_blocks; t < window_shape[0] * R; t += tgs)
    rope_ring_copy(window, window_out, t, trellis2_shape[1] * 16, S, R, KX_SCALAR(offset), KX_LID_X);
}
if (split >= splits) return;  // PAIR: a split only the other linear has (uniform in the threadgroup)
const u32 nb = min(per_split, tiles_k / 8 - kb_begin);

const KX_DEVICE u32* src =
    (const KX_DEVICE u32*)(second ? trellis2 : trellis) + (u64)kb_begin * 8 * row_words + block * 32 * K2;
const Exl3Acc<M, NC> acc = exl3_product<K2, CB, M, NC, NW, STAGES, XSW, (PER_SPLIT > PER_SPLIT2 ? PER_SPLIT : PER_SPLIT2)>(
    src, row_words, nb, exl3_input_stager<M, XSW>(x, second ? suh2 : suh, rows, in_features, kb_begin), ring, xs, warp,
    lane);
const KX_THREADGROUP float* ys = exl3_gather_acc<M, NC, NW>(acc, ring, warp, lane);
if (FUSED) {
  for (u32 r = warp; r < M && r < rows; r += NW) {
    const Exl3Vec4 v = exl3_hadamard128(exl3_ys_row<M, EXL3_KG(NW, NC)>(ys, r, lane), lane);
    const u32 c0 = col_block * 128 + 4 * lane;
    float y[4];
    for (int i = 0; i < 4; i++) {
      y[i] = v.v[i] * KX_TO_F32(svh[c0 + i]);
      if (HAS_BIAS) y[i] += KX_TO_F32(bias[c0 + i]);
    }
    if (ROPE) {
      exl3_store_roped<OUT>(out, (u64)r * n + c0, y, KX_SCALAR(offset), r % S, period, 2 * period_shape[0], c0);
    } else {
      for (int i = 0; i < 4; i++) exl3_store_out<OUT>(out, (u64)r * n + c0 + i, y[i]);
    }
  }
} else {
  for (u32 i = KX_LID_X; i < M * 128; i += NW * 32) {
    const u32 r = i / 128, j = i % 128;
    if (r < rows)
      exl3_store_out<0>(out, ((u64)split * rows + r) * pn + col_block * 128 + j, exl3_ys_sum<M, EXL3_KG(NW, NC)>(ys, r, j));
  }
  if (FINISH && KX_HAS_GRID_FINISH) {
    if (grid_finish_arrival(counters, col_block, splits, last, KX_LID_X)) {
      const KX_DEVICE float* partial = (const KX_DEVICE float*)out + (col_block - block) * 128;
      for (u32 r = 0; r < rows; r++)  // xs is free: the product is done
        exl3_finish_row<OUT, HAS_BIAS>(partial, pn, second ? svh2 : svh, bias, second ? y2 : y,
                                       (KX_THREADGROUP float*)xs, splits, rows, n, r, block, warp, lane);
      if (NORM && !second && grid_finish_arrival(counters, all_blocks, first_blocks, last, KX_LID_X))
        for (u32 r = 0; r < rows; r++)  // in place: each thread reads a value before it writes it
          hc_rms_norm_row(hc_loaded_row<true>(y + (u64)r * n), norm_w, y + (u64)r * n, n, KX_BITS_F32(EPS_BITS),
                          (KX_THREADGROUP float*)xs, KX_LID_X, lane, warp);
      if (RING && second && grid_finish_arrival(counters, all_blocks + NORM, all_blocks - first_blocks, last, KX_LID_X))
        for (u32 r = 0; r < rows; r++)  // row r's slot: (offset + s) % R of ring r / S
          exl3_window_row<QBLOCK, QMODE>(y2, KX_SCALAR(offset), period, norm2_w, window, window_out,
                                         (r / S) * window_shape[1] + ((u32)KX_SCALAR(offset) + r % S) % window_shape[1],
                                         n, S, window_shape[1], EPS2_BITS, (KX_THREADGROUP float*)xs, KX_LID_X, lane,
                                         warp);
    }
  }
}
