// Sparse attention, parallel: eight SIMD groups (256 threads) per (batch, row, head) score
// different keys of a tile; each group accumulates DIM/8 of the output dims. Same arithmetic,
// same order, same bytes as the serial kernel (sparse_attention.h).
constexpr int GROUPS = 8;
KX_SHARED(sa_shared<GROUPS>, sa_memory, 1);
sa_kernel<DIM, GROUPS, PREFETCH>(q, window, pool, indices, sinks, scale, dims, out, sa_memory,
                                 KX_TGID_X, KX_LANE, KX_WARP);
