// sparse_attention_unrotated: the serial (GROUPS 1) or parallel (GROUPS 8) sparse attention kernel
// whose output is rounded to T and turned back at its query position in the same launch (the
// output's conjugate rotation: rope.metal with INVERSE and STEP 1; docs/numerics.md#unrotated-output):
// the bytes of that kernel's float32 output, then the rope kernel's. Inputs: the attention kernels'
// (q, window, pool, indices, sinks), period [D / 2] float32 (rope's whole-width periods), offset (a
// 0-d int32: query row 0's position). Output: out [B, S, H, D] in T. Template: the attention
// kernels' (DIM, PREFETCH, HAS_*, SCALE_BITS), GROUPS (1 / 8), T.
KX_SHARED(sa_shared<GROUPS>, sa_memory, 1);
const sa_dims dims = {HAS_WINDOW ? window_shape[1] : 0, HAS_POOL ? pool_shape[1] : 0, HAS_INDICES ? indices_shape[2] : 0,
                      q_shape[2], q_shape[1], KX_BITS_F32(SCALE_BITS)};
sa_kernel<DIM, GROUPS, PREFETCH>(q, window, pool, indices, sinks, dims,
                                 sa_unrotated(out, period, KX_SCALAR(offset), DIM, q_shape[2], q_shape[1]), sa_memory,
                                 KX_TGID_X, KX_LANE, KX_WARP);
