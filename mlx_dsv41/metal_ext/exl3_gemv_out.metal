// exl3_gemv_out: y [m, n] = H128(sum of the k-split partials) ⊙ svh (+ bias), the output side of a
// k-split exl3_gemv (docs/exl3.md#forward steps 4-6). Threadgroup: 8 SIMD groups for (128-column
// block KX_TGID_X, row KX_TGID_Y). SIMD group w adds splits w, w+8, ... (their loads all
// independent), then group 0 adds the 8 sums in group order and applies H128, svh and the bias.
// Template: HAS_BIAS, OUT (as exl3_gemv).
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, row = KX_TGID_Y;
const u32 splits = partial_shape[0], rows = partial_shape[1], n = partial_shape[2];
KX_SHARED(float, sums, 8 * 128);

const u32 c0 = col_block * 128 + 4 * lane;
Exl3Vec4 s;
for (int i = 0; i < 4; i++) s.v[i] = 0.0f;
for (u32 p = warp; p < splits; p += 8)
  for (int i = 0; i < 4; i++) s.v[i] += partial[((u64)p * rows + row) * n + c0 + i];
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
