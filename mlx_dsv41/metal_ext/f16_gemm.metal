// f16_gemm: y[r, :] = a[r, :] · b[g(r)] for fp16 a [M, K] and a stack of fp16 b [G, K, N], every
// product exact and every sum in fp32, y float32 (docs/exl3.md#many-row-gemm): the EXL3 product
// xh · W̃ of a prefill (G = 1) or of the routed experts over their sorted slots (one b per expert).
// Row tiles: tiles[t] = (first row, end row, g) of BM rows at most, all of one b; the host builds
// them (one expert's slots never share a tile with another's). K % BK == 0, N % BN == 0.
// Threadgroup (256 threads, 8 SIMD groups) = one row tile x BN columns; SIMD group w owns rows
// 32 (w / 4) .. +32 and columns 32 (w % 4) .. +32 of it: 2 x 4 MMA tiles of 16 x 8. Per BK step
// the threadgroup stages a's BM x BK rows and b's BK x BN block (transposed, k pairs in one word)
// in threadgroup memory, then each SIMD group runs BK / 16 k16 steps (f16_gemm.h).
const u32 K = a_shape[1], N = b_shape[2];
const u32 n0 = KX_TGID_X * F16G_BN;
const i32 r0 = tiles[3 * KX_TGID_Y], r1 = tiles[3 * KX_TGID_Y + 1], g = tiles[3 * KX_TGID_Y + 2];
KX_SHARED16(u32, as, F16G_BM * F16G_AS_WORDS);
KX_SHARED(u32, bs, F16G_BN * F16G_BS_WORDS);
const u32 t = KX_LID_X, lane = KX_LANE, w = KX_WARP;
const KX_DEVICE u32* aw = (const KX_DEVICE u32*)a;
const KX_DEVICE u32* bw = (const KX_DEVICE u32*)b + (u64)g * K * N / 2;
// staging: thread t copies a's row t / 4, words 4 (t % 4) .. +4 of the step (8 fp16), and b's k
// rows 2 (t / 16), +1 at columns 8 (t % 16) .. +8, paired along k
const u32 a_row = t / 4, a_word = 4 * (t % 4), b_pair = t / 16, b_col = 8 * (t % 16);
F16GemmAcc acc = f16_gemm_zero();
for (u32 k0 = 0; k0 < K; k0 += F16G_BK) {
  u32 av[4] = {0u, 0u, 0u, 0u};
  if (r0 + (i32)a_row < r1) KX_LOAD_U32X4(aw + ((u64)(r0 + a_row) * K + k0) / 2 + a_word, av);
  u32 lo[4], hi[4];
  KX_LOAD_U32X4(bw + ((u64)(k0 + 2 * b_pair) * N + n0 + b_col) / 2, lo);
  KX_LOAD_U32X4(bw + ((u64)(k0 + 2 * b_pair + 1) * N + n0 + b_col) / 2, hi);
  KX_BARRIER();  // the previous step's reads are done
  for (int j = 0; j < 4; j++) as[a_row * F16G_AS_WORDS + a_word + j] = av[j];
  for (int j = 0; j < 4; j++) {
    bs[(b_col + 2 * j) * F16G_BS_WORDS + b_pair] = KX_PACK_LO16(lo[j], hi[j]);
    bs[(b_col + 2 * j + 1) * F16G_BS_WORDS + b_pair] = KX_PACK_LO16(lo[j] >> 16, hi[j] >> 16);
  }
  KX_BARRIER();
  for (u32 s = 0; s < F16G_BK / 16; s++) acc = f16_gemm_step(acc, as, bs, w, lane, s);
}
f16_gemm_store(acc, y, N, n0, r0, r1, w, lane);
