// hc_expand_site: an mHC expand and the next site in one launch (docs/design.md#expand-site; CUDA,
// KX_HAS_GRID_FINISH): the work of hc_expand, then hc_site, with each threadgroup on one of
// fp32_gemv's SPLIT parts of K (the flat [HC·D] columns) for 8 of its outputs: it forms its part's
// new streams once into threadgroup memory (hc.h: HcExpander, each value hc_expand's; the part's
// first threadgroup also stores them), each SIMD group sums one output over the part as fp32_gemv's
// SIMD group for that (output, part) does (fp32_gemv_sums). The site's two sums of squares are
// spread over the launch too: SIMD groups take hc_mix's summing threads 32 at a time and run each
// one's chain on the new streams at its dims (hc_expanded_chain: hc_mix_token's links in its
// order), storing the chains and each dim's rounded collapse. The last threadgroup to finish adds
// each output's SPLIT part sums in part order (fp32_gemv's order) into mm and does hc_mix's work from
// the chains (hc_expand_site_token) without reading a stream. The bytes of hc_expand, then hc_site
// (or fp32_gemv, then hc_mix).
// Inputs: y [.., D], residual [.., HC, D] and mixes [.., (2+HC)·HC] as hc_expand's; fn, base, scale,
// pre [.., >= HC], weight [D], counters [1] uint32 as hc_site's. Outputs: mm, out, x as hc_site's,
// streams [.., HC, D] (hc_expand's output), scratch [M · (N · SPLIT + 2 · ORDER + D)] float32 (the
// part sums, the chains' z² and x², the rounded collapse). 256 threads; SPLIT x ceil(N / 8)
// threadgroups; 8 divides D. Template: hc_site's with COLS 1, and CAP (the chunks of eight of K's
// largest part: ceil(K / 8 / SPLIT)).
KX_SHARED(HcEight<T>, part_rows, M * CAP);
KX_SHARED(float, partials, 32);
KX_SHARED(u32, last, 1);
const u32 N = fn_shape[0], K = fn_shape[1], D = K / HC, C = K / 8;
constexpr u32 WARPS = THREADS / KX_SIMD_WIDTH;  // a threadgroup's outputs: one a SIMD group
const u32 groups = SPLIT * ((N + WARPS - 1) / WARPS);
const u32 part = KX_TGID_X % SPLIT, first_out = KX_TGID_X / SPLIT * WARPS;
const u32 c0 = part * C / SPLIT, c1 = (part + 1) * C / SPLIT;
KX_DEVICE float* parts = scratch;
KX_DEVICE float* chains = scratch + M * N * SPLIT;
KX_DEVICE float* collapse = chains + M * 2 * ORDER;
const bool aligned = KX_ALIGNED16(y) && KX_ALIGNED16(residual) && KX_ALIGNED16(streams);
const auto made = hc_expander<T, HC>(y, residual, mixes, streams, D, first_out == 0, aligned);
for (u32 c = c0 + KX_LID_X; c < c1; c += THREADS)
  for (u32 m = 0; m < M; m++) part_rows[m * CAP + c - c0] = made.make8(m, c * 8);
// the chains on the last SIMD groups: the first ones form a part's extra chunks (its C / SPLIT is
// over THREADS), so no SIMD group waits on two round trips of loads before the others
for (u32 ch = KX_TGID_X + groups * (WARPS - 1 - KX_WARP); ch < M * (ORDER / 32); ch += groups * WARPS) {
  const u32 q = ch * 32 + KX_LANE;  // summing thread q % ORDER of token q / ORDER
  hc_expanded_chain<T, HC, ORDER>(made, pre, pre_shape[pre_ndim - 1], q / ORDER, q % ORDER, chains, collapse);
}
KX_BARRIER();
const u32 n = first_out + KX_WARP;
const Fp32Sums<M, 1> sums =
    fp32_gemv_sums<M, 1, SPLIT, W>(hc_part_rows<T>(part_rows, CAP, c0), fn, N, K, n, part, n < N, KX_LANE);
if (KX_LANE == 0 && n < N)
  for (u32 m = 0; m < M; m++) parts[((u64)m * N + n) * SPLIT + part] = sums.v[m][0];
if (grid_finish_arrival(counters, 0, groups, last, KX_LID_X)) {
  for (u32 i = KX_LID_X; i < M * N; i += THREADS) mm[i] = hc_part_sum<SPLIT>(parts, i);
  for (u32 t = 0; t < M; t++)
    hc_expand_site_token<T, HC, ITERS, THREADS, ORDER, SPLIT>(parts, chains, collapse, base, scale, weight, out, x, D, t,
                                                              HC_EPS_BITS, NORM_EPS_BITS, EPS_BITS, partials, KX_LID_X,
                                                              KX_LANE, KX_WARP);
}
