// Sparse attention with a per-head sink: the one implementation behind both kernels.
//
//   out[b,s,h] = sum_j exp(l_j - m) kv_j / (sum_j exp(l_j - m) + exp(sink_h - m)),
//   l_j = q[b,s,h] . kv_j * scale, j over indices[b,s,:] (docs/model.md#sparse-softmax)
//
// sparse_attention_serial.metal runs sa_attend with GROUPS = 1 (one SIMD group per (batch, row,
// head)); sparse_attention_parallel.metal with GROUPS = 8 (256 threads). GROUPS changes only who
// does a step and in which registers, never the arithmetic of any value. Per tile of 64 keys:
// - logit (a SIMD group scores 8 keys at once; serial: 8 batches, parallel: one per group): lane
//   L holds dims {256c + 8L + e : c < DIM/256, e < 8} (16-byte loads) and its partial is the fma
//   chain over (c, e) in order from 0; the lanes are summed by the tree of the xor butterfly 16,
//   8, 4, 2, 1, done "transposed" (at masks 16, 8, 4 a lane keeps half of its keys, so 8 keys
//   cost 9 shuffles, not 40; same tree, same roundings);
// - maximum: each batch's maximum by an xor fmax over its lanes, folded left to right over the
//   batches in key order (serial: in the lane; parallel: group maxima through threadgroup
//   memory), then m_new = fmax(m, tile maximum). fmax drops NaN and a maximum is exact;
// - weights p_j = exp(l_j - base) by lane j % 32 of every group; tile sum = the xor-butterfly
//   tree over lanes of (p_L + p_{L+32}), taken from lane 0; sum = fma(sum, alpha, tile sum);
// - values: CHAINS = 2048 / DIM running sums per output element (4 at DIM 512), chain r over the
//   keys j = r (mod CHAINS) in key order: at each tile acc_r = acc_r * alpha, then
//   acc_r = fma(p_j, kv_j[d], acc_r) for those keys; at the end out = (pairwise tree over r of
//   acc_r) / sum, ((acc_0 + acc_1) + (acc_2 + acc_3)) at DIM 512. The serial lane keeps every
//   chain of its logit dims; in a parallel group, which owns DIM/8 dims, lane (sub, r) =
//   (L % (32/CHAINS), L / (32/CHAINS)) keeps chain r of 8 dims, so it loads 16 bytes per key and
//   reads every CHAINS-th key; the chains meet by shuffles, the lane of chain 0 adding on the
//   right as the serial lane does.
// Every output element thus sees the same operations on the same operands in the same order.
// Where a device returns one canonical NaN (CUDA) the bytes are identical; where NaN payloads
// propagate, NaN outputs may differ in payload (C++ does not fix operand order for a NaN).
//
// Nonfinite inputs follow the float64 formula above: the running maximum starts at the sink (so
// the sink is the first "key", value-less); while the maximum is -inf, exp(x - 0) is used so that
// -inf logits give 0 instead of exp(-inf + inf) = NaN; NaN logits or sinks make every output of
// their (b, s, h) NaN through the sum. An index outside [-1, W + T) is invalid: its logit is NaN
// (loud, and nothing out of range is read). -1 is skipped: no value is read for it; its value
// term is fma(0, +0, acc) = acc (acc starts at +0, and round-to-nearest sums of it are never -0).
//
// Loads are 16-byte vectors when q, window and pool start 16-byte aligned (every MLX allocation
// over 8 bytes does; rows are DIM elements apart); an input view that starts elsewhere runs the
// same arithmetic with element loads. CUDA checks the pointers; Metal takes alignment as given.
#pragma once

#define SA_TILE 64    // keys per tile
#define SA_LANES 32   // lanes per SIMD group
#define SA_SKIP (-1)  // index meaning "no key"
#define SA_BATCH 8    // keys a SIMD group scores together (one transposed reduction)
#define SA_VEC 8      // row elements per vector load (16 bytes of bf16)
#define SA_UNROLL _Pragma("unroll")  // loops whose arrays must stay in registers

// Whether a pointer allows 16-byte vector loads (Metal takes alignment as given).
#if defined(KX_METAL)
#define SA_ALIGNED16(p) true
#else
#define SA_ALIGNED16(p) KX_ALIGNED16(p)
#endif

// What exp(x - base) subtracts: the running maximum, or 0 while it is -inf (then every logit
// so far is -inf and its weight must be 0, not exp(-inf - -inf) = NaN).
KX_INLINE float sa_exp_base(float m) { return m == -KX_INF_F32 ? 0.0f : m; }

