// Sparse attention, parallel: eight SIMD groups (256 threads) per (batch, row, head) score
// different keys of a tile; each group accumulates DIM/8 of the output dims. Same arithmetic,
// same order, same bytes as the serial kernel (sparse_attention.h).
constexpr int GROUPS = 8;
KX_SHARED(sa_shared<GROUPS>, sa_memory, 1);
// Sizes from the shapes (an empty input arrives as a stand-in: HAS_* false), scale from its bits.
const sa_dims dims = {HAS_WINDOW ? window_shape[1] : 0, HAS_POOL ? pool_shape[1] : 0, HAS_INDICES ? indices_shape[2] : 0,
                      q_shape[2], q_shape[1], KX_BITS_F32(SCALE_BITS)};
sa_kernel<DIM, GROUPS, PREFETCH>(q, window, pool, indices, sinks, dims, out, sa_memory,
                                 KX_TGID_X, KX_LANE, KX_WARP);
