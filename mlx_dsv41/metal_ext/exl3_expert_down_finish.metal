// exl3_expert_down_finish: y [slot] = bf16(H128(the k-split partials of exl3_expert_down added in
// split order) ⊙ svh2[e]) for the held slots, 0 for the others (docs/exl3.md#forward steps 4-6; the
// reference's w2 linear returns bf16, held here in float32). One SIMD group per 128-column block
// (a threadgroup's last SIMD groups may have none) and slot (KX_TGID_Y); no barriers.
// Inputs: partial [slots, SPLITS, n] float32, indices [T, top_k] int32, svh2 [E, n], add.
// Output: out [slots, n] in T (float32, or bfloat16 for a grouped linear's bf16 output: the same
// values). With ADD (the shared expert: one slot per token), out is the MoE's output instead
// (docs/model.md#moe): T((Σ_s add[t, s] in slot order) + y[t]), add [T, k, n] the routed slots in
// fp32, the sum in fp32 as the reference adds them. Template: T, LO (first held expert), SPLITS (a
// constant, so that every partial's load is issued before the first sum), ADD.
const u32 lane = KX_LANE;
const u32 col_block = KX_TGID_X * (KX_TG_SIZE_X / 32) + KX_WARP, slot = KX_TGID_Y;
const u32 n = partial_shape[2];
const u32 n_local = svh2_shape[0];
if (col_block * 128 < n) {
  const u32 c0 = col_block * 128 + 4 * lane;
  // Latency-bound: the partials' loads do not depend on the slot's expert and are issued together
  // with indices[slot]'s (no branch on the expert, which the compiler would sink them into); a slot
  // whose expert is not held computes with expert LO's svh2 and stores 0.
  const Exl3Splits<SPLITS> t = exl3_load_splits<SPLITS>(partial + (u64)slot * SPLITS * n + c0, n);
  const int e = indices[slot] - LO;
  const bool held = exl3_held(e, n_local);
  float sv[4];  // loaded whether or not the slot is held: no branch around each load
  for (int i = 0; i < 4; i++) sv[i] = KX_TO_F32(svh2[(u64)(held ? e : 0) * n + c0 + i]);
  const Exl3Vec4 s = exl3_hadamard128(exl3_sum_splits<SPLITS>(t), lane);
  KX_DEVICE T* y = out + (u64)slot * n + c0;
  if (ADD) {
    const u32 k = add_shape[1];
    const u64 routed = (u64)slot * k * n + c0;  // add is an fp32 [T, k, n] here (another array without ADD)
    for (int i = 0; i < 4; i++) {
      float acc = KX_TO_F32(add[routed + i]);
      for (u32 r = 1; r < k; r++) acc += KX_TO_F32(add[routed + (u64)r * n + i]);
      y[i] = static_cast<T>(acc + exl3_round_bf16(s.v[i] * sv[i]));
    }
  } else {
    for (int i = 0; i < 4; i++) y[i] = static_cast<T>(held ? exl3_round_bf16(s.v[i] * sv[i]) : 0.0f);
  }
}
