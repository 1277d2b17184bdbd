// fp32_gemv: y[m, n] = Σ_k x[m, k] · w[n, k] with every product and sum in fp32 and y float32, from
// weights held in their stored dtype (docs/numerics.md#fp32-linears; 16-bit weights widen exactly).
// A SIMD group owns COLS consecutive outputs; lane l takes the 8-element chunks l, l + 32, ... of k
// in order (one FMA per element), then the 32 lane sums meet in a xor butterfly. An output's order
// of operations depends on K alone, never on M, N or its place in the launch: a row's bytes are
// the same solo or batched.
// Template: M (rows, 1..8), COLS, W (w's dtype: 0 float32, 1 fp16, 2 bf16); x fp32, fp16 or bf16.
// x [M, K], w [N, K] with K % 8 == 0 (16-byte aligned rows), y [M, N].
const u32 N = w_shape[0], K = w_shape[1];
const u32 n0 = (KX_TGID_X * (KX_TG_SIZE_X / KX_SIMD_WIDTH) + KX_WARP) * COLS;
if (n0 < N) {  // the same for the whole SIMD group: the butterfly below has every lane
  float acc[M][COLS];
  for (int m = 0; m < M; m++)
    for (int j = 0; j < COLS; j++) acc[m][j] = 0.0f;
  const KX_DEVICE u32* words = (const KX_DEVICE u32*)w;
  for (u32 c = KX_LANE; c < K / 8; c += KX_SIMD_WIDTH) {
    float xv[M][8];
    for (int m = 0; m < M; m++)
      for (int e = 0; e < 8; e++) xv[m][e] = KX_TO_F32(x[(u64)m * K + c * 8 + e]);
    for (int j = 0; j < COLS; j++) {
      const u32 n = n0 + j < N ? n0 + j : N - 1;  // past the end: read the last row, write nothing
      float wf[8];
      if (W == 0) {
        KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8, wf);
        KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8 + 4, wf + 4);
      } else {
        u32 wv[4];
        KX_LOAD_U32X4(words + ((u64)n * K + c * 8) / 2, wv);
        for (int e = 0; e < 8; e++) {
          const u32 bits = (e & 1) ? (wv[e >> 1] >> 16) : (wv[e >> 1] & 0xFFFFu);
          wf[e] = W == 2 ? KX_BITS_F32(bits << 16) : KX_F16_BITS_TO_F32(bits);
        }
      }
      for (int e = 0; e < 8; e++)
        for (int m = 0; m < M; m++) acc[m][j] = KX_FMA(xv[m][e], wf[e], acc[m][j]);
    }
  }
  for (int m = 0; m < M; m++) {
    for (int j = 0; j < COLS; j++) {
      float v = acc[m][j];
      for (u32 o = KX_SIMD_WIDTH / 2; o > 0; o >>= 1) v += KX_SHUFFLE_XOR(v, o);
      if (KX_LANE == 0 && n0 + j < N) y[(u64)m * N + n0 + j] = v;
    }
  }
}
