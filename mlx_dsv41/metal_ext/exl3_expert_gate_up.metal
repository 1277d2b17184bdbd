// exl3_expert_gate_up: for each routed slot, the k-split partial sums (before the output transform)
// of g = w1_e·x and u = w3_e·x for the experts of one (K, codebook) group (docs/exl3.md#forward
// steps 1-3, one row each; only the selected experts' tiles are read). Grid: x = 128-column blocks
// of the intermediate dim, y = k split, z = 2*slot + (0: w1, 1: w3); threadgroups as in exl3_gemv
// (M = 1). Slots whose expert has this projection in another group keep prev (HAS_PREV) or get 0,
// as do slots outside the held range; launches for the other groups fill them in turn.
// With FINISH (where KX_HAS_GRID_FINISH; the last group's launch) the last threadgroup to store
// partials for a (slot, column block) -- 2 * SPLITS arrive -- also does exl3_expert_swiglu's work
// for that block (exl3_swiglu_block: the same bytes) into xh; counters[slot * blocks + block]
// counts the arrivals and is left at 0 (scratch state of w1, as exl3_gemv's). Without FINISH, xh
// is a 1-element stand-in and weights, svh1, svh3, suh2, counters are never read.
// Inputs: x [T, in] (or its T rows under other leading dims), indices [T, top_k] int32, suh1/suh3 [E, k],
// t1/t3 [G, k/16, n/16, 16K] int16 (this group's stacks), p1/p3 [E] int32 (local expert -> index in
// the stack, or EXL3_SLOT_*),
// prev [slots, 2, splits, n] float32, weights [T, top_k] float32, svh1/svh3/suh2 [E, n],
// counters [>= slots * n / 128] uint32. Outputs: out [slots, 2, splits, n] float32, xh
// [slots, n / 2] uint32. Template: K2, CB, NC, NW, STAGES, XSW, HAS_PREV, LO (first held expert),
// PER_SPLIT (128-blocks of k per split), SPLITS, FINISH, SHARED, INTER, LIMIT_BITS
// (exl3_expert_swiglu's), K2S, CBS, STAGES_S (below).
// With SHARED (FINISH only: the MoE's last launch, docs/design.md#shared-in-routed) the grid also
// holds the shared expert, one slot per token after the routed slots (slot routed + t), from its own
// stack of one expert at its own K and codebook (K2S, CBS, STAGES_S: s1 / s3 [1, k/16, n/16, 16K],
// ssuh1 / ssuh3 [1, k], ssvh1 / ssvh3 / ssuh2 [1, n], sidx [T, 1] zeros, sw [T, 1] ones): the same
// operations as its own one-slot launch, into rows routed + t of out and xh. Without SHARED those
// inputs are stand-ins, never read.
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, split = KX_TGID_Y;
const u32 slot = KX_TGID_Z >> 1, mat = KX_TGID_Z & 1u;
const u32 top_k = indices_shape[1], in_features = x_shape[x_ndim - 1];  // x: the tokens' rows, any leading dims
const u32 n_local = p1_shape[0];
const u32 tiles_k = t1_shape[1], tiles_n = t1_shape[2];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const u32 per_split = (u32)PER_SPLIT, splits = (u32)SPLITS;
const u32 routed = indices_shape[0] * top_k;
const bool shared = SHARED && slot >= routed;  // uniform over the threadgroup
const u32 token = shared ? slot - routed : slot / top_k;
const int e = shared ? 0 : indices[slot] - LO;
const int pos = shared ? 0 : exl3_stack_position(e, n_local, mat ? p3 : p1);
const u64 base = (((u64)slot * 2 + mat) * splits + split) * n + col_block * 128;
KX_SHARED16(u32, ring, EXL3_MAX_WORDS(EXL3_RING_WORDS(K2, STAGES, NW, NC, 1),
                                      SHARED ? EXL3_RING_WORDS(K2S, STAGES_S, NW, NC, 1) : 0));
KX_SHARED(u32, xs, XSW);
KX_SHARED(u32, last, 1);  // FINISH: whether this threadgroup is its (slot, column block)'s last
if (pos < 0) {
  // Uniform over the threadgroup: no product.
  exl3_pass_slot<HAS_PREV, NW>(out, prev, base, pos, KX_LID_X);
} else {
  const u32 kb_begin = split * per_split;
  const u32 nb = min(per_split, tiles_k / 8 - kb_begin);
  Exl3Acc<1, NC> acc;
  if (SHARED && shared) {
    const u32 words = tiles_n * 4 * K2S;
    acc = exl3_product<K2S, CBS, 1, NC, NW, STAGES_S, XSW, PER_SPLIT>(
        (const KX_DEVICE u32*)(mat ? s3 : s1) + (u64)kb_begin * 8 * words + col_block * 32 * K2S, words, nb,
        exl3_input_stager<1, XSW>(x + (u64)token * in_features, mat ? ssuh3 : ssuh1, 1u, in_features, kb_begin), ring,
        xs, warp, lane);
  } else {
    const KX_DEVICE u32* src = (const KX_DEVICE u32*)(mat ? t3 : t1) +
                               ((u64)pos * tiles_k + (u64)kb_begin * 8) * row_words + col_block * 32 * K2;
    acc = exl3_product<K2, CB, 1, NC, NW, STAGES, XSW, PER_SPLIT>(
        src, row_words, nb,
        exl3_input_stager<1, XSW>(x + (u64)token * in_features, (mat ? suh3 : suh1) + (u64)e * tiles_k * 16, 1u,
                             in_features, kb_begin),
        ring, xs, warp, lane);
  }
  exl3_store_partials<NC, NW>(out, base, acc, ring, warp, lane, KX_LID_X);
}
if (FINISH && KX_HAS_GRID_FINISH) {
  const u32 blocks = tiles_n / 8;
  if (grid_finish_arrival(counters, (u64)slot * blocks + col_block, 2 * splits, last, KX_LID_X) && warp == 0) {
    if (SHARED && shared)  // the shared expert's own launch, one slot per token: rows routed + t
      exl3_swiglu_block<SPLITS>((const KX_DEVICE float*)out + (u64)routed * 2 * splits * n, sw, sidx, ssvh1, ssvh3,
                                ssuh2, xh + (u64)routed * (n / 2), n, 1u, 0, (u32)INTER, KX_BITS_F32(LIMIT_BITS),
                                token, col_block, lane);
    else
      exl3_swiglu_block<SPLITS>((const KX_DEVICE float*)out, weights, indices, svh1, svh3, suh2, xh, n, n_local, LO,
                                (u32)INTER, KX_BITS_F32(LIMIT_BITS), slot, col_block, lane);
  }
}
