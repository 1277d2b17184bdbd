// exl3_expert_down: per routed slot, y = w2_e(bf16(weight * silu(min(g, L)) * clamp(u, -L, L)))
// in float32 for the experts of one (K, codebook) group of w2. The input stage finishes g and u
// from exl3_expert_gate_up's partials (split sum, H128, svh), applies the SwiGLU and the routing
// weight (model spec §4.5), and forms w2's xh (exl3_stage_swiglu); the output stage applies w2's
// H128 and svh. Grid: x = 128-column blocks of the output, y = slot; threadgroups as in exl3_gemv
// (M = 1). Slots whose expert's w2 is in another group keep prev (HAS_PREV) or get 0; slots
// outside the held range get 0.
// Inputs: gu [slots, 2, splits, I], weights [T, top_k] float32, indices [T, top_k] int32,
// svh1/svh3 [E, I], suh2 [E, I], t2 [G, I/16, n/16, 16K] int16, p2 [E] int32, svh2 [E, n],
// limit [1] float32 (<= 0: no clamp), prev [slots, n] float32, params [2] = (first held expert,
// true intermediate size). Output: out [slots, n] float32. Template: K2, CB, WPC, HAS_PREV.
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 col_block = KX_TGID_X, slot = KX_TGID_Y;
const u32 splits = gu_shape[2], inter_padded = gu_shape[3];
const u32 n_local = p2_shape[0];
const u32 tiles_k = t2_shape[1], tiles_n = t2_shape[2];
const u32 n = tiles_n * 16, row_words = tiles_n * 4 * K2;
const int e = indices[slot] - params[0];
const int pos = (e >= 0 && e < (int)n_local) ? p2[e] : -2;
const u64 base = (u64)slot * n + col_block * 128;
if (pos < 0) {
  for (u32 i = KX_LID_X; i < 128; i += 256 * WPC) out[base + i] = (HAS_PREV && pos == -1) ? prev[base + i] : 0.0f;
  return;
}
KX_SHARED(u32, xs, EXL3_XS_WORDS);
KX_SHARED(float, ys, WPC * 128);

const Exl3Lane l = exl3_lane<K2>(lane);
const u32 kgroup = warp / 8, col0 = (warp % 8) * 16;
const KX_DEVICE u32* column = (const KX_DEVICE u32*)t2 + (u64)pos * tiles_k * row_words +
                              (u64)(col_block * 8 + warp % 8) * (4 * K2);
const u64 mid = (u64)e * inter_padded;
Exl3Acc<1> acc = exl3_acc_zero<1>();
for (u32 kb = 0; kb < tiles_k / 8; kb += EXL3_CHUNK_BLOCKS(1)) {
  const u32 nb = min((u32)EXL3_CHUNK_BLOCKS(1), tiles_k / 8 - kb);
  KX_BARRIER();
  exl3_stage_swiglu(xs, gu + (u64)slot * 2 * splits * inter_padded, splits, inter_padded, (u32)params[1],
                    svh1 + mid, svh3 + mid, suh2 + mid, weights[slot], limit[0], kb, nb, warp, 8 * WPC, lane);
  KX_BARRIER();
  acc = exl3_tile_column<K2, CB, 1, WPC>(acc, column + (u64)kb * 8 * row_words, row_words, xs, nb * 8, kgroup, l, lane);
}
exl3_store_acc<1>(ys, exl3_acc_finish<1>(acc, lane), kgroup, col0, lane);
KX_BARRIER();
if (warp == 0) {
  const Exl3Vec4 v = exl3_hadamard128(exl3_ys_row<1, WPC>(ys, 0, lane), lane);
  for (int i = 0; i < 4; i++) {
    const u32 col = col_block * 128 + 4 * lane + i;
    out[base + 4 * lane + i] = v.v[i] * KX_TO_F32(svh2[(u64)e * n + col]);
  }
}
