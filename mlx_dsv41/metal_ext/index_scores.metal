// index_scores: the lightning indexer's scores of query rows (docs/design.md#index-select), IX_TILE
// entries of one row per threadgroup (grid x: the entry tiles, y: the rows), `ix_score_tile`. With
// FINISH (KX_HAS_GRID_FINISH: CUDA) the last threadgroup of a row to store its scores then does
// index_select's work for that row (`ix_select_row`): the bytes of the two launches.
// Inputs: q [R, HI, DI] (roped and fake-quantized), weights [R, HI] (weights_proj's output), keys
// [B, T, DI] (the index keys of the KV source; R = B · S), position (0-d int32: the first row's
// position), candidates [R, NC] bool (MODE 2; otherwise not read), counters [>= R] uint32 zeros
// (FINISH; the launch leaves them 0), rows [S, LEAD] int32 (LEAD > 0; otherwise not read). Outputs:
// scores [R, T] float32, topk [R, K] int32, blocks [R, ceil(T / BLOCK)] bool (MODE 1), list
// [R, LEAD + K] int32 (LEAD > 0: the attention's index list, docs/design.md#index-list); topk,
// blocks and list are written only with FINISH.
// Template: HI (<= 32), DI (a multiple of 32), S, RATIO, SCALE_BITS (the weights' scale), K, MODE
// (0: plain, 1: the candidate source, 2: inside the candidate blocks), BLOCK, KEEP, LEAD, PLUS,
// FINISH. 256 threads.
KX_SHARED(float, qs, IX_HEADS * DI);
KX_SHARED(float, ws, IX_HEADS);
KX_SHARED(u32, tmp, IX_SCRATCH);
const u32 T = keys_shape[1];
const i32 first = KX_SCALAR(position);
ix_score_tile<HI, DI>(q, weights, keys, scores, T, S, first, RATIO, KX_BITS_F32(SCALE_BITS), KX_TGID_X, KX_TGID_Y, qs,
                      ws, KX_LID_X, KX_LANE, KX_WARP);
if (FINISH && grid_finish_arrival(counters, KX_TGID_Y, (T + IX_TILE - 1) / IX_TILE, tmp + IX_SCRATCH - 1, KX_LID_X)) {
  ix_select_row<K, MODE, BLOCK, KEEP, LEAD, PLUS>(scores, candidates, candidates_shape[1], topk, blocks, rows, list, T,
                                                  S, first, RATIO, KX_TGID_Y, tmp, KX_LID_X, KX_LANE, KX_WARP);
}
