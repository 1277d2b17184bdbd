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
KX_SHARED(float, partials, 8);
rope_row<T, STEP, INVERSE, NORM, QUANT, BLOCK, MODE, RING>(
    x, KX_SCALAR(offset), period, weight, ring, out, KX_TGID_X, x_shape[x_ndim - 1], x_ndim == 4 ? x_shape[2] : 1,
    x_shape[1], RING ? ring_shape[1] : 1, EPS_BITS, partials, KX_LID_X, KX_LANE, KX_WARP);
