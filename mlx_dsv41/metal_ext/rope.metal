// rope: out = Q(T(rotate(T(x)))) for element KX_TID_X of x [B, S, H, D] or [B, S, D] (H = 1) (docs/model.md#rope,
// docs/numerics.md#rope-launch): the interleaved pair (2k, 2k+1) of row (b, s, h) turns by
// theta = (±STEP · (offset + s)) · (1 / period[k]), with the operations of MLX's own GPU rope (the
// same expressions, cos / sin as it calls them on each backend), so the bytes are mx.fast.rope's.
// x is first rounded to T (x.astype(T) before a rope); Q is fq_quantize (fake_quant.h) when QUANT,
// the identity otherwise. One thread per element (each computes its pair's angle): a block of
// BLOCK elements sits in consecutive lanes, as fake_quant needs.
// offset: a 0-d int32. Template: T, STEP (> 0), INVERSE (0 / 1: the angle's sign), QUANT (0 / 1),
// BLOCK, MODE.
const u32 i = KX_TID_X;
const u32 D = x_shape[x_ndim - 1], H = x_ndim == 4 ? x_shape[2] : 1, S = x_shape[1];
const u32 n = x_shape[0] * S * H * D;
const bool live = i < n;
float v = 0.0f;
if (live) {
  const u32 r = i / D, d = i - r * D;
  const u32 first = i - (d & 1u);
  const float x1 = KX_TO_F32(static_cast<T>(x[first]));
  const float x2 = KX_TO_F32(static_cast<T>(x[first + 1]));
  const float L = (INVERSE ? -(float)STEP : (float)STEP) * (float)(KX_SCALAR(offset) + (i32)((r / H) % S));
  const float theta = L * KX_ROPE_INV(period[d >> 1]);
  const float c = KX_ROPE_COS(theta), sn = KX_ROPE_SIN(theta);
  const float rotated = (d & 1u) ? x1 * sn + x2 * c : x1 * c - x2 * sn;
  v = KX_TO_F32(static_cast<T>(rotated));
}
if (QUANT) v = fq_quantize(v, BLOCK, MODE);
if (live) out[i] = static_cast<T>(v);
