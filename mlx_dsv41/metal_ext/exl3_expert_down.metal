// exl3_expert_down: per routed slot, the k-split partial sums (before w2's output transform) of
// w2_e(h) for the experts of one (K, codebook) group of w2 (docs/exl3.md#forward steps 1-3): w2's
// input xh (exl3_expert_swiglu: the routed SwiGLU product, its input transform done) is staged by a
// copy; with STAGE_X the input is the slot's row of x [slots, in] (float; a grouped linear, wo_a,
// whose group g runs as expert g) and each threadgroup forms its k range of xh = H128(fp16(x ⊙
// suh[e])) itself, as exl3_expert_gate_up does (docs/exl3.md#forward steps 1-2). Grid: x = 128-column blocks of the output, y = k split, z = slot; threadgroups as in
// exl3_gemv (M = 1). Slots whose expert's w2 is in another group keep prev (HAS_PREV) or get 0,
// as do slots outside the held range; exl3_expert_down_finish adds the splits and applies H128,
// svh2 and the bf16 rounding. With FINISH (where KX_HAS_GRID_FINISH; the last group's launch) the
// last threadgroup to store partials for a (slot, column block) -- SPLITS arrive -- does that
// itself (exl3_down_finish_block: the same bytes) into y; counters as in exl3_expert_gate_up.
// Without FINISH, y is a 1-element stand-in and svh2, add, counters are never read.
// Inputs: xh [slots, I / 2] uint32 (STAGE_X: x [slots, in] float), indices [T, top_k] int32, t2
// [G, I/16, n/16, 16K] int16, p2 [E] int32, prev [slots, SPLITS, n] float32, svh2 [E, n], add
// (ADD: [T, k, n] fp32, see exl3_expert_down_finish), counters [>= slots * n / 128] uint32, suh2
// [E, I] (read with STAGE_X only). Outputs: out [slots, SPLITS, n] float32, y [slots, n] in T.
// Template: K2, CB, NC, NW, STAGES, XSW, HAS_PREV, LO (first held expert), PER_SPLIT (128-blocks
// of k per split), SPLITS, FINISH, SHARED, T, TM, ADD, STAGE_X, X_WIDTH (STAGE_X: x's row width),
// K2S, CBS, STAGES_S (below).
// With SHARED (FINISH, T = float, no ADD, no STAGE_X: the MoE's last launch,
// docs/design.md#shared-in-routed) the grid also holds the shared expert, one slot per token after
// the routed slots (slot routed + t, xh row routed + t), from its own stack of one expert (K2S,
// CBS, STAGES_S: s2 [1, I/16, n/16, 16K], ssvh2 [1, n], sidx [T, 1] zeros): its y row finished as
// its own launch finishes it (exl3_down_finish_block). Each finished y row of token t then counts
// at counters2[t * n / 128 + column block]; the last of the token's top_k + 1 does the MoE's
// output moe [T, n] in TM (exl3_moe_combine: the ADD finish's sums). Without SHARED, s2, ssvh2,
// sidx and counters2 are stand-ins and moe is a 1-element stand-in, never read or written.
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, split = KX_TGID_Y, slot = KX_TGID_Z;
const u32 n_local = p2_shape[0];
const u32 tiles_k = t2_shape[1], tiles_n = t2_shape[2];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const u32 top_k = indices_shape[1], routed = indices_shape[0] * top_k;
const bool shared = SHARED && slot >= routed;  // uniform over the threadgroup
const u32 token = shared ? slot - routed : slot / top_k;
const int e = shared ? 0 : indices[slot] - LO;
const int pos = shared ? 0 : exl3_stack_position(e, n_local, p2);
const u64 base = ((u64)slot * SPLITS + split) * n + col_block * 128;
KX_SHARED16(u32, ring, EXL3_MAX_WORDS(EXL3_RING_WORDS(K2, STAGES, NW, NC, 1),
                                      SHARED ? EXL3_RING_WORDS(K2S, STAGES_S, NW, NC, 1) : 0));
KX_SHARED(u32, xs, XSW);
KX_SHARED(u32, last, 1);  // FINISH: whether this threadgroup is its (slot, column block)'s last
if (pos < 0) {
  // Uniform over the threadgroup: no product.
  exl3_pass_slot<HAS_PREV, NW>(out, prev, base, pos, KX_LID_X);
} else {
  const u32 kb_begin = split * (u32)PER_SPLIT;
  const u32 nb = min((u32)PER_SPLIT, tiles_k / 8 - kb_begin);
  const KX_DEVICE u32* src = (const KX_DEVICE u32*)t2 + ((u64)pos * tiles_k + (u64)kb_begin * 8) * row_words +
                             col_block * 32 * K2;
  Exl3Acc<1, NC> acc;
  if (SHARED && shared) {
    const u32 words = tiles_n * 4 * K2S;
    acc = exl3_product<K2S, CBS, 1, NC, NW, STAGES_S, XSW, PER_SPLIT>(
        (const KX_DEVICE u32*)s2 + (u64)kb_begin * 8 * words + col_block * 32 * K2S, words, nb,
        exl3_copy_stager((const KX_DEVICE u32*)xh + (u64)slot * tiles_k * 8, kb_begin), ring, xs, warp, lane);
  } else if (STAGE_X) {
    const u32 width = X_WIDTH;  // the rows' width (x may arrive in any shape holding them)
    acc = exl3_product<K2, CB, 1, NC, NW, STAGES, XSW, PER_SPLIT>(
        src, row_words, nb, exl3_input_stager<1, XSW>(xh + (u64)slot * width, suh2 + (u64)e * tiles_k * 16, 1u, width, kb_begin),
        ring, xs, warp, lane);
  } else {
    acc = exl3_product<K2, CB, 1, NC, NW, STAGES, XSW, PER_SPLIT>(
        src, row_words, nb, exl3_copy_stager((const KX_DEVICE u32*)xh + (u64)slot * tiles_k * 8, kb_begin), ring, xs,
        warp, lane);
  }
  exl3_store_partials<NC, NW>(out, base, acc, ring, warp, lane, KX_LID_X);
}
if (FINISH && KX_HAS_GRID_FINISH) {
  const u32 blocks = tiles_n / 8;
  const bool finishes = grid_finish_arrival(counters, (u64)slot * blocks + col_block, (u32)SPLITS, last, KX_LID_X);
  if (finishes && warp == 0) {
    if (SHARED && shared)  // the shared expert's own launch, one slot per token: row routed + t
      exl3_down_finish_block<SPLITS, false>((const KX_DEVICE float*)out + (u64)routed * SPLITS * n, sidx, ssvh2, add, 0u,
                                            y + (u64)routed * n, n, 1u, 0, token, col_block, lane);
    else
      exl3_down_finish_block<SPLITS, ADD>((const KX_DEVICE float*)out, indices, svh2, add, ADD ? add_shape[1] : 0u, y,
                                          n, svh2_shape[0], LO, slot, col_block, lane);
  }
  // (finishes is uniform over the threadgroup: every thread takes the second count's barriers)
  if (SHARED && finishes && grid_finish_arrival(counters2, (u64)token * blocks + col_block, top_k + 1, last, KX_LID_X) &&
      warp == 0)
    exl3_moe_combine((const KX_DEVICE float*)y, moe, top_k, routed, n, token, col_block, lane);
}
