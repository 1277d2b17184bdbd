// Sparse attention with a per-head sink: the one implementation behind both kernels.
//
//   out[b,s,h] = sum_j exp(l_j - m) kv_j / (sum_j exp(l_j - m) + exp(sink_h - m)),
//   l_j = q[b,s,h] . kv_j * scale, j over indices[b,s,:] (spec 4.3)
//
// sparse_attention_serial.metal runs sa_attend with GROUPS = 1 (one SIMD group per (batch, row,
// head)); sparse_attention_parallel.metal with GROUPS = 8 (256 threads). GROUPS changes only who
// does a step, never the arithmetic of any value:
// - lane L holds dims {32c + L : c < DIM/32}, so 32-wide output column c is dim 32c + lane;
// - a logit is the lane's fma chain over c = 0, 1, ..., then an xor butterfly 16, 8, 4, 2, 1, by
//   whichever group scores that key; scores go through threadgroup memory in both kernels;
// - per tile of 64 keys every thread reads the scores in key order: tile max, rescale factor,
//   exp per key (computed once per key into threadgroup memory), tile sum in key order;
// - each output element is its own fma chain over the tile's keys in key order, merged into the
//   running value with one fma by the rescale factor; a SIMD group owns DIM/32/GROUPS columns.
// So every output element sees the same operations on the same operands in the same order.
//
// Nonfinite inputs follow the float64 formula above: the running maximum starts at the sink (so
// the sink is the first "key", value-less); while the maximum is -inf, exp(x - 0) is used so that
// -inf logits give 0 instead of exp(-inf + inf) = NaN; NaN logits or sinks make every output of
// their (b, s, h) NaN through the sum. An index outside [-1, W + T) is invalid: its logit is NaN
// (loud, and nothing out of range is read). -1 is skipped: no value is read for it.
#pragma once

#define SA_TILE 64    // keys per tile
#define SA_LANES 32   // lanes per SIMD group
#define SA_SKIP (-1)  // index meaning "no key"
// Floats a lane loads together before using them (latency hiding; no effect on the order of
// any arithmetic): key rows for scoring, values for the accumulation.
#define SA_SCORE_FLOATS 64
#define SA_VALUE_FLOATS 32

// Plain float operations that no compiler may fuse into an fma, so that a kernel's surroundings
// (inlining, unrolling) cannot change a rounding: CUDA's _rn intrinsics are never contracted;
// Metal contracts only within one statement under math_mode "safe" (and here not at all).
#if defined(KX_CUDA)
#define SA_ADD(a, b) __fadd_rn((a), (b))
#define SA_SUB(a, b) __fsub_rn((a), (b))
#define SA_MUL(a, b) __fmul_rn((a), (b))
#define SA_DIV(a, b) __fdiv_rn((a), (b))
#else
#pragma METAL fp contract(off)
#define SA_ADD(a, b) ((a) + (b))
#define SA_SUB(a, b) ((a) - (b))
#define SA_MUL(a, b) ((a) * (b))
#define SA_DIV(a, b) metal::precise::divide((a), (b))
#endif

// What exp(x - base) subtracts: the running maximum, or 0 while it is -inf (then every logit
// so far is -inf and its weight must be 0, not exp(-inf - -inf) = NaN).
KX_INLINE float sa_exp_base(float m) { return m == -KX_INF_F32 ? 0.0f : m; }

// Factor that carries sums made relative to m_old over to m_new. Equal maxima (including
// -inf == -inf) need no rescale; a NaN maximum gives NaN.
KX_INLINE float sa_rescale(float m_old, float m_new) {
  return m_new == m_old ? 1.0f : KX_EXP(SA_SUB(m_old, m_new));
}

// A key row exists for idx (-1 and out-of-range indices have none).
KX_INLINE bool sa_readable(int idx, int rows) { return idx >= 0 && idx < rows; }

// Row `idx` of window ∪ pool for batch b: idx < W reads window[b, idx], else pool[b, idx - W].
template <int DIM, typename KP>
KX_INLINE KP sa_key_row(KP window, KP pool, u32 b, int W, int T, int idx) {
  return idx < W ? window + ((i64)b * W + idx) * DIM : pool + ((i64)b * T + (idx - W)) * DIM;
}

// One (batch, row, head) per threadgroup of GROUPS SIMD groups. dims = [W, T, N, H, S].
// scores / probs / rows: 2 * SA_TILE entries each in threadgroup memory (two tiles alternate,
// which lets one barrier per phase suffice).
template <int DIM, int GROUPS, typename QP, typename KP, typename IP, typename SP, typename FP,
          typename DP, typename OP>
