// mxfp4_gemv: y[g·M + m, n] = Σ_k x[r_g + m, k] · W_e[n, k] for row groups g = (r_g, e) of slots,
// with W_e expert e's mxfp4 weight (E2M1 codes, element k of a row at bits 4 (k % 8) of word k / 8,
// one E8M0 scale per 32) decoded exactly, every product and sum in fp32, y float32
// (docs/numerics.md#mxfp4-gemv). A dense linear is one group (0, 0) of M <= 8 rows sharing the
// weight reads; routed experts are one group per slot (its token's row, its expert), M = 1.
// A SIMD group owns COLS consecutive outputs of one group; lane l takes the 32-element scale
// groups l, l + 32, ... of k in order: the group's 32 codes times x summed with fp32 FMAs, then
// scaled (a power of two: exact) into the lane's sum; the 32 lane sums meet in a xor butterfly.
// A row's order of operations depends on K alone: its bytes are the same solo or batched.
// Template: M (1..8), COLS. x [., K] float32, fp16 or bf16; w uint32 [E, N, K/8];
// scales uint8 [E, N, K/32]; slots int32 [G, 2]; y [G·M, N].
const u32 N = w_shape[1], KW = w_shape[2], NG = KW / 4, K = KW * 8;
const u32 grp = KX_TGID_Y;
const u32 r0 = (u32)slots[2 * grp], e = (u32)slots[2 * grp + 1];
const u32 n0 = (KX_TGID_X * (KX_TG_SIZE_X / KX_SIMD_WIDTH) + KX_WARP) * COLS;
if (n0 < N) {  // the same for the whole SIMD group: the butterfly below has every lane
  float acc[M][COLS];
  for (int m = 0; m < M; m++)
    for (int j = 0; j < COLS; j++) acc[m][j] = 0.0f;
  for (u32 q = KX_LANE; q < NG; q += KX_SIMD_WIDTH) {
    float part[M][COLS];
    for (int m = 0; m < M; m++)
      for (int j = 0; j < COLS; j++) part[m][j] = 0.0f;
    u32 codes[COLS][4];
    float scale[COLS];
    for (int j = 0; j < COLS; j++) {
      const u64 row = (u64)e * N + (n0 + j < N ? n0 + j : N - 1);  // past the end: read, write nothing
      KX_LOAD_U32X4(w + row * KW + 4 * q, codes[j]);
      scale[j] = mxfp4_scale(scales[row * NG + q]);
    }
    for (int word = 0; word < 4; word++) {
      float xv[M][8];
      for (int m = 0; m < M; m++)
        for (int t = 0; t < 8; t++) xv[m][t] = KX_TO_F32(x[(u64)(r0 + m) * K + 32 * q + 8 * word + t]);
      for (int j = 0; j < COLS; j++)
        for (int t = 0; t < 8; t++) {
          const float wv = mxfp4_e2m1((codes[j][word] >> (4 * t)) & 15u);
          for (int m = 0; m < M; m++) part[m][j] = KX_FMA(xv[m][t], wv, part[m][j]);
        }
    }
    for (int m = 0; m < M; m++)
      for (int j = 0; j < COLS; j++) acc[m][j] = KX_FMA(part[m][j], scale[j], acc[m][j]);
  }
  for (int m = 0; m < M; m++)
    for (int j = 0; j < COLS; j++) {
      float v = acc[m][j];
      for (u32 o = KX_SIMD_WIDTH / 2; o > 0; o >>= 1) v += KX_SHUFFLE_XOR(v, o);
      if (KX_LANE == 0 && n0 + j < N) y[(u64)(grp * M + m) * N + n0 + j] = v;
    }
}