// Factor that carries sums made relative to m_old over to m_new. Equal maxima (including
// -inf == -inf) need no rescale; a NaN maximum gives NaN.
KX_INLINE float sa_rescale(float m_old, float m_new) {
  return m_new == m_old ? 1.0f : KX_EXP(KX_FSUB(m_old, m_new));
}

// A key row exists for idx (-1 and out-of-range indices have none).
KX_INLINE bool sa_readable(int idx, int rows) { return idx >= 0 && idx < rows; }

// The logit of a key without a row: -inf for -1 (weight 0), NaN for an invalid index.
KX_INLINE float sa_rowless_logit(int idx) { return idx == SA_SKIP ? -KX_INF_F32 : KX_NAN_F32; }

// Batch b's rows of window ∪ pool, offset by one lane's column `at`, as two bases that both
// take the index itself: row idx < W is window + idx * DIM, else pool + idx * DIM (pool's base
// is moved back by W rows, so that a row costs a compare, two selects and one multiply-add).
template <typename KP>
struct sa_rows {
  KP window, pool;
  int W;
};

template <int DIM, typename KP>
KX_INLINE sa_rows<KP> sa_rows_at(KP window, KP pool, u32 b, int W, int T, int at) {
  sa_rows<KP> r;
  r.window = window + ((i64)b * W * DIM + at);
  r.pool = pool + (((i64)b * T - W) * DIM + at);  // never read below pool[b, 0]: idx >= W there
  r.W = W;
  return r;
}

template <int DIM, typename KP>
KX_INLINE KP sa_row(sa_rows<KP> rows, int idx) {
  return (idx < rows.W ? rows.window : rows.pool) + (i64)idx * DIM;
}

// SA_VEC consecutive row elements as loaded: bf16 pairs (first element in the low half, words
// 0..3) or fp32 bits (words 0..7). Kept raw until used, so a load in flight costs 4 registers.
struct sa_chunk {
  u32 w[SA_VEC];
};

// Load SA_VEC elements at p: 16-byte vectors when VEC (p 16-byte aligned), else element loads.
template <bool VEC, typename P>
KX_INLINE sa_chunk sa_load(P p) {
  sa_chunk c;
  if (sizeof(p[0]) == 2) {
    if (VEC) {
      const uint4 v = *(const KX_DEVICE uint4*)(p);
      c.w[0] = v.x, c.w[1] = v.y, c.w[2] = v.z, c.w[3] = v.w;
    } else {
      const KX_DEVICE u16* h = (const KX_DEVICE u16*)(p);
      for (int i = 0; i < SA_VEC / 2; ++i) c.w[i] = (u32)h[2 * i] | ((u32)h[2 * i + 1] << 16);
    }
  } else {
    if (VEC) {
      const uint4 v0 = ((const KX_DEVICE uint4*)(p))[0], v1 = ((const KX_DEVICE uint4*)(p))[1];
      c.w[0] = v0.x, c.w[1] = v0.y, c.w[2] = v0.z, c.w[3] = v0.w;
      c.w[4] = v1.x, c.w[5] = v1.y, c.w[6] = v1.z, c.w[7] = v1.w;
    } else {
      const KX_DEVICE u32* f = (const KX_DEVICE u32*)(p);
      for (int i = 0; i < SA_VEC; ++i) c.w[i] = f[i];
    }
  }
  return c;
}

// Element e of a chunk of BYTES-wide floats (bf16 -> fp32 is exact: the bits move up 16).
template <int BYTES>
KX_INLINE float sa_elem(sa_chunk c, int e) {
  if (BYTES == 2)
    return KX_BITS_F32((e & 1) ? (c.w[e >> 1] & 0xffff0000u) : (c.w[e >> 1] << 16));
  return KX_BITS_F32(c.w[e]);
}

// The same element, or +0 when `keep` is 0 (a key without a row, whose chunk was never
// loaded); keep is ~0u otherwise. For bf16 the mask rides on the conversion itself:
// w * 0x10000 is w << 16, and w & 0xffff0000 is one three-input logic op with keep.
template <int BYTES>
KX_INLINE float sa_elem_kept(sa_chunk c, int e, u32 keep) {
  if (BYTES == 2)
    return KX_BITS_F32((e & 1) ? (c.w[e >> 1] & 0xffff0000u & keep) : c.w[e >> 1] * (0x10000u & keep));
  return KX_BITS_F32(c.w[e] & keep);
}

