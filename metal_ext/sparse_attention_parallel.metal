// Sparse attention, parallel: eight SIMD groups (256 threads) per (batch, row, head) score
// different keys of a tile; each group accumulates DIM/256 of the output columns. Same arithmetic,
// same order, same bytes as the serial kernel (sparse_attention.h).
KX_SHARED(float, sa_scores, 2 * SA_TILE);
KX_SHARED(float, sa_probs, 2 * SA_TILE);
KX_SHARED(int, sa_rows, 2 * SA_TILE);
sa_attend<DIM, 8>(q, window, pool, indices, sinks, scale, dims, out, sa_scores, sa_probs, sa_rows,
                  KX_TGID_X, KX_LID_X, KX_LANE, KX_WARP);
