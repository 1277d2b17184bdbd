// moe_gate: the router in one launch (docs/design.md#grid-finish), where a launch's last
// threadgroup may finish the others' work (KX_HAS_GRID_FINISH: CUDA; Metal runs fp32_gemv, then
// moe_route): each threadgroup stores its outputs of the fp32 logits x · wᵀ as fp32_gemv does
// (fp32_gemv.h), and the last to finish does moe_route's work for every token (moe.h), in token
// order: the bytes of the two launches.
// Inputs: x [M, D], w [E, D] (E <= 1024), bias [E] float32, counters [1] uint32 (0; the launch leaves
// it 0). Outputs: logits [M, E] float32, indices [M, K] int32, weights [M, K] float32. 256 threads.
// Template: fp32_gemv's (M, COLS, SPLIT, W), moe_route's (K, TEMP_BITS, SCALE_BITS).
KX_SHARED(float, sums, 8 * 8 * 4);
KX_SHARED(u32, last, 1);
KX_SHARED(float, score, 1024);
KX_SHARED(float, key, 1024);
KX_SHARED(float, best_v, 8);
KX_SHARED(int, best_i, 8);
KX_SHARED(int, chosen, 16);
const u32 E = w_shape[0];
fp32_gemv_group<M, COLS, SPLIT, W>(fp32_rows(x, w_shape[1]), w, logits, E, w_shape[1], sums, KX_TGID_X, KX_WARP, KX_LANE);
if (grid_finish_arrival(counters, 0, fp32_gemv_groups<COLS, SPLIT>(E), last, KX_LID_X)) {
  for (u32 t = 0; t < M; t++) {
    KX_BARRIER();  // the previous token's threadgroup memory is read
    moe_route_token<K>(logits, bias, indices, weights, E, t, TEMP_BITS, SCALE_BITS, score, key, best_v, best_i, chosen,
                       KX_LID_X, KX_LANE, KX_WARP);
  }
}