// ~0u for an index with a row, 0 for SA_SKIP (row indices in threadgroup memory are >= 0 or SKIP).
KX_INLINE u32 sa_keep(int idx) { return ~(u32)(idx >> 31); }

// Component k of a 4-vector (k known at compile time after unrolling).
KX_INLINE float sa_lane4(float4 v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }
KX_INLINE int sa_lane4(uint4 v, int k) { return (int)(k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w); }

// A tile's indices as a SIMD group holds them: lane L has the group's key L in v[0] and key
// L + 32 in v[1] (SKIP past N and past the group's KEYS keys).
struct sa_tile_idx {
  int v[2];
};

template <int KEYS, typename IP>
KX_INLINE sa_tile_idx sa_load_idx(IP indices, i64 idx0, int first, int N, u32 lane) {
  sa_tile_idx x;
  for (int u = 0; u < 2; ++u) {
    const int k = (int)lane + SA_LANES * u;
    x.v[u] = k < KEYS && first + k < N ? indices[idx0 + first + k] : SA_SKIP;
  }
  return x;
}

// Index of the group's key k, in every lane that asks (k < 64; k may differ per lane).
KX_INLINE int sa_idx_of(sa_tile_idx x, int k) {
  return KX_SHUFFLE(k < SA_LANES ? x.v[0] : x.v[1], (u32)(k % SA_LANES));
}

// Raw key rows of SA_BATCH keys, CG of the lane's logit chunks from chunk c0; keys without a
// row leave theirs unset (their logits never read them).
template <int CG>
struct sa_batch {
  sa_chunk k[SA_BATCH][CG];
};

template <int DIM, int CG, bool VEC, typename KP>
KX_INLINE sa_batch<CG> sa_load_batch(sa_rows<KP> rows, int rows_all, sa_tile_idx idx, int first, int c0) {
  sa_batch<CG> batch;
  SA_UNROLL for (int k = 0; k < SA_BATCH; ++k) {
    const int i = sa_idx_of(idx, first + k);
    if (sa_readable(i, rows_all)) {
      const KP row = sa_row<DIM>(rows, i);
      SA_UNROLL for (int c = 0; c < CG; ++c) batch.k[k][c] = sa_load<VEC>(row + (c0 + c) * SA_LANES * SA_VEC);
    }
  }
  return batch;
}

// Where key j of a tile sits in rows and probs: chain-major for the parallel kernel (a lane
// reads its chain's keys as 4-vectors), key order for the serial one (4 consecutive keys are
// one key of each of 4 chains). Only the layout differs, no value.
template <int GROUPS, int CHAINS>
KX_INLINE int sa_slot(int j) {
  return GROUPS == 1 ? j : (j % CHAINS) * (SA_TILE / CHAINS) + j / CHAINS;
}

// Raw words a lane keeps in flight per group of loads: bounds the registers the loads take
// whatever DIM and key type (64: a batch's rows at DIM 512 in bf16).
#define SA_RAW_BUDGET 64

// The call's sizes and scale, {W, T, N, H, S, scale}. They come from the inputs' shapes and
// template values, never from small arrays (docs/design.md, "Launch constants").
struct sa_dims {
  int W, T, N, H, S;
  float scale;
};

// One (batch, row, head) per threadgroup of GROUPS SIMD groups.
// Threadgroup memory (sa_shared): scores, rows and group maxima of two tiles (they alternate, so
// one barrier per tile suffices), and each group's weights (a group computes those it reads);
// rows and probs at sa_slot positions.
// PREFETCH: request the next tile's key rows for scoring while this tile's value sums run, so
// that their latency overlaps work (costs the registers of one group of loads).
template <int GROUPS>
struct sa_shared {
  float4 scores[2][SA_TILE / 4];
  uint4 rows[2][SA_TILE / 4];
  float4 probs[GROUPS][SA_TILE / 4];
  float maxima[2][GROUPS];
};

// The store of four consecutive output values at element i: float32, as the serial and parallel
// kernels write them (sparse_attention_unrotated.h overloads it for its own output).
KX_INLINE void sa_store4(KX_DEVICE float* out, i64 i, float4 f) { *(KX_DEVICE float4*)(out + i) = f; }

template <int DIM, int GROUPS, int PREFETCH, bool VEC, typename QP, typename KP, typename IP,
          typename SP, typename OP>
