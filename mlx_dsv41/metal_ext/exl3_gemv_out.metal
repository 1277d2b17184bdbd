// exl3_gemv_out: y [m, n] = H128(sum of the k-split partials) ⊙ svh (+ bias), the output side of a
// k-split exl3_gemv (docs/exl3.md#forward steps 4-6). Threadgroup: 8 SIMD groups for (128-column
// block KX_TGID_X, row KX_TGID_Y). SIMD group w adds splits w, w+8, ... (their loads all
// independent), then group 0 adds the 8 sums in group order and applies H128, svh and the bias.
// Template: HAS_BIAS, OUT (as exl3_gemv). The work is exl3_finish_row (exl3_matmul.h).
const u32 splits = partial_shape[0], rows = partial_shape[1], n = partial_shape[2];
KX_SHARED(float, sums, 8 * 128);
exl3_finish_row<OUT, HAS_BIAS>(partial, n, svh, bias, out, sums, splits, rows, n, KX_TGID_Y, KX_TGID_X, KX_WARP, KX_LANE);
