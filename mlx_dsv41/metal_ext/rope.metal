// rope: out = Q(T(rotate(N(T(x))))) for row KX_TGID_X of x [B, S, H, D] or [B, S, D] (H = 1)
// (docs/model.md#rope, docs/numerics.md#rope-launch): the interleaved pair (2k, 2k+1) of row
// (b, s, h) turns by theta = (±STEP · (offset + s)) · (1 / period[k]), with the operations of MLX's
// own GPU rope (the same expressions, cos / sin as it calls them on each backend), so the bytes are
// mx.fast.rope's. x is first rounded to T (x.astype(T) before a rope). N is the model's RMSNorm when
// NORM (weight [D], epsilon EPS_BITS) with hc_collapse_norm's operations for one stream: thread l
// sums the squares of elements l, l + 256, ... in order, the threadgroup sum is hc.h's, and each
// element is T(x · inv · weight); the identity otherwise. Q is fq_quantize (fake_quant.h) when
// QUANT, the identity otherwise. 256 threads per row, thread l holding elements l, l + 256, ...:
// a pair sits in neighbouring lanes (the partner comes by a shuffle) and a fake-quant block of
// BLOCK elements in consecutive lanes (D % 32 == 0, so every lane of a SIMD group takes the same
// trips). offset: a 0-d int32. Template: T, STEP (> 0), INVERSE (0 / 1: the angle's sign), NORM,
// EPS_BITS, QUANT (0 / 1), BLOCK, MODE, RING (0 / 1).
// RING (x [B, S, D], S <= R): out is the window ring [B, R, D] with row s of x, computed as above,
// at slot (offset + s) % R and ring's own row, copied, at every other slot (docs/cache.md#window-ring,
// docs/numerics.md#rope-launch): the cache write's two launches ride in this one. A threadgroup per
// slot of the output then; without RING, ring is not read (the launcher passes any array).
const u32 lid = KX_LID_X, lane = KX_LANE, warp = KX_WARP;
const u32 r = KX_TGID_X;
const u32 D = x_shape[x_ndim - 1], H = x_ndim == 4 ? x_shape[2] : 1, S = x_shape[1];
u64 row = (u64)r * D;
u32 s = (r / H) % S;
u64 dst = row;
KX_SHARED(float, partials, 8);
if (RING) {
  const u32 R = ring_shape[1], slot = r % R;
  s = (slot + R - (u32)KX_SCALAR(offset) % R) % R;
  if (s >= S) {  // a slot the new rows do not reach: the whole threadgroup copies it
    for (u32 d = lid; d < D; d += 256) out[dst + d] = static_cast<T>(ring[dst + d]);
    return;
  }
  row = ((u64)(r / R) * S + s) * D;
}
float inv = 1.0f;
if (NORM) {
  float acc = 0.0f;
  for (u32 d = lid; d < D; d += 256) {
    const float v = KX_TO_F32(static_cast<T>(x[row + d]));
    acc = KX_FMA(v, v, acc);
  }
  inv = 1.0f / KX_SQRT(hc_threadgroup_sum(acc, partials, lane, warp, 8) / (float)D + KX_BITS_F32(EPS_BITS));
}
const float L = (INVERSE ? -(float)STEP : (float)STEP) * (float)(KX_SCALAR(offset) + (i32)s);
for (u32 d = lid; d < D; d += 256) {
  float v = KX_TO_F32(static_cast<T>(x[row + d]));
  if (NORM) v = KX_TO_F32(static_cast<T>(v * inv * KX_TO_F32(weight[d])));
  const float other = KX_SHUFFLE_XOR(v, 1);
  const float x1 = (d & 1u) ? other : v, x2 = (d & 1u) ? v : other;
  const float theta = L * KX_ROPE_INV(period[d >> 1]);
  const float c = KX_ROPE_COS(theta), sn = KX_ROPE_SIN(theta);
  const float rotated = (d & 1u) ? x1 * sn + x2 * c : x1 * c - x2 * sn;
  float q = KX_TO_F32(static_cast<T>(rotated));
  if (QUANT) q = fq_quantize(q, BLOCK, MODE);
  out[dst + d] = static_cast<T>(q);
}
