// hc_collapse_norm: x = rms_norm(T(Σ_i pre[i] · stream_i), weight) for token KX_TGID_X
// (docs/model.md#mhc collapse, docs/numerics.md#dtypes RMSNorm). The collapse in fp32 (FMAs in
// stream order), rounded to T as the reference holds it; the norm in fp32 over D: x · (1 /
// sqrt(mean(x²) + EPS)) · weight, rounded to T. 256 threads; the collapse is recomputed in the
// second pass (the same operations give the same bits) rather than kept. streams [.., HC, D] (or
// [.., D] when HC is 1), pre: the first HC columns of [.., W]. Template: T (stream and output
// dtype), HC, EPS_BITS.
const u32 lid = KX_LID_X, lane = KX_LANE, warp = KX_WARP;
const u32 t = KX_TGID_X;
const u32 D = streams_shape[streams_ndim - 1], pre_w = pre_shape[pre_ndim - 1];
KX_SHARED(float, partials, 8);
float p[HC];
for (int i = 0; i < HC; i++) p[i] = pre[(u64)t * pre_w + i];
const u64 base_row = (u64)t * HC * D;
float acc = 0.0f;
for (u32 d = lid; d < D; d += 256) {
  float c = p[0] * KX_TO_F32(streams[base_row + d]);
  for (int i = 1; i < HC; i++) c = KX_FMA(p[i], KX_TO_F32(streams[base_row + (u64)i * D + d]), c);
  const float x = KX_TO_F32(static_cast<T>(c));
  acc = KX_FMA(x, x, acc);
}
const float sumsq = hc_threadgroup_sum(acc, partials, lane, warp, 8);
const float inv = 1.0f / KX_SQRT(sumsq / (float)D + KX_BITS_F32(EPS_BITS));
for (u32 d = lid; d < D; d += 256) {
  float c = p[0] * KX_TO_F32(streams[base_row + d]);
  for (int i = 1; i < HC; i++) c = KX_FMA(p[i], KX_TO_F32(streams[base_row + (u64)i * D + d]), c);
  const float x = KX_TO_F32(static_cast<T>(c));
  out[(u64)t * D + d] = static_cast<T>(x * inv * KX_TO_F32(weight[d]));
}
