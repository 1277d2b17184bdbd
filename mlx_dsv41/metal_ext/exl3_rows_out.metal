// exl3_rows_out: the output side of an EXL3 linear for many rows: y[dst[r]] = H128(acc[r]) ⊙ svh[e[r]]
// (+ bias), in float32 and rounded once to y's dtype, OUT (docs/exl3.md#forward steps 4-6;
// docs/exl3.md#many-row-transforms); ROUND_BF16: rounded to bf16 first and stored in y's float32
// (the routed experts' w2, whose reference linear returns bf16). acc [R, n] float32 is the
// product of the rows' xh with W̃ (f16_gemm), e the row's svh (its expert or group), dst its row
// of y (a routed slot, or a group-major row put back token-major); rows of y no r names are left
// as the launch initialised them. Grid: x = 128-blocks of n, one SIMD group each; y = row.
// Inputs: acc [R, n] float32, e [R] int32, dst [R] int32, svh [E, n], bias [n] (read when
// HAS_BIAS). Output: y [rows, n]. Template: HAS_BIAS, ROUND_BF16, OUT (exl3_store_out).
const u32 lane = KX_LANE;
const u32 block = KX_TGID_X * (KX_TG_SIZE_X / 32) + KX_WARP, r = KX_TGID_Y;
const u32 n = acc_shape[1];
if (block * 128 < n) {
  const u32 c0 = block * 128 + 4 * lane;
  const Exl3Vec4 v = exl3_hadamard128(exl3_load4(acc + (u64)r * n + c0), lane);
  const u64 s0 = (u64)e[r] * n, y0 = (u64)dst[r] * n + c0;
  for (int i = 0; i < 4; i++) {
    float o = v.v[i] * KX_TO_F32(svh[s0 + c0 + i]);
    if (HAS_BIAS) o += KX_TO_F32(bias[c0 + i]);
    if (ROUND_BF16) o = exl3_round_bf16(o);
    exl3_store_out<OUT>(y, y0 + i, o);
  }
}
