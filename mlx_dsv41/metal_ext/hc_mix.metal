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
// EPS_BITS, THREADS.
const u32 lid = KX_LID_X, lane = KX_LANE, warp = KX_WARP;
const u32 t = KX_TGID_X;
const u32 D = streams_shape[streams_ndim - 1], pre_w = pre_shape[pre_ndim - 1];
const u32 mix_width = (2 + HC) * HC;
KX_SHARED(float, partials, 32);
float p[HC];
KX_UNROLL for (int i = 0; i < HC; i++) p[i] = pre[(u64)t * pre_w + i];
const u64 first = (u64)t * HC * D;
float zsq = 0.0f, xsq = 0.0f;
for (u32 d0 = lid; d0 < D; d0 += 4 * THREADS) {
  float v[4][HC];
  KX_UNROLL for (u32 u = 0; u < 4; u++) {
    const u32 d = d0 + u * THREADS;
    KX_UNROLL for (int i = 0; i < HC; i++) v[u][i] = d < D ? KX_TO_F32(streams[first + (u64)i * D + d]) : 0.0f;
  }
  KX_UNROLL for (u32 u = 0; u < 4; u++) {
    if (d0 + u * THREADS < D) {
      float c = p[0] * v[u][0];
      KX_UNROLL for (int i = 1; i < HC; i++) c = KX_FMA(p[i], v[u][i], c);
      const float x = KX_TO_F32(static_cast<T>(c));
      xsq = KX_FMA(x, x, xsq);
      KX_UNROLL for (int i = 0; i < HC; i++) zsq = KX_FMA(v[u][i], v[u][i], zsq);
    }
  }
}
const float z_sumsq = hc_threadgroup_sum(zsq, partials, lane, warp, THREADS / 32);
const float x_sumsq = hc_threadgroup_sum(xsq, partials, lane, warp, THREADS / 32);
const float x_inv = 1.0f / KX_SQRT(x_sumsq / (float)D + KX_BITS_F32(EPS_BITS));
for (u32 d0 = lid; d0 < D; d0 += 4 * THREADS) {
  float c[4];
  KX_UNROLL for (u32 u = 0; u < 4; u++) {
    const u32 d = d0 + u * THREADS;
    float v[HC];
    KX_UNROLL for (int i = 0; i < HC; i++) v[i] = d < D ? KX_TO_F32(streams[first + (u64)i * D + d]) : 0.0f;
    c[u] = p[0] * v[0];
    KX_UNROLL for (int i = 1; i < HC; i++) c[u] = KX_FMA(p[i], v[i], c[u]);
  }
  KX_UNROLL for (u32 u = 0; u < 4; u++) {
    const u32 d = d0 + u * THREADS;
    if (d < D) x[(u64)t * D + d] = static_cast<T>(KX_TO_F32(static_cast<T>(c[u])) * x_inv * KX_TO_F32(weight[d]));
  }
}
if (warp == 0) {
  const float inv = 1.0f / KX_SQRT(z_sumsq / (float)(HC * D) + KX_BITS_F32(NORM_EPS_BITS));
  const float hc_eps = KX_BITS_F32(HC_EPS_BITS);
  const u64 row = (u64)t * mix_width;
  if (lane < HC) {
    const float a = KX_FMA(mm[row + lane] * inv, scale[0], base[lane]);
    const float b = KX_FMA(mm[row + HC + lane] * inv, scale[1], base[HC + lane]);
    out[row + lane] = 1.0f / (1.0f + KX_EXP(-a)) + hc_eps;
    out[row + HC + lane] = 2.0f / (1.0f + KX_EXP(-b));
  }
  const u32 k = lane % (HC * HC);
  float c = KX_FMA(mm[row + 2 * HC + k] * inv, scale[2], base[2 * HC + k]);
  float top = c;
  for (u32 m = 1; m < HC; m <<= 1) top = KX_FMAX(top, KX_SHUFFLE_XOR(top, m));
  c = KX_EXP(c - top);
  float s = c;
  for (u32 m = 1; m < HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
  c = c / s + hc_eps;
  s = c;
  for (u32 m = HC; m < HC * HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
  c = c / (s + hc_eps);
  for (int it = 1; it < ITERS; it++) {
    s = c;
    for (u32 m = 1; m < HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
    c = c / (s + hc_eps);
    s = c;
    for (u32 m = HC; m < HC * HC; m <<= 1) s += KX_SHUFFLE_XOR(s, m);
    c = c / (s + hc_eps);
  }
  if (lane < HC * HC) out[row + 2 * HC + lane] = c;
}
