// exl3_gemv's ROPE and RING (docs/design.md#roped-linears): a linear whose stored rows are turned by
// the rope kernel's code (the queries' wq_b), and a paired launch whose second linear's rows go through
// the window keys' norm, rope and fake quantization into the window ring (wkv), each with the bytes
// of the linear's launch followed by the rope kernel's.
#pragma once

// ROPE: a lane's 4 consecutive outputs y (fp32 before their rounding) at columns c0 .. c0 + 3 of row
// `row` (c0 a multiple of 4: two whole pairs) stored at out + i .. + 3 as the rope kernel would store
// them after reading the linear's output: each rounded to the output dtype (exl3_out_value), the pair
// turned at position offset + s with rope_row's expressions (rope_turn once for the pair, as the
// unrotated attention output does, then rope_value), the period of pair k of the row's D = 2 ·
// (periods) columns at period[k]; no norm, no quantization.
template <int OUT, typename TO, typename TP>
KX_INLINE void exl3_store_roped(KX_DEVICE TO* out, u64 i, const float y[4], i32 offset, u32 s,
                                const KX_DEVICE TP* period, u32 D, u32 c0) {
  const float L = rope_angle<1, 0>(offset, s);
  for (int p = 0; p < 2; p++) {
    const float x1 = exl3_out_value<OUT>(y[2 * p]), x2 = exl3_out_value<OUT>(y[2 * p + 1]);
    const RopeTurn t = rope_turn(L, KX_TO_F32(period[((c0 % D) >> 1) + p]));  // once for the pair
    exl3_store_out<OUT>(out, i + 2 * p, rope_value<TO>(x1, x2, t, 0u));
    exl3_store_out<OUT>(out, i + 2 * p + 1, rope_value<TO>(x1, x2, t, 1u));
  }
}

// RING: ring slot r (ring r / R, slot r % R) written from row ((r / R) · S + s) of y [.., D], the new
// row s it receives, by the rope kernel's window-key code (rope_row with NORM, QUANT and RING: the
// RMSNorm with weight w, the turn at position offset + s, the fake quantization in blocks of BLOCK,
// MODE), reading y through L2 (other threadgroups of the launch stored it). 256 threads; partials: 8
// floats of threadgroup memory.
template <int BLOCK, int MODE, typename T, typename TY, typename TP, typename TW, typename TR>
KX_INLINE void exl3_window_row(const KX_DEVICE TY* y, i32 offset, const KX_DEVICE TP* period,
                               const KX_DEVICE TW* w, const KX_DEVICE TR* ring, KX_DEVICE T* out, u32 r, u32 D,
                               u32 S, u32 R, u32 eps_bits, KX_THREADGROUP float* partials, u32 lid, u32 lane,
                               u32 warp) {
  rope_row<T, 1, 0, 1, 1, BLOCK, MODE, 1, true>(y, offset, period, w, ring, out, r, D, 1, S, R, eps_bits, partials,
                                                lid, lane, warp);
}
