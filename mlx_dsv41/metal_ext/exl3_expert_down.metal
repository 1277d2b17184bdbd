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
// of k per split), SPLITS, FINISH, T, ADD, STAGE_X.
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, split = KX_TGID_Y, slot = KX_TGID_Z;
const u32 n_local = p2_shape[0];
const u32 tiles_k = t2_shape[1], tiles_n = t2_shape[2];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const int e = indices[slot] - LO;
const int pos = exl3_stack_position(e, n_local, p2);
const u64 base = ((u64)slot * SPLITS + split) * n + col_block * 128;
KX_SHARED16(u32, ring, EXL3_RING_WORDS(K2, STAGES, NW, NC, 1));
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
  if (STAGE_X) {
    const u32 width = xh_shape[1];
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
  if (exl3_finish_arrival(counters, (u64)slot * (tiles_n / 8) + col_block, (u32)SPLITS, last, KX_LID_X) && warp == 0)
    exl3_down_finish_block<SPLITS, ADD>((const KX_DEVICE float*)out, indices, svh2, add, ADD ? add_shape[1] : 0u, y, n,
                                        svh2_shape[0], LO, slot, col_block, lane);
}
