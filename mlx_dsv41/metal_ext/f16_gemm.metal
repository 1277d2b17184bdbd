// f16_gemm: y[r, :] = a[r, :] · b[g(r)] for fp16 a [M, K] and a stack of fp16 b [G, K, N], every
// product exact and every sum in fp32, y float32 (docs/exl3.md#many-row-gemm): the EXL3 product
// xh · W̃ of a prefill (G = 1) or of the routed experts over their sorted slots (one b per expert).
// Row tiles: tiles[t] = (first row, end row, g) of BM rows at most, all of one b; the host builds
// them (one expert's slots never share a tile with another's). K % BK == 0, N % BN == 0.
// Threadgroup (256 threads, 8 SIMD groups) = one row tile x BN columns; SIMD group w owns rows
// 32 (w / 4) .. +32 and columns 32 (w % 4) .. +32 of it. The k steps run as a pipeline over
// F16G_STAGES buffers: step i + STAGES - 1 is copied in while step i is multiplied (f16_gemm.h).
const u32 K = a_shape[1], N = b_shape[2];
const u32 n0 = KX_TGID_X * F16G_BN;
const i32 r0 = tiles[3 * KX_TGID_Y], r1 = tiles[3 * KX_TGID_Y + 1], g = tiles[3 * KX_TGID_Y + 2];
KX_SHARED16(u32, as, F16G_STAGES * F16G_A_STAGE);
KX_SHARED16(u32, bs, F16G_STAGES * F16G_B_STAGE);
const u32 t = KX_LID_X, lane = KX_LANE, w = KX_WARP;
const KX_DEVICE u32* aw = (const KX_DEVICE u32*)a;
const KX_DEVICE u32* bw = (const KX_DEVICE u32*)b + (u64)g * K * N / 2;
const u32 steps = K / F16G_BK;
// One copy group per buffer, empty ones included, so that "all but the last STAGES - 2 groups
// have landed" always means "step i has".
for (u32 i = 0; i + 1 < F16G_STAGES; i++) {
  if (i < steps) f16_gemm_stage(as + i * F16G_A_STAGE, bs + i * F16G_B_STAGE, aw, bw, K, N, n0, r0, r1, i * F16G_BK, t);
  F16G_COMMIT();
}
F16GemmAcc acc = f16_gemm_zero();
for (u32 i = 0; i < steps; i++) {
  F16G_WAIT(F16G_STAGES - 2);  // this thread's copies of step i have landed
  KX_BARRIER();                    // everyone's have, and step i - 1's buffer is read
  const u32 next = i + F16G_STAGES - 1, fill = next % F16G_STAGES, cur = i % F16G_STAGES;
  if (next < steps)
    f16_gemm_stage(as + fill * F16G_A_STAGE, bs + fill * F16G_B_STAGE, aw, bw, K, N, n0, r0, r1, next * F16G_BK, t);
  F16G_COMMIT();
  KX_UNROLL
  for (u32 s = 0; s < F16G_BK / 16; s++) acc = f16_gemm_step(acc, as + cur * F16G_A_STAGE, bs + cur * F16G_B_STAGE, w, lane, s);
}
f16_gemm_store(acc, y, N, n0, r0, r1, w, lane);
