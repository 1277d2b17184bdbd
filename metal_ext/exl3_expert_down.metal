// exl3_expert_down: per routed slot, y = w2_e(bf16(weight * silu(min(g, L)) * clamp(u, -L, L)))
// rounded to bf16 (the reference's w2 linear returns bf16; held in float32) for the experts of one
// (K, codebook) group of w2. The input stage finishes g and u from exl3_expert_gate_up's partials
// (split sum, H128, svh), applies the SwiGLU and the routing weight (model spec §4.5), and forms
// w2's xh (Exl3SwigluStager); the output stage applies w2's H128 and svh. Grid: x = 128-column
// blocks of the output, y = slot; threadgroups as in exl3_gemv (M = 1, all of k). Slots whose
// expert's w2 is in another group keep prev (HAS_PREV) or get 0; slots outside the held range
// get 0.
// Inputs: gu [slots, 2, splits, I], weights [T, top_k] float32, indices [T, top_k] int32,
// svh1/svh3 [E, I], suh2 [E, I], t2 [G, I/16, n/16, 16K] int16, p2 [E] int32, svh2 [E, n],
// prev [slots, n] float32. Output: out [slots, n] float32. Template: K2, CB, NC, NW, STAGES, XSW,
// HAS_PREV, LO (first held expert), INTER (true intermediate size), LIMIT_BITS (the SwiGLU limit's
// float32 bits; <= 0: no clamp).
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, slot = KX_TGID_Y;
const u32 splits = gu_shape[2], inter_padded = gu_shape[3];
const u32 n_local = p2_shape[0];
const u32 tiles_k = t2_shape[1], tiles_n = t2_shape[2];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const int e = indices[slot] - LO;
const int pos = (e >= 0 && e < (int)n_local) ? p2[e] : -2;
const u64 base = (u64)slot * n + col_block * 128;
if (pos < 0) {
  for (u32 i = KX_LID_X; i < 128; i += NW * 32) out[base + i] = (HAS_PREV && pos == -1) ? prev[base + i] : 0.0f;
  return;
}
KX_SHARED16(u32, ring, EXL3_RING_WORDS(K2, STAGES, NW, NC, 1));
KX_SHARED(u32, xs, XSW);

const KX_DEVICE u32* src = (const KX_DEVICE u32*)t2 + (u64)pos * tiles_k * row_words + col_block * 32 * K2;
const u64 mid = (u64)e * inter_padded;
const Exl3Acc<1, NC> acc = exl3_product<K2, CB, 1, NC, NW, STAGES, XSW>(
    src, row_words, tiles_k / 8,
    exl3_swiglu_stager(gu + (u64)slot * 2 * splits * inter_padded, splits, inter_padded, (u32)INTER, svh1 + mid,
                       svh3 + mid, suh2 + mid, weights[slot], KX_BITS_F32(LIMIT_BITS)),
    ring, xs, warp, lane);
KX_BARRIER();  // ys reuses the trellis ring
KX_THREADGROUP float* ys = (KX_THREADGROUP float*)ring;
exl3_store_acc<1, NC, NW>(ys, acc, warp, lane);
KX_BARRIER();
if (warp == 0) {
  const Exl3Vec4 v = exl3_hadamard128(exl3_ys_row<1, EXL3_KG(NW, NC)>(ys, 0, lane), lane);
  for (int i = 0; i < 4; i++) {
    const u32 col = col_block * 128 + 4 * lane + i;
    out[base + 4 * lane + i] = exl3_round_bf16(v.v[i] * KX_TO_F32(svh2[(u64)e * n + col]));  // bf16 y_e
  }
}
