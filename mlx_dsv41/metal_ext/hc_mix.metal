// hc_mix: one mHC site's mixes for token KX_TGID_X (docs/model.md#mhc), from mm = z · fnᵀ [T,
// (2+HC)·HC] (z = the token's HC·D streams in fp32; an MLX matmul) and the streams themselves:
//   inv = 1 / sqrt(mean(z²) + NORM_EPS);  m = (mm · inv) · scale[part] + base
//   pre = sigmoid(m[0:HC]) + HC_EPS;  post = 2 · sigmoid(m[HC:2HC])
//   comb = softmax over each row of m[2HC:] viewed [HC, HC], + HC_EPS; then Sinkhorn: columns,
//   then (rows, columns) ITERS - 1 times, each x / (sum + HC_EPS).
// out: [T, (2+HC)·HC] = pre | post | comb (row-major, comb[i][j]: old stream i -> new stream j).
// Threadgroup: 256 threads reduce z² in a fixed order; SIMD group 0 then does the rest, lane L
// holding comb[L / HC][L % HC] (lanes >= HC·HC mirror lanes L mod HC·HC): row sums are xor
// butterflies over masks 1 .. HC/2, column sums over masks HC .. HC·HC/2 (HC a power of two, HC·HC
// <= 32). Template: HC, ITERS, HC_EPS_BITS, NORM_EPS_BITS.
const u32 lid = KX_LID_X, lane = KX_LANE, warp = KX_WARP;
const u32 t = KX_TGID_X;
const u32 width = streams_shape[1];
const u32 mix_width = (2 + HC) * HC;
KX_SHARED(float, partials, 8);
float acc = 0.0f;
for (u32 i = lid; i < width; i += 256) {
  const float v = KX_TO_F32(streams[(u64)t * width + i]);
  acc = KX_FMA(v, v, acc);
}
const float sumsq = hc_threadgroup_sum(acc, partials, lane, warp, 8);
if (warp == 0) {
  const float inv = 1.0f / KX_SQRT(sumsq / (float)width + KX_BITS_F32(NORM_EPS_BITS));
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
