// hc_mix: one mHC site for token KX_TGID_X (docs/model.md#mhc): the site's input and its mixes, from
// the streams [.., HC, D], the previous site's pre (the first HC columns of pre [.., W]) and
// mm = z · fnᵀ [.., (2+HC)·HC] (z = the token's HC·D streams in fp32; fp32_gemv):
//   x = rms_norm(T(Σ_i pre[i] · stream_i), weight): the collapse in fp32 (FMAs in stream order)
//     rounded to T as the reference holds it, then x · (1 / sqrt(mean(x²) + EPS)) · weight -> T;
//   inv = 1 / sqrt(mean(z²) + NORM_EPS);  m = (mm · inv) · scale[part] + base
//   pre' = sigmoid(m[0:HC]) + HC_EPS;  post = 2 · sigmoid(m[HC:2HC])
//   comb = softmax over each row of m[2HC:] viewed [HC, HC], + HC_EPS; then Sinkhorn: columns,
//   then (rows, columns) ITERS - 1 times, each x / (sum + HC_EPS).
// out: [.., (2+HC)·HC] = pre' | post | comb (row-major, comb[i][j]: old stream i -> new stream j);
// x: [.., D].
// THREADS threads (a multiple of 32, at most 1024): thread l reads dims l, l + THREADS, ... of
// every stream, four dims' loads issued before they are summed (one memory round trip per pass at
// Flash's D), and sums z² and x² in a fixed order; the collapse is recomputed for the output (the same operations give the same bits).
// SIMD group 0 then does the mixes, lane L holding comb[L / HC][L % HC] (lanes >= HC·HC mirror lanes
// L mod HC·HC): row sums are xor butterflies over masks 1 .. HC/2, column sums over masks HC ..
// HC·HC/2 (HC a power of two, HC·HC <= 32). Template: T, HC, ITERS, HC_EPS_BITS, NORM_EPS_BITS,
// EPS_BITS, THREADS, ORDER (the sums are those of ORDER threads: hc.h, hc_mix_token).
KX_SHARED(float, partials, 32);
hc_mix_token<T, HC, ITERS, THREADS, ORDER>(mm, streams, base, scale, pre, pre_shape[pre_ndim - 1], weight, out, x,
                                           streams_shape[streams_ndim - 1], KX_TGID_X, HC_EPS_BITS, NORM_EPS_BITS,
                                           EPS_BITS, partials, KX_LID_X, KX_LANE, KX_WARP);
