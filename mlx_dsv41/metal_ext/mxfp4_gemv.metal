// mxfp4_gemv: y[g·M + m, n] = Σ_k x[r_g + m, k] · W_e[n, k] for row groups g = (r_g, e) of slots,
// with W_e expert e's mxfp4 weight (E2M1 codes, element k of a row at bits 4 (k % 8) of word k / 8,
// one E8M0 scale per 32) decoded exactly, every product and sum in fp32, y float32
// (docs/numerics.md#mxfp4-gemv). A dense linear is one group (0, 0) of M <= 8 rows sharing the
// weight reads; routed experts are one group per slot (its token's row, its expert), M = 1.
// A threadgroup owns COLS consecutive outputs of one group; its S = threads / 32 SIMD groups split
// k (mxfp4.h: mxfp4_gemv_tg, the order of operations). The launcher takes S from K alone, so a
// row's bytes are the same solo or batched.
// Template: M (1..8), COLS (M · COLS <= 32). x [., K] float32, fp16 or bf16; w uint32 [E, N, K/8];
// scales uint8 [E, N, K/32]; slots int32 [G, 2]; y [G·M, N].
const u32 grp = KX_TGID_Y, n0 = KX_TGID_X * COLS, S = KX_TG_SIZE_X / KX_SIMD_WIDTH, sg = KX_WARP, lane = KX_LANE;
KX_SHARED(float, red, 8 * M * COLS);  // S <= 8
const u32 N = w_shape[1], KW = w_shape[2], r0 = (u32)slots[2 * grp], e = (u32)slots[2 * grp + 1];
if (MXFP4_ALIGNED16(x))
  mxfp4_gemv_tg<true, M, COLS>(x, w, scales, y, N, KW, r0, e, grp, n0, S, sg, lane, red);
else
  mxfp4_gemv_tg<false, M, COLS>(x, w, scales, y, N, KW, r0, e, grp, n0, S, sg, lane, red);
