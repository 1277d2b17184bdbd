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
if (block * 128 < inter_padded)
  exl3_swiglu_block<SPLITS>(gu, weights, indices, svh1, svh3, suh2, xh, inter_padded, svh1_shape[0], LO, (u32)INTER,
                            KX_BITS_F32(LIMIT_BITS), slot, block, lane);
