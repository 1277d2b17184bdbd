// exl3_gemv_out: y [m, n] = H128(sum of the k-split partials) ⊙ svh (+ bias), the output side of a
// k-split exl3_gemv (exl3 spec §3.3 steps 4-6). Threadgroup: 8 SIMD groups for (128-column block
// KX_TGID_X, row KX_TGID_Y); the splits are added in a fixed order (exl3_finish_splits).
// Template: HAS_BIAS, OUT (as exl3_gemv).
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, row = KX_TGID_Y;
const u32 splits = partial_shape[0], rows = partial_shape[1], n = partial_shape[2];
KX_SHARED(float, sums, 8 * 128);

const u32 c0 = col_block * 128 + 4 * lane;
const Exl3Vec4 v = exl3_finish_splits(partial + (u64)row * n + col_block * 128, (u64)rows * n, splits, sums, warp, lane);
if (warp == 0) {
  for (int i = 0; i < 4; i++) {
    float y = v.v[i] * KX_TO_F32(svh[c0 + i]);
    if (HAS_BIAS) y += KX_TO_F32(bias[c0 + i]);
    exl3_store_out<OUT>(out, (u64)row * n + c0 + i, y);
  }
}
