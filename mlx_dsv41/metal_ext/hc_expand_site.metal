// hc_expand_site: an mHC expand and the next site in one launch (docs/design.md#expand-site; CUDA,
// KX_HAS_GRID_FINISH): hc_site (hc_site.metal) whose streams are formed as its fp32_gemv reads them
// (hc.h: HcExpandRows, each value hc_expand's): every threadgroup forms the values it reads,
// threadgroup 0's first SIMD groups (one fp32_gemv output's, which read each value once) also store
// them, and the last threadgroup to finish reads them back through L2 for hc_mix's work. The bytes
// of hc_expand, then hc_site (or fp32_gemv, then hc_mix).
// Inputs: y [.., D], residual [.., HC, D] and mixes [.., (2+HC)·HC] as hc_expand's; fn, base, scale,
// pre [.., >= HC], weight [D], counters [1] uint32 as hc_site's. Outputs: mm, out, x as hc_site's,
// then streams [.., HC, D] (hc_expand's output). 256 threads; 8 divides D. Template: hc_site's.
KX_SHARED(float, sums, 8 * 8 * 4);
KX_SHARED(float, partials, 32);
KX_SHARED(u32, last, 1);
const u32 N = fn_shape[0], K = fn_shape[1], D = K / HC;
const bool writes = KX_TGID_X == 0 && KX_WARP < SPLIT;  // one output's SIMD groups: each value once
const bool aligned = KX_ALIGNED16(y) && KX_ALIGNED16(residual) && KX_ALIGNED16(streams);
// four chunks a pass: a chunk's loads are HC + 1 vectors (8 of them would hold ~160 registers)
fp32_gemv_group<M, COLS, SPLIT, W, 4>(hc_expand_rows<T, HC>(y, residual, mixes, streams, D, writes, aligned), fn, mm,
                                      N, K, sums, KX_TGID_X, KX_WARP, KX_LANE);
if (grid_finish_arrival(counters, 0, fp32_gemv_groups<COLS, SPLIT>(N), last, KX_LID_X)) {
  for (u32 t = 0; t < M; t++) {
    KX_BARRIER();  // the previous token's threadgroup memory is read
    hc_mix_token<T, HC, ITERS, THREADS, ORDER, true>(mm, (const KX_DEVICE T*)streams, base, scale, pre,
                                                     pre_shape[pre_ndim - 1], weight, out, x, D, t, HC_EPS_BITS,
                                                     NORM_EPS_BITS, EPS_BITS, partials, KX_LID_X, KX_LANE, KX_WARP);
  }
}
