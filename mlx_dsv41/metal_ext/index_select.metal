// index_select: index_scores' selection as its own launch, where a launch cannot finish itself
// (Metal): one threadgroup per query row (grid x), `ix_select_row` (docs/design.md#index-select).
// Inputs: scores [R, T] float32 (index_scores'), position (0-d int32), candidates [R, NC] bool
// (MODE 2; otherwise not read), rows [S, LEAD] int32 (LEAD > 0; otherwise not read). Outputs: topk
// [R, K] int32, blocks [R, ceil(T / BLOCK)] bool (MODE 1), list [R, LEAD + K] int32 (LEAD > 0).
// Template: S, RATIO, K, MODE, BLOCK, KEEP, LEAD, PLUS. 256 threads.
KX_SHARED(u32, tmp, IX_SCRATCH);
ix_select_row<K, MODE, BLOCK, KEEP, LEAD, PLUS>(scores, candidates, candidates_shape[1], topk, blocks, rows, list,
                                                scores_shape[1], S, KX_SCALAR(position), RATIO, KX_TGID_X, tmp,
                                                KX_LID_X, KX_LANE, KX_WARP);
