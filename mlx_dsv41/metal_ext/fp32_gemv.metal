// fp32_gemv: y[m, n] = Σ_k x[m, k] · w[n, k] with every product and sum in fp32 and y float32, from
// weights held in their stored dtype (docs/numerics.md#fp32-linears; 16-bit weights widen exactly).
// SPLIT SIMD groups own COLS consecutive outputs: group s of them takes the s-th of SPLIT
// consecutive ranges of k's 8-element chunks, lane l the chunks l, l + 32, ... of that range in
// order (one FMA per element); the 32 lane sums meet in a xor butterfly, and the SPLIT range sums
// are added in range order. SPLIT > 1 lets a weight of few rows (the mHC mixes' fn: 24 rows) use
// many threadgroups. An output's order of operations depends on K and SPLIT (chosen from N) alone,
// never on M or its place in the launch: a row's bytes are the same solo or batched.
// Template: M (rows, 1..8), COLS, SPLIT (divides the 8 SIMD groups), W (w's dtype: 0 float32,
// 1 fp16, 2 bf16); x fp32, fp16 or bf16. x [M, K], w [N, K] with K % 8 == 0 (16-byte aligned rows),
// y [M, N].
const u32 N = w_shape[0], K = w_shape[1], C = K / 8;
const u32 part = KX_WARP % SPLIT;
const u32 n0 = (KX_TGID_X * (KX_TG_SIZE_X / KX_SIMD_WIDTH / SPLIT) + KX_WARP / SPLIT) * COLS;
const bool live = n0 < N;  // the same for the whole SIMD group: the butterfly below has every lane
KX_SHARED(float, sums, 8 * 8 * 4);  // SPLIT > 1: SIMD groups x M x COLS range sums (at most 8 x 8 x 4)
float acc[M][COLS];
for (int m = 0; m < M; m++)
  for (int j = 0; j < COLS; j++) acc[m][j] = 0.0f;
const KX_DEVICE u32* words = (const KX_DEVICE u32*)w;
const u32 c_end = live ? (part + 1) * C / SPLIT : 0;
// U chunks per lane per pass, every load of a pass issued before its FMAs (one memory round trip
// per pass: a one-output SIMD group of the mHC mixes' fn walks 10 chunks a lane); the FMAs keep
// the chunk order, so the sums are the same operations in the same order whatever U.
constexpr int U = (M * 8 + COLS * 8) <= 16 ? 8 : (M * 8 + COLS * 8) <= 40 ? 2 : 1;
for (u32 c0 = part * C / SPLIT + KX_LANE; c0 < c_end; c0 += U * KX_SIMD_WIDTH) {
  float xv[U][M][8];
  float wf[U][COLS][8];
  KX_UNROLL for (int u = 0; u < U; u++) {
    const u32 c = c0 + u * KX_SIMD_WIDTH;
    if (c >= c_end) break;
    for (int m = 0; m < M; m++)
      for (int e = 0; e < 8; e++) xv[u][m][e] = KX_TO_F32(x[(u64)m * K + c * 8 + e]);
    for (int j = 0; j < COLS; j++) {
      const u32 n = n0 + j < N ? n0 + j : N - 1;  // past the end: read the last row, write nothing
      if (W == 0) {
        KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8, wf[u][j]);
        KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8 + 4, wf[u][j] + 4);
      } else {
        u32 wv[4];
        KX_LOAD_U32X4(words + ((u64)n * K + c * 8) / 2, wv);
        for (int e = 0; e < 8; e++) {
          const u32 bits = (e & 1) ? (wv[e >> 1] >> 16) : (wv[e >> 1] & 0xFFFFu);
          wf[u][j][e] = W == 2 ? KX_BITS_F32(bits << 16) : KX_F16_BITS_TO_F32(bits);
        }
      }
    }
  }
  KX_UNROLL for (int u = 0; u < U; u++) {
    if (c0 + u * KX_SIMD_WIDTH >= c_end) break;
    for (int j = 0; j < COLS; j++)
      for (int e = 0; e < 8; e++)
        for (int m = 0; m < M; m++) acc[m][j] = KX_FMA(xv[u][m][e], wf[u][j][e], acc[m][j]);
  }
}
for (int m = 0; m < M; m++)
  for (int j = 0; j < COLS; j++)
    for (u32 o = KX_SIMD_WIDTH / 2; o > 0; o >>= 1) acc[m][j] += KX_SHUFFLE_XOR(acc[m][j], o);
if (SPLIT == 1) {
  if (live && KX_LANE == 0)
    for (int m = 0; m < M; m++)
      for (int j = 0; j < COLS; j++)
        if (n0 + j < N) y[(u64)m * N + n0 + j] = acc[m][j];
} else {
  // The range sums of the threadgroup's SIMD groups, then the first group of each SPLIT adds its
  // outputs' SPLIT sums in range order.
  if (KX_LANE == 0)
    for (int m = 0; m < M; m++)
      for (int j = 0; j < COLS; j++) sums[(KX_WARP * M + m) * COLS + j] = acc[m][j];
  KX_BARRIER();
  if (live && part == 0 && KX_LANE < M * COLS) {
    const u32 m = KX_LANE / COLS, j = KX_LANE % COLS;
    float v = sums[(KX_WARP * M + m) * COLS + j];
    for (u32 s = 1; s < SPLIT; s++) v += sums[((KX_WARP + s) * M + m) * COLS + j];
    if (n0 + j < N) y[(u64)m * N + n0 + j] = v;
  }
}
