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
// 256 threads (8 SIMD groups) per threadgroup.
KX_SHARED(float, sums, 8 * 8 * 4);
fp32_gemv_group<M, COLS, SPLIT, W>(fp32_rows(x, w_shape[1]), w, y, w_shape[0], w_shape[1], sums, KX_TGID_X, KX_WARP, KX_LANE);
