// Sparse attention, serial: one SIMD group (32 threads) per (batch, row, head) scores a tile's
// keys one after another and accumulates all DIM/32 output columns (sparse_attention.h).
KX_SHARED(float, sa_scores, 2 * SA_TILE);
KX_SHARED(float, sa_probs, 2 * SA_TILE);
KX_SHARED(int, sa_rows, 2 * SA_TILE);
sa_attend<DIM, 1>(q, window, pool, indices, sinks, scale, dims, out, sa_scores, sa_probs, sa_rows,
                  KX_TGID_X, KX_LID_X, KX_LANE, KX_WARP);
