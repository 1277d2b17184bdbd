// exl3_rows_in: the input side of an EXL3 linear for many rows, in the plain row-major layout
// f16_gemm reads: xh[r] = fp16(H128(fp16(x[src[r]] ⊙ suh[e[r]]))) (docs/exl3.md#forward steps
// 1-2; docs/exl3.md#many-row-transforms), x·suh formed in float32 and rounded once to fp16, H128
// as the decode kernels run it (exl3_hadamard128). src picks x's row (a routed slot's token),
// e the row's suh (its expert or group; 0 for a plain linear). Columns >= x's width are zero
// (the zero-extension to k). Grid: x = 128-blocks of k, one SIMD group each (a threadgroup's
// last SIMD groups may have none); y = row. No barriers.
// Inputs: x [T, width] float, src [R] int32, e [R] int32, suh [E, k]. Output: xh [R, k] fp16.
const u32 lane = KX_LANE;
const u32 block = KX_TGID_X * (KX_TG_SIZE_X / 32) + KX_WARP, r = KX_TGID_Y;
const u32 k = suh_shape[1], width = x_shape[1];
if (block * 128 < k) {
  const u64 x0 = (u64)src[r] * width, s0 = (u64)e[r] * k;
  const u32 c0 = block * 128 + 4 * lane;
  Exl3Vec4 v;
  for (int i = 0; i < 4; i++) {
    const float xv = (c0 + i < width) ? KX_TO_F32(x[x0 + c0 + i]) : 0.0f;
    v.v[i] = exl3_round_f16(xv * KX_TO_F32(suh[s0 + c0 + i]));
  }
  v = exl3_hadamard128(v, lane);
  KX_DEVICE u32* row = (KX_DEVICE u32*)xh + (u64)r * (k / 2) + c0 / 2;
  row[0] = exl3_pack_f16(v.v[0], v.v[1]);
  row[1] = exl3_pack_f16(v.v[2], v.v[3]);
}
