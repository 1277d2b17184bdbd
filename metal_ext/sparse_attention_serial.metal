// Sparse attention, serial: one SIMD group (32 threads) per (batch, row, head) scores a tile's
// keys eight at a time and accumulates every output dim itself (sparse_attention.h).
constexpr int GROUPS = 1;
KX_SHARED(sa_shared<GROUPS>, sa_memory, 1);
sa_kernel<DIM, GROUPS, PREFETCH>(q, window, pool, indices, sinks, scale, dims, out, sa_memory,
                                 KX_TGID_X, KX_LANE, KX_WARP);
