// exl3_gemv_out: y [m, n] = H128(sum of the k-split partials) ⊙ svh (+ bias), the output side of a
// k-split exl3_gemv (exl3 spec §3.3 steps 4-6). One SIMD group per (128-column block KX_TGID_X,
// row KX_TGID_Y); partials are added in split order. Template: HAS_BIAS, OUT (as exl3_gemv).
const u32 lane = KX_LANE;
const u32 col_block = KX_TGID_X, row = KX_TGID_Y;
const u32 splits = partial_shape[0], rows = partial_shape[1], n = partial_shape[2];
Exl3Vec4 v;
for (int i = 0; i < 4; i++) {
  const u32 col = col_block * 128 + 4 * lane + i;
  float s = 0.0f;
  for (u32 p = 0; p < splits; p++) s += partial[((u64)p * rows + row) * n + col];
  v.v[i] = s;
}
v = exl3_hadamard128(v, lane);
for (int i = 0; i < 4; i++) {
  const u32 col = col_block * 128 + 4 * lane + i;
  float y = v.v[i] * KX_TO_F32(svh[col]);
  if (HAS_BIAS) y += KX_TO_F32(bias[col]);
  exl3_store_out<OUT>(out, (u64)row * n + col, y);
}
