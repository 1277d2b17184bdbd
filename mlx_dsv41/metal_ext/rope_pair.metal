// rope_pair: two ropes at the same positions in one launch (docs/numerics.md#rope-launch): the
// queries' and the window keys' (their RMSNorm, fake quantization and ring write), each row with the
// bytes of its own rope launch (rope.h: rope_row). Threadgroups [0, B·S·Hq) do rope's work for the
// rows of q [B, S, Hq, D] with the plain rope (the cast to T, the rotation: NORM, QUANT and RING 0)
// into q_out; the others do rope's work for x with this launch's template (rope.metal), row
// KX_TGID_X - B·S·Hq, into out. Inputs: q, then rope's (x, offset, period, weight, ring); q and x
// share the periods (D wide), T, STEP and INVERSE. 256 threads. Template: rope's.
KX_SHARED(float, partials, 8);
const u32 q_rows = q_shape[0] * q_shape[1] * q_shape[2];
if (KX_TGID_X < q_rows) {
  rope_row<T, STEP, INVERSE, 0, 0, BLOCK, MODE, 0>(q, KX_SCALAR(offset), period, weight, period, q_out, KX_TGID_X,
                                                   q_shape[3], q_shape[2], q_shape[1], 1, EPS_BITS, partials, KX_LID_X,
                                                   KX_LANE, KX_WARP);
} else {
  rope_row<T, STEP, INVERSE, NORM, QUANT, BLOCK, MODE, RING>(
      x, KX_SCALAR(offset), period, weight, ring, out, KX_TGID_X - q_rows, x_shape[x_ndim - 1],
      x_ndim == 4 ? x_shape[2] : 1, x_shape[1], RING ? ring_shape[1] : 1, EPS_BITS, partials, KX_LID_X, KX_LANE,
      KX_WARP);
}
