// hc_site: one mHC site in one launch (docs/design.md#grid-finish), where a launch's last
// threadgroup may finish the others' work (KX_HAS_GRID_FINISH: CUDA; Metal runs fp32_gemv, then
// hc_mix): each threadgroup stores its outputs of mm = z · fnᵀ as fp32_gemv does (fp32_gemv.h; z the
// M tokens' streams [M, HC·D], fn [(2+HC)·HC, HC·D]), and the last to finish does hc_mix's work for
// every token (hc.h), in token order: the bytes of the two launches.
// Inputs: streams [.., HC, D], fn, base, scale, pre [.., >= HC], weight [D] as hc_mix's, counters [1]
// uint32 (0; the launch leaves it 0). Outputs: mm [M, (2+HC)·HC] float32, out and x as hc_mix's.
// 256 threads. Template: fp32_gemv's (M, COLS, SPLIT, W), hc_mix's (T, HC, ITERS, HC_EPS_BITS,
// NORM_EPS_BITS, EPS_BITS, THREADS = 256, ORDER = hc_mix's threads: the sums in its order).
KX_SHARED(float, sums, 8 * 8 * 4);
KX_SHARED(float, partials, 32);
KX_SHARED(u32, last, 1);
const u32 N = fn_shape[0], K = fn_shape[1];
fp32_gemv_group<M, COLS, SPLIT, W>(fp32_rows(streams, K), fn, mm, N, K, sums, KX_TGID_X, KX_WARP, KX_LANE);
if (grid_finish_arrival(counters, 0, fp32_gemv_groups<COLS, SPLIT>(N), last, KX_LID_X)) {
  for (u32 t = 0; t < M; t++) {
    KX_BARRIER();  // the previous token's threadgroup memory is read
    hc_mix_token<T, HC, ITERS, THREADS, ORDER>(mm, streams, base, scale, pre, pre_shape[pre_ndim - 1], weight, out, x,
                                               K / HC, t, HC_EPS_BITS, NORM_EPS_BITS, EPS_BITS, partials, KX_LID_X,
                                               KX_LANE, KX_WARP);
  }
}
