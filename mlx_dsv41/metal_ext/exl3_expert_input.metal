// exl3_expert_input: the input side of a linear per slot, xh[slot] = H128(fp16(x[slot] ⊙ suh[e]))
// with e = indices[slot] - LO (docs/exl3.md#forward steps 1-2), stored as fp16 pairs in the staged
// word order (exl3_store_xh) that exl3_expert_down copies in: a grouped linear (wo_a, one EXL3
// linear per group) runs as "experts" whose slot g reads group g's own input. Columns >= x's width
// are zero (the zero-extension to k). A slot whose expert is not held gets zeros (exl3_expert_down
// never reads it). Grid: x = 128-blocks of k, one SIMD group each (a threadgroup's last SIMD
// groups may have none); y = slot. No barriers.
// Inputs: x [slots, in] (float), indices [slots] int32, suh [E, k]. Output: xh [slots, k / 2]
// uint32. Template: LO (first held expert).
const u32 lane = KX_LANE;
const u32 block = KX_TGID_X * (KX_TG_SIZE_X / 32) + KX_WARP, slot = KX_TGID_Y;
const u32 k = suh_shape[1], width = x_shape[1];
const u32 n_local = suh_shape[0];
if (block * 128 < k) {
  const int e = indices[slot] - LO;
  const bool held = exl3_held(e, n_local);
  const u64 s0 = (u64)(held ? e : 0) * k;
  const u32 c0 = block * 128 + 4 * lane;
  Exl3Vec4 v;
  for (int i = 0; i < 4; i++) {
    const float xv = (c0 + i < width) ? KX_TO_F32(x[(u64)slot * width + c0 + i]) : 0.0f;
    v.v[i] = held ? exl3_round_f16(xv * KX_TO_F32(suh[s0 + c0 + i])) : 0.0f;
  }
  exl3_store_xh(xh + (u64)slot * (k / 2), block, exl3_hadamard128(v, lane), lane);
}