KX_INLINE void sa_attend(QP q, KP window, KP pool, IP indices, SP sinks, sa_dims dims, OP out,
                         KX_THREADGROUP sa_shared<GROUPS>* sh, u32 block, u32 lane,
                         u32 group) {
  static_assert(DIM == 256 || DIM == 512 || DIM == 1024, "DIM must be 256, 512 or 1024");
  static_assert(GROUPS == 1 || GROUPS == 8, "GROUPS must be 1 or 8");
  constexpr int CHUNKS = DIM / (SA_LANES * SA_VEC);  // logit chunks per lane
  constexpr int CHAINS = 2048 / DIM;                 // value sums per output element
  constexpr int PER_CHAIN = SA_TILE / CHAINS;        // keys per chain per tile
  constexpr int KEYS = SA_TILE / GROUPS;             // keys a group scores per tile
  constexpr int KB = sizeof(window[0]);              // bytes per key element
  constexpr int RAW = KB == 2 ? SA_VEC / 2 : SA_VEC;  // raw words per chunk
  // Logit chunks loaded together (CG per key of a batch), value keys loaded together.
  constexpr int CG_FIT = SA_RAW_BUDGET / (SA_BATCH * RAW);
  constexpr int CG = CG_FIT < 1 ? 1 : CG_FIT > CHUNKS ? CHUNKS : CG_FIT;
  // Value layout. Serial: the lane's logit dims, all chains, keys in order, STEP at a time
  // (whole 4-vectors of slots). Parallel: group g owns DIM/8 dims; lane (sub, chain) holds
  // SA_VEC of them for one chain, and loads VB of its keys together.
  constexpr int SUBS = GROUPS == 1 ? SA_LANES : SA_LANES / CHAINS;
  constexpr int LANE_CHAINS = GROUPS == 1 ? CHAINS : 1;
  constexpr int VCHUNKS = GROUPS == 1 ? CHUNKS : 1;
  constexpr int VALUE_STRIDE = SUBS * SA_VEC;
  constexpr int STEP = CHAINS < 4 ? 4 : CHAINS;
  constexpr int VB_FIT = SA_RAW_BUDGET / RAW;
  constexpr int VB = VB_FIT > PER_CHAIN ? PER_CHAIN : VB_FIT;
  static_assert(GROUPS == 1 || SUBS * SA_VEC * GROUPS == DIM, "parallel value layout");
  static_assert(CHUNKS % CG == 0 && PER_CHAIN % VB == 0 && VB % 4 == 0, "load groups");

  const int W = dims.W, T = dims.T, N = dims.N, H = dims.H, S = dims.S;
  const u32 h = block % (u32)H;
  const u32 row = block / (u32)H;  // b * S + s
  const u32 b = row / (u32)S;
  const i64 q0 = (i64)block * DIM;
  const i64 idx0 = (i64)row * N;
  const int rows_all = W + T;
  const int chain = GROUPS == 1 ? 0 : (int)(lane / SUBS);
  const int logit_at = (int)lane * SA_VEC;  // + c * 256: the lane's logit chunks
  const int value_at = GROUPS == 1 ? logit_at : (int)(group * (DIM / GROUPS) + (lane % SUBS) * SA_VEC);
  const sa_rows<KP> logit_rows = sa_rows_at<DIM>(window, pool, b, W, T, logit_at);
  const sa_rows<KP> value_rows = sa_rows_at<DIM>(window, pool, b, W, T, value_at);

  // Scale folded into q: each logit is then the plain dot product (no multiply left to fuse).
  const float scale = dims.scale;
  float qs[CHUNKS * SA_VEC];
  SA_UNROLL for (int c = 0; c < CHUNKS; ++c) {
    const sa_chunk v = sa_load<VEC>(q + (q0 + logit_at + c * SA_LANES * SA_VEC));
    SA_UNROLL for (int e = 0; e < SA_VEC; ++e)
      qs[c * SA_VEC + e] = KX_FMUL(sa_elem<sizeof(q[0])>(v, e), scale);
  }

  // Running state, relative to the maximum m; the sink is its first member (denominator only).
  float m = sinks[h];
  float sum = KX_EXP(KX_FSUB(m, sa_exp_base(m)));
  float acc[LANE_CHAINS][VCHUNKS * SA_VEC];
  SA_UNROLL for (int r = 0; r < LANE_CHAINS; ++r)
    SA_UNROLL for (int e = 0; e < VCHUNKS * SA_VEC; ++e) acc[r][e] = 0.0f;

  const int tiles = (N + SA_TILE - 1) / SA_TILE;
  const int first = (int)group * KEYS;  // the group's first key in a tile
  sa_tile_idx idx_now = sa_load_idx<KEYS>(indices, idx0, first, N, lane);
  sa_batch<CG> batch;
  if (PREFETCH && tiles > 0) batch = sa_load_batch<DIM, CG, VEC>(logit_rows, rows_all, idx_now, 0, 0);

  for (int t = 0; t < tiles; ++t) {
    const int t0 = t * SA_TILE;
    const int n = N - t0 < SA_TILE ? N - t0 : SA_TILE;
    const int parity = t & 1;
    KX_THREADGROUP float* tile_scores = (KX_THREADGROUP float*)sh->scores[parity];
    KX_THREADGROUP u32* tile_rows = (KX_THREADGROUP u32*)sh->rows[parity];
    const sa_tile_idx idx_next = sa_load_idx<KEYS>(indices, idx0, t0 + SA_TILE + first, N, lane);

    // 1. Scores of the group's keys, SA_BATCH at a time, and their maximum (keys past n are
    //    NaN for it: fmax ignores NaN, and a maximum is exact whatever the order).
    float group_max = KX_NAN_F32;
    for (int kb = 0; kb < KEYS; kb += SA_BATCH) {
      float part[SA_BATCH];
      SA_UNROLL for (int k = 0; k < SA_BATCH; ++k) part[k] = 0.0f;
      SA_UNROLL for (int c0 = 0; c0 < CHUNKS; c0 += CG) {
        if (!(PREFETCH && kb == 0 && c0 == 0))
          batch = sa_load_batch<DIM, CG, VEC>(logit_rows, rows_all, idx_now, kb, c0);
        SA_UNROLL for (int k = 0; k < SA_BATCH; ++k)
          SA_UNROLL for (int c = 0; c < CG; ++c)
            SA_UNROLL for (int e = 0; e < SA_VEC; ++e)
              part[k] = KX_FMA(qs[(c0 + c) * SA_VEC + e], sa_elem<KB>(batch.k[k][c], e), part[k]);
      }
      // Transposed butterfly: at mask 16, 8, 4 a lane keeps the half of its keys whose index
      // bit matches its lane bit and adds the partner's partials of them; then masks 2, 1.
      // Lane L ends with the logit of batch key (L >> 2) & 7.
      SA_UNROLL for (int level = 0; level < 3; ++level) {
        const u32 mask = 16u >> level;
        const int half = 4 >> level;
        const bool upper = (lane & mask) != 0;
        SA_UNROLL for (int k = 0; k < half; ++k) {
          const float send = upper ? part[k] : part[k + half];
          const float keep = upper ? part[k + half] : part[k];
          part[k] = KX_FADD(keep, KX_SHUFFLE_XOR(send, mask));
        }
      }
      part[0] = KX_FADD(part[0], KX_SHUFFLE_XOR(part[0], 2u));
      part[0] = KX_FADD(part[0], KX_SHUFFLE_XOR(part[0], 1u));
      const int mine = kb + (int)((lane >> 2) & 7);
      const int j = first + mine;
      const int my_idx = sa_idx_of(idx_now, mine);
      const bool readable = sa_readable(my_idx, rows_all);
      const float logit = readable ? part[0] : sa_rowless_logit(my_idx);
      float batch_max = j < n ? logit : KX_NAN_F32;
      SA_UNROLL for (u32 mask = 4; mask < SA_LANES; mask <<= 1)
        batch_max = KX_FMAX(batch_max, KX_SHUFFLE_XOR(batch_max, mask));
      group_max = kb == 0 ? batch_max : KX_FMAX(group_max, batch_max);
      if ((lane & 3) == 0) {
        tile_scores[j] = logit;
        tile_rows[sa_slot<GROUPS, CHAINS>(j)] = readable ? (u32)my_idx : (u32)SA_SKIP;
      }
    }
    if (lane == 0) sh->maxima[parity][group] = group_max;
    KX_BARRIER();

    // 2. Parallel: request this lane's first value rows (its chain's keys) and the next tile's
    //    key rows now, so that they arrive while the weights are computed.
    KX_THREADGROUP const float4* my_probs4 = sh->probs[group];
    KX_THREADGROUP const uint4* my_rows4 = sh->rows[parity];
    sa_chunk vals[VB];
    if (GROUPS != 1) {
      SA_UNROLL for (int i0 = 0; i0 < VB; i0 += 4) {
        const uint4 r4 = my_rows4[(chain * PER_CHAIN + i0) / 4];
        SA_UNROLL for (int k = 0; k < 4; ++k) {
          const int idx = sa_lane4(r4, k);
          if (idx != SA_SKIP) vals[i0 + k] = sa_load<VEC>(sa_row<DIM>(value_rows, idx));
        }
      }
      if (PREFETCH && t + 1 < tiles) batch = sa_load_batch<DIM, CG, VEC>(logit_rows, rows_all, idx_next, 0, 0);
    }

    // 3. Every group: the new maximum (the group maxima folded in group order, so in key
    //    order), the rescale factor, the tile's weights (lane L: keys L and L + 32, into this
    //    group's probs) and their sum, taken from lane 0 so that every lane holds the same bits.
    float tile_max = sh->maxima[parity][0];
    SA_UNROLL for (int g = 1; g < GROUPS; ++g) tile_max = KX_FMAX(tile_max, sh->maxima[parity][g]);
    const float m_new = KX_FMAX(m, tile_max);
    const float alpha = sa_rescale(m, m_new);
    const float base = sa_exp_base(m_new);
    const float p0 = (int)lane < n ? KX_EXP(KX_FSUB(tile_scores[lane], base)) : 0.0f;
    const float p1 = (int)lane + SA_LANES < n ? KX_EXP(KX_FSUB(tile_scores[lane + SA_LANES], base)) : 0.0f;
    KX_THREADGROUP float* probs = (KX_THREADGROUP float*)sh->probs[group];
    probs[sa_slot<GROUPS, CHAINS>((int)lane)] = p0;
    probs[sa_slot<GROUPS, CHAINS>((int)lane + SA_LANES)] = p1;
    float tile_sum = KX_FADD(p0, p1);
    for (u32 mask = SA_LANES / 2; mask > 0; mask >>= 1)
      tile_sum = KX_FADD(tile_sum, KX_SHUFFLE_XOR(tile_sum, mask));
    sum = KX_FMA(sum, alpha, KX_SHUFFLE(tile_sum, 0u));
    m = m_new;
    KX_SIMD_BARRIER();

    // 4. Value sums: rescale, then each chain's keys in key order. A key without a row adds
    //    fma(p, +0, acc) = acc (see the header; p is 0, or NaN with the whole row's sum).
    SA_UNROLL for (int r = 0; r < LANE_CHAINS; ++r)
      SA_UNROLL for (int e = 0; e < VCHUNKS * SA_VEC; ++e) acc[r][e] = KX_FMUL(acc[r][e], alpha);
    if (GROUPS == 1) {
      // Serial: keys in order, STEP at a time; key j belongs to chain j % CHAINS.
      for (int j0 = 0; j0 < SA_TILE; j0 += STEP) {
        uint4 r4[STEP / 4];
        float4 p4[STEP / 4];
        SA_UNROLL for (int v = 0; v < STEP / 4; ++v) {
          r4[v] = my_rows4[j0 / 4 + v];
          p4[v] = my_probs4[j0 / 4 + v];
        }
        sa_chunk kv[STEP][VCHUNKS];
        SA_UNROLL for (int k = 0; k < STEP; ++k) {
          const int idx = sa_lane4(r4[k / 4], k % 4);
          if (idx != SA_SKIP) {
            const KP key_row = sa_row<DIM>(value_rows, idx);
            SA_UNROLL for (int c = 0; c < VCHUNKS; ++c) kv[k][c] = sa_load<VEC>(key_row + c * VALUE_STRIDE);
          }
        }
        SA_UNROLL for (int k = 0; k < STEP; ++k) {
          const u32 keep = sa_keep(sa_lane4(r4[k / 4], k % 4));
          const float p = sa_lane4(p4[k / 4], k % 4);
          SA_UNROLL for (int c = 0; c < VCHUNKS; ++c)
            SA_UNROLL for (int e = 0; e < SA_VEC; ++e)
              acc[k % CHAINS][c * SA_VEC + e] =
                  KX_FMA(p, sa_elem_kept<KB>(kv[k][c], e, keep), acc[k % CHAINS][c * SA_VEC + e]);
        }
      }
      if (PREFETCH && t + 1 < tiles) batch = sa_load_batch<DIM, CG, VEC>(logit_rows, rows_all, idx_next, 0, 0);
    } else {
      // Parallel: this lane's chain only, j = chain + CHAINS * i, VB keys per group of loads
      // (the first group was requested above).
      SA_UNROLL for (int v0 = 0; v0 < PER_CHAIN; v0 += VB) {
        if (v0 > 0) {
          SA_UNROLL for (int i0 = 0; i0 < VB; i0 += 4) {
            const uint4 r4 = my_rows4[(chain * PER_CHAIN + v0 + i0) / 4];
            SA_UNROLL for (int k = 0; k < 4; ++k) {
              const int idx = sa_lane4(r4, k);
              if (idx != SA_SKIP) vals[i0 + k] = sa_load<VEC>(sa_row<DIM>(value_rows, idx));
            }
          }
        }
        SA_UNROLL for (int i0 = 0; i0 < VB; i0 += 4) {
          const uint4 r4 = my_rows4[(chain * PER_CHAIN + v0 + i0) / 4];  // again: fewer live registers
          const float4 p4 = my_probs4[(chain * PER_CHAIN + v0 + i0) / 4];
          SA_UNROLL for (int k = 0; k < 4; ++k) {
            const u32 keep = sa_keep(sa_lane4(r4, k));
            SA_UNROLL for (int e = 0; e < SA_VEC; ++e)
              acc[0][e] = KX_FMA(sa_lane4(p4, k), sa_elem_kept<KB>(vals[i0 + k], e, keep), acc[0][e]);
          }
        }
      }
    }
    idx_now = idx_next;
  }

  // Chains summed by a pairwise tree in chain order: within the lane (serial), or across the
  // lanes of one sub (parallel), where the lane of chain 0 always adds its partner's sum on
  // the right, as the serial lane does.
  float res[VCHUNKS * SA_VEC];
  SA_UNROLL for (int e = 0; e < VCHUNKS * SA_VEC; ++e) {
    if (GROUPS == 1) {
      float level[LANE_CHAINS];
      SA_UNROLL for (int r = 0; r < LANE_CHAINS; ++r) level[r] = acc[r][e];
      SA_UNROLL for (int width = LANE_CHAINS; width > 1; width /= 2)
        SA_UNROLL for (int r = 0; r < width / 2; ++r) level[r] = KX_FADD(level[2 * r], level[2 * r + 1]);
      res[e] = level[0];
    } else {
      float v = acc[0][e];
      SA_UNROLL for (u32 mask = SUBS; mask < SA_LANES; mask <<= 1) v = KX_FADD(v, KX_SHUFFLE_XOR(v, mask));
      res[e] = v;
    }
  }
  if (chain == 0) {
    SA_UNROLL for (int c = 0; c < VCHUNKS; ++c) {
      SA_UNROLL for (int v4 = 0; v4 < SA_VEC / 4; ++v4) {
        float4 f;
        f.x = KX_FDIV(res[c * SA_VEC + 4 * v4], sum);
        f.y = KX_FDIV(res[c * SA_VEC + 4 * v4 + 1], sum);
        f.z = KX_FDIV(res[c * SA_VEC + 4 * v4 + 2], sum);
        f.w = KX_FDIV(res[c * SA_VEC + 4 * v4 + 3], sum);
        sa_store4(out, q0 + value_at + c * VALUE_STRIDE + 4 * v4, f);
      }
    }
  }
}

// The kernels' entry: vector loads when q, window and pool start 16-byte aligned, else element
// loads (the same arithmetic; the branch is uniform).
template <int DIM, int GROUPS, int PREFETCH, typename QP, typename KP, typename IP, typename SP,
          typename OP>
KX_INLINE void sa_kernel(QP q, KP window, KP pool, IP indices, SP sinks, sa_dims dims, OP out,
                         KX_THREADGROUP sa_shared<GROUPS>* sh, u32 block, u32 lane, u32 group) {
  if (SA_ALIGNED16(q) && SA_ALIGNED16(window) && SA_ALIGNED16(pool))
    sa_attend<DIM, GROUPS, PREFETCH, true>(q, window, pool, indices, sinks, dims, out, sh,
                                           block, lane, group);
  else
    sa_attend<DIM, GROUPS, PREFETCH, false>(q, window, pool, indices, sinks, dims, out, sh,
                                            block, lane, group);
}
