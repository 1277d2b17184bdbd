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
if (col_block * 128 < n)
  // add is an fp32 [T, k, n] with ADD (another array, never read, without)
  exl3_down_finish_block<SPLITS, ADD>(partial, indices, svh2, add, ADD ? add_shape[1] : 0u, out, n, svh2_shape[0], LO,
                                      slot, col_block, lane);
