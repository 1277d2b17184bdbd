// exl3_expert_swiglu: w2's input xh for every routed slot, once (exl3_expert_down's threadgroups
// then stage it by a copy): g and u finished from exl3_expert_gate_up's partials, the routed SwiGLU
// and w2's input transform (exl3_swiglu_xh), stored as fp16 pairs in the staged word order
// (exl3_store_xh). Slots whose expert is not held get zeros (exl3_expert_down never reads them).
// Grid: x = 128-blocks of the intermediate dim, one SIMD group each (a threadgroup's last SIMD
// groups may have none); y = slot. No barriers: SIMD groups are independent.
// Inputs: gu [slots, 2, splits, I] float32, weights [T, top_k] float32, indices [T, top_k] int32,
// svh1/svh3 [E, I], suh2 [E, I]. Output: xh [slots, I / 2] uint32.
// Template: LO (first held expert), INTER (true intermediate size), LIMIT_BITS (the SwiGLU limit's
// float32 bits; 0: no clamp), SPLITS (gu's k splits).
const u32 lane = KX_LANE;
const u32 block = KX_TGID_X * (KX_TG_SIZE_X / 32) + KX_WARP, slot = KX_TGID_Y;
const u32 inter_padded = gu_shape[3];
const u32 n_local = svh1_shape[0];
KX_DEVICE u32* row = xh + (u64)slot * (inter_padded / 2);
if (block * 128 < inter_padded) {
  // No branch on the expert: the compiler would sink the partials' loads into it, after
  // indices[slot]'s round trip (exl3_load_gate_up). A slot whose expert is not held computes with
  // expert LO's vectors and stores zeros.
  const Exl3GateUp<SPLITS> parts = exl3_load_gate_up<SPLITS>(gu + (u64)slot * 2 * SPLITS * inter_padded, inter_padded,
                                                             block, lane);
  const float weight = weights[slot];
  const int e = indices[slot] - LO;
  const bool held = exl3_held(e, n_local);
  const u64 mid = (u64)(held ? e : 0) * inter_padded;
  Exl3Vec4 v = exl3_swiglu_xh<SPLITS>(parts, (u32)INTER, svh1 + mid, svh3 + mid, suh2 + mid, weight,
                                      KX_BITS_F32(LIMIT_BITS), block, lane);
  for (int i = 0; i < 4; i++) v.v[i] = held ? v.v[i] : 0.0f;
  exl3_store_xh(row, block, v, lane);
}
