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
HcVals<HC> p;
for (int i = 0; i < HC; i++) p.v[i] = pre[(u64)t * pre_w + i];
hc_rms_norm_row(hc_collapse_row<T>(streams + (u64)t * HC * D, D, p), weight, out + (u64)t * D, D, KX_BITS_F32(EPS_BITS), partials, lid, lane, warp);