KX_INLINE void sa_attend(QP q, KP window, KP pool, IP indices, SP sinks, FP scale_arr, DP dims,
                         OP out, KX_THREADGROUP float* scores, KX_THREADGROUP float* probs,
                         KX_THREADGROUP int* rows, u32 block, u32 tid, u32 lane, u32 group) {
  constexpr int COLS = DIM / SA_LANES;     // dims per lane = 32-wide output columns
  constexpr int OWN = COLS / GROUPS;       // columns this SIMD group accumulates
  constexpr int THREADS = GROUPS * SA_LANES;
  constexpr int SCORE_BATCH = COLS >= SA_SCORE_FLOATS ? 1 : SA_SCORE_FLOATS / COLS;  // keys
  constexpr int VALUE_BATCH = OWN >= SA_VALUE_FLOATS ? 1 : SA_VALUE_FLOATS / OWN;    // keys
  const int W = dims[0], T = dims[1], N = dims[2], H = dims[3], S = dims[4];
  const u32 h = block % (u32)H;
  const u32 row = block / (u32)H;  // b * S + s
  const u32 b = row / (u32)S;
  const i64 q0 = (i64)block * DIM;
  const i64 idx0 = (i64)row * N;

  // Scale folded into q: each logit is then the plain dot product (no multiply left to fuse).
  const float scale = scale_arr[0];
  float qs[COLS];
  for (int c = 0; c < COLS; ++c) qs[c] = SA_MUL(KX_TO_F32(q[q0 + c * SA_LANES + lane]), scale);

  // Running state, relative to the maximum m; the sink is its first member (denominator only).
  float m = sinks[h];
  float sum = KX_EXP(SA_SUB(m, sa_exp_base(m)));
  float acc[OWN];
  for (int k = 0; k < OWN; ++k) acc[k] = 0.0f;

  int parity = 0;
  for (int t0 = 0; t0 < N; t0 += SA_TILE, parity ^= 1) {
    const int n = N - t0 < SA_TILE ? N - t0 : SA_TILE;
    KX_THREADGROUP float* tile_scores = scores + parity * SA_TILE;
    KX_THREADGROUP float* tile_probs = probs + parity * SA_TILE;
    KX_THREADGROUP int* tile_rows = rows + parity * SA_TILE;

    // 1. Scores: SIMD group g takes keys g, g + GROUPS, ..., SCORE_BATCH at a time so that
    //    their loads are in flight together (per key the arithmetic is the same either way).
    for (int j0 = (int)group; j0 < n; j0 += GROUPS * SCORE_BATCH) {
      int key[SCORE_BATCH];
      float vals[SCORE_BATCH][COLS];
      for (int u = 0; u < SCORE_BATCH; ++u) {
        const int j = j0 + u * GROUPS;
        key[u] = j < n ? indices[idx0 + t0 + j] : SA_SKIP;
        if (sa_readable(key[u], W + T)) {
          KP kv = sa_key_row<DIM>(window, pool, b, W, T, key[u]);
          for (int c = 0; c < COLS; ++c) vals[u][c] = KX_TO_F32(kv[c * SA_LANES + lane]);
        }
      }
      for (int u = 0; u < SCORE_BATCH; ++u) {
        const int j = j0 + u * GROUPS;
        if (j >= n) break;
        float logit = key[u] == SA_SKIP ? -KX_INF_F32 : KX_NAN_F32;  // NaN: invalid index
        if (sa_readable(key[u], W + T)) {  // uniform per SIMD group: the shuffles are safe
          float part = 0.0f;
          for (int c = 0; c < COLS; ++c) part = KX_FMA(qs[c], vals[u][c], part);
          for (u32 mask = SA_LANES / 2; mask > 0; mask >>= 1)
            part = SA_ADD(part, KX_SHUFFLE_XOR(part, mask));
          logit = part;
        }
        if (lane == 0) {
          tile_scores[j] = logit;
          tile_rows[j] = sa_readable(key[u], W + T) ? key[u] : SA_SKIP;
        }
      }
    }
    KX_BARRIER();

    // 2. Every thread: the new maximum (key order; fmax may drop a NaN logit, whose weight below
    //    is NaN anyway), the rescale factor, and each key's weight, computed once.
    float m_new = m;
    for (int j = 0; j < n; ++j) m_new = KX_FMAX(m_new, tile_scores[j]);
    const float alpha = sa_rescale(m, m_new);
    const float base = sa_exp_base(m_new);
    for (int j = (int)tid; j < n; j += THREADS)
      tile_probs[j] = KX_EXP(SA_SUB(tile_scores[j], base));
    KX_BARRIER();

    // 3. Tile sums in key order: the denominator (every thread) and this group's columns, whose
    //    values are loaded VALUE_BATCH keys at a time (the fma order stays key order).
    float tile_sum = 0.0f;
    float tile_acc[OWN];
    for (int k = 0; k < OWN; ++k) tile_acc[k] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += VALUE_BATCH) {
      float vals[VALUE_BATCH][OWN];
      for (int u = 0; u < VALUE_BATCH; ++u) {
        const int r = j0 + u < n ? tile_rows[j0 + u] : SA_SKIP;
        if (r != SA_SKIP) {
          KP kv = sa_key_row<DIM>(window, pool, b, W, T, r);
          for (int k = 0; k < OWN; ++k)
            vals[u][k] = KX_TO_F32(kv[((int)group * OWN + k) * SA_LANES + lane]);
        }
      }
      for (int u = 0; u < VALUE_BATCH && j0 + u < n; ++u) {
        const float p = tile_probs[j0 + u];
        tile_sum = SA_ADD(tile_sum, p);
        if (tile_rows[j0 + u] == SA_SKIP) continue;
        for (int k = 0; k < OWN; ++k) tile_acc[k] = KX_FMA(p, vals[u][k], tile_acc[k]);
      }
    }
    sum = KX_FMA(sum, alpha, tile_sum);
    for (int k = 0; k < OWN; ++k) acc[k] = KX_FMA(acc[k], alpha, tile_acc[k]);
    m = m_new;
  }

  for (int k = 0; k < OWN; ++k)
    out[q0 + ((int)group * OWN + k) * SA_LANES + lane] = SA_DIV(acc[k], sum);
}
