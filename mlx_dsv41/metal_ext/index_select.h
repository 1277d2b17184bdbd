// The lightning indexer's scores and its two-level top-k for a few query rows (docs/design.md#index-select;
// what is computed: docs/model.md#indexer, docs/model.md#two-level-selection, docs/model.md#visibility;
// the ranking: docs/numerics.md#topk-ties). index_scores scores IX_TILE entries of one row per
// threadgroup; the selection (`ix_select_row`) runs in one threadgroup per row: index_scores' last
// threadgroup of the row where a launch may finish itself (CUDA), else the index_select launch.
#pragma once

#define IX_THREADS 256  // threads of every threadgroup: 8 SIMD groups
#define IX_WARPS 8
#define IX_TILE 32     // entries a threadgroup of index_scores scores: 4 per SIMD group
#define IX_HEADS 32    // index heads a SIMD group scores at once (one per lane); HI <= IX_HEADS
#define IX_SCRATCH (IX_WARPS * 16 + 3)  // u32 words of threadgroup memory the selection uses

// Compressed entries visible to row s of a forward at position p: (p + s + 1) / RATIO.
KX_INLINE i32 ix_visible(i32 position, u32 s, u32 ratio) { return (position + (i32)s + 1) / (i32)ratio; }

// relu as MLX's maximum(x, 0) computes it: NaN stays NaN, -0 becomes +0.
KX_INLINE float ix_relu(float x) { return KX_ISNAN(x) ? x : (x > 0.0f ? x : 0.0f); }

// N values per lane (a power of two <= 32), summed over a SIMD group's lanes by the transposed xor
// butterfly: at masks 16, 8, ... a lane keeps the half of its values whose index bit matches its
// lane bit and adds its partner's copy of that half (ix_add: the values' own sum). After log2(N)
// levels lane L holds in v[0] the sum of value (L >> (5 - log2 N)) over the lanes that share L's
// low 5 - log2(N) bits (N = 32: value L over all lanes).
template <int N, typename T>
struct IxLanes {
  T v[N];
};
KX_INLINE float ix_add(float a, float b) { return KX_FADD(a, b); }
KX_INLINE u32 ix_add(u32 a, u32 b) { return a + b; }
template <int N, typename T>
KX_INLINE IxLanes<N, T> ix_transposed_sum(IxLanes<N, T> p, u32 lane) {
  KX_UNROLL for (int level = 0; (N >> level) > 1; level++) {
    const u32 mask = 16u >> level;
    const int half = N >> (level + 1);
    const bool upper = (lane & mask) != 0u;
    KX_UNROLL for (int i = 0; i < half; i++) {
      const T send = upper ? p.v[i] : p.v[i + half];
      const T keep = upper ? p.v[i + half] : p.v[i];
      p.v[i] = ix_add(keep, KX_SHUFFLE_XOR(send, mask));
    }
  }
  return p;
}

// Scores of entries tile · IX_TILE .. of query row r (b = r / S, s = r % S) into scores[r · T + j]:
//   score_j = Σ_h relu(q_h · k_j) · w_h for j < visible, -inf for the others (not read), with
//   w_h = float(weights[r, h]) · scale (one fp32 rounding, as the reference's cast then product).
// Order: SIMD group g scores entries g, g + 8, ... of the tile. Lane L holds dims L·V .. L·V + V-1
// (V = DI / 32) of every head; its partial of head h is q·k over them, the first product then an
// fma chain in dim order. The lanes' partials meet by the transposed xor butterfly (at masks 16, 8,
// 4, 2, 1 a lane keeps half of its heads), after which lane L holds head L's dot; relu, times w,
// then the xor-butterfly sum over the lanes (16, 8, 4, 2, 1; every lane ends with the same bits).
// Lanes past HI add +0. qs: 32 · DI floats, ws: 32 floats of threadgroup memory.
template <int HI, int DI, typename TQ, typename TW, typename TK>
KX_INLINE void ix_score_tile(const KX_DEVICE TQ* q, const KX_DEVICE TW* weights, const KX_DEVICE TK* keys,
                             KX_DEVICE float* scores, u32 T, u32 S, i32 position, u32 ratio, float scale, u32 tile,
                             u32 r, KX_THREADGROUP float* qs, KX_THREADGROUP float* ws, u32 lid, u32 lane, u32 warp) {
  constexpr int V = DI / 32;
  for (u32 i = lid; i < (u32)(HI * DI); i += IX_THREADS) qs[i] = KX_TO_F32(q[(u64)r * (HI * DI) + i]);
  if (lid < IX_HEADS) ws[lid] = lid < (u32)HI ? KX_FMUL(KX_TO_F32(weights[(u64)r * HI + lid]), scale) : 0.0f;
  KX_BARRIER();
  const u32 b = r / S;
  const i32 visible = ix_visible(position, r % S, ratio);
  for (u32 e = warp; e < IX_TILE; e += IX_WARPS) {
    const u32 j = tile * IX_TILE + e;
    if (j >= T) break;  // the same j in every lane: the SIMD group leaves together
    float score = -KX_INF_F32;
    if ((i32)j < visible) {
      float kv[V];
      KX_UNROLL for (int v = 0; v < V; v++) kv[v] = KX_TO_F32(keys[((u64)b * T + j) * DI + lane * V + v]);
      IxLanes<IX_HEADS, float> part;
      KX_UNROLL for (int h = 0; h < IX_HEADS; h++) {
        if (h < HI) {
          const KX_THREADGROUP float* qh = qs + h * DI + lane * V;
          float acc = KX_FMUL(qh[0], kv[0]);
          KX_UNROLL for (int v = 1; v < V; v++) acc = KX_FMA(qh[v], kv[v], acc);
          part.v[h] = acc;
        } else {
          part.v[h] = 0.0f;
        }
      }
      const float dot = ix_transposed_sum(part, lane).v[0];
      float term = lane < (u32)HI ? KX_FMUL(ix_relu(dot), ws[lane]) : 0.0f;
      KX_UNROLL for (u32 mask = 16; mask > 0; mask >>= 1) term = KX_FADD(term, KX_SHUFFLE_XOR(term, mask));
      score = term;
    }
    if (lane == 0) scores[(u64)r * T + j] = score;
  }
}

// The ranking key of a score, larger is better (docs/numerics.md#topk-ties): every NaN is the
// positive quiet NaN (above +inf; backends differ in the NaNs they make); + 0 makes -0 equal to +0;
// flipping the magnitude bits of negative floats orders the int32 bits as the floats; flipping the
// sign bit orders those int32 keys as uint32. Equal keys rank by the lower index.
KX_INLINE u32 ix_rank(float v) {
  const u32 bits = KX_ISNAN(v) ? 0x7FC00000u : KX_F32_BITS(KX_FADD(v, 0.0f));
  return ((bits >> 31) != 0u ? bits ^ 0x7FFFFFFFu : bits) ^ 0x80000000u;
}

// The entries of a row as its top-k ranks them: the stored (visible) scores, and -inf outside the
// candidate blocks of `cand` (MODE 2, docs/model.md#two-level-selection). Scores are read through L2:
// in index_scores other threadgroups of the launch wrote them.
template <int MODE, int BLOCK>
struct IxEntries {
  const KX_DEVICE float* scores;
  const KX_DEVICE bool* cand;
  KX_INLINE float value(u32 j) const {
    const float v = KX_LOAD_CG(scores + j);
    return (MODE == 2 && !cand[j / BLOCK]) ? -KX_INF_F32 : v;
  }
};

// The candidate source's blocks of BLOCK entries: a block's score is the maximum of its entries'
// (NaN if any is NaN, as MLX's max; entries past T count as -inf), +inf for the block of the newest
// visible entry (`newest`, -1 if none: docs/model.md#two-level-selection).
template <int BLOCK>
struct IxBlocks {
  const KX_DEVICE float* scores;
  u32 T;
  i32 newest;
  KX_INLINE float value(u32 blk) const {
    if ((i32)blk == newest) return KX_INF_F32;
    float m = -KX_INF_F32;
    for (u32 e = 0; e < (u32)BLOCK; e++) {
      const u32 j = blk * BLOCK + e;
      if (j < T) {
        const float v = KX_LOAD_CG(scores + j);
        m = KX_ISNAN(m) ? m : (KX_ISNAN(v) || v > m ? v : m);
      }
    }
    return m;
  }
};

// Where the best k of n items fall: the k-th best rank `thr`, and how many items of rank thr the
// best k take (`take`, lowest indices first). A radix select, 4 bits a pass from the top (8 passes):
// each thread counts its items (i = lid, lid + 256, ...) that match the bits found so far by their
// next digit, the 16 counts meet per SIMD group (`ix_transposed_sum`, then mask 1: lane L ends with
// digit (L >> 1) & 15), and thread 0 adds the groups' counts and walks the digits from 15 down. k >= n
// takes every item. Counts are integers: any order gives the same result. tmp: IX_SCRATCH words.
struct IxCut {
  u32 thr;
  u32 take;
};
template <typename Src>
KX_INLINE IxCut ix_cut(Src src, u32 n, u32 k, KX_THREADGROUP u32* tmp, u32 lid, u32 lane, u32 warp) {
  IxCut cut = {0u, n};
  if (k >= n) return cut;
  u32 prefix = 0u, need = k;
  for (int shift = 28; shift >= 0; shift -= 4) {
    const u32 high = shift == 28 ? 0u : 0xFFFFFFFFu << (shift + 4);
    IxLanes<16, u32> c;
    KX_UNROLL for (int d = 0; d < 16; d++) c.v[d] = 0u;
    for (u32 i = lid; i < n; i += IX_THREADS) {
      const u32 u = ix_rank(src.value(i));
      const u32 digit = (u >> shift) & 15u;
      if ((u & high) == prefix) {
        KX_UNROLL for (int d = 0; d < 16; d++) c.v[d] += digit == (u32)d ? 1u : 0u;
      }
    }
    u32 mine = ix_transposed_sum(c, lane).v[0];
    mine += KX_SHUFFLE_XOR(mine, 1u);
    if ((lane & 1u) == 0u) tmp[warp * 16 + ((lane >> 1) & 15u)] = mine;
    KX_BARRIER();
    if (lid == 0) {
      u32 digit = 0u;
      for (int d = 15; d >= 0; d--) {
        u32 count = 0u;
        for (int w = 0; w < IX_WARPS; w++) count += tmp[w * 16 + d];
        if (need <= count) {
          digit = (u32)d;
          break;
        }
        need -= count;
      }
      tmp[IX_WARPS * 16] = prefix | (digit << shift);
      tmp[IX_WARPS * 16 + 1] = need;
    }
    KX_BARRIER();
    prefix = tmp[IX_WARPS * 16];
    need = tmp[IX_WARPS * 16 + 1];
  }
  cut.thr = prefix;
  cut.take = need;
  return cut;
}

// An exclusive prefix sum over the threadgroup of one count per thread, in thread order, and the
// total: a shuffle scan per SIMD group, then the groups' totals through threadgroup memory.
struct IxScan {
  u32 before;
  u32 total;
};
KX_INLINE IxScan ix_scan(u32 count, KX_THREADGROUP u32* tmp, u32 lane, u32 warp) {
  u32 inc = count;
  for (u32 d = 1; d < 32u; d <<= 1) {
    const u32 o = KX_SHUFFLE(inc, lane >= d ? lane - d : lane);
    if (lane >= d) inc += o;
  }
  if (lane == 31u) tmp[warp] = inc;
  KX_BARRIER();
  IxScan s = {inc - count, 0u};
  for (u32 w = 0; w < (u32)IX_WARPS; w++) {
    const u32 t = tmp[w];
    if (w < warp) s.before += t;
    s.total += t;
  }
  KX_BARRIER();  // every group's total is read before the next scan writes them
  return s;
}

// Whether item i (< n) is among the best `cut` chose: a rank above thr, or of rank thr and among
// the first `take` of those in index order (`seen` of them before this pass of 256 items, `e` the
// scan of this pass's).
KX_INLINE bool ix_chosen(u32 u, IxCut cut, u32 seen, IxScan e) {
  return u > cut.thr || (u == cut.thr && seen + e.before < cut.take);
}

// The row's top-k (docs/model.md#two-level-selection): the best K entries of n by (score, lower
// index), written ascending to topk[0..); picks at or past `visible` become the trailing -1s. With
// LIST the same picks also go to list[0..) plus `plus` (the -1s as they are): the attention's
// entries past the window rows (docs/design.md#index-list).
template <int K, bool LIST, typename Src>
KX_INLINE void ix_topk(Src src, u32 n, i32 visible, KX_DEVICE int* topk, KX_DEVICE int* list, int plus,
                       KX_THREADGROUP u32* tmp, u32 lid, u32 lane, u32 warp) {
  const IxCut cut = ix_cut(src, n, (u32)K, tmp, lid, lane, warp);
  u32 seen = 0u, out = 0u;
  for (u32 c = 0; c < n; c += IX_THREADS) {
    const u32 i = c + lid;
    const u32 u = i < n ? ix_rank(src.value(i)) : 0u;
    const IxScan e = ix_scan(i < n && u == cut.thr ? 1u : 0u, tmp, lane, warp);
    const bool kept = i < n && (i32)i < visible && ix_chosen(u, cut, seen, e);
    const IxScan o = ix_scan(kept ? 1u : 0u, tmp, lane, warp);
    if (kept) topk[out + o.before] = (int)i;
    if (LIST && kept) list[out + o.before] = (int)i + plus;
    seen += e.total;
    out += o.total;
  }
  for (u32 p = out + lid; p < (u32)K; p += IX_THREADS) {
    topk[p] = -1;
    if (LIST) list[p] = -1;
  }
}

// The candidate source's block mask: the best `keep` of nb blocks by (block score, lower block),
// those whose score is above -inf.
template <typename Src>
KX_INLINE void ix_block_mask(Src src, u32 nb, u32 keep, KX_DEVICE bool* mask, KX_THREADGROUP u32* tmp, u32 lid,
                             u32 lane, u32 warp) {
  const IxCut cut = ix_cut(src, nb, keep, tmp, lid, lane, warp);
  u32 seen = 0u;
  for (u32 c = 0; c < nb; c += IX_THREADS) {
    const u32 i = c + lid;
    const float v = i < nb ? src.value(i) : 0.0f;
    const u32 u = ix_rank(v);
    const IxScan e = ix_scan(i < nb && u == cut.thr ? 1u : 0u, tmp, lane, warp);
    if (i < nb) mask[i] = ix_chosen(u, cut, seen, e) && v > -KX_INF_F32;
    seen += e.total;
  }
}

// Query row r's selection from its stored scores (row r of scores [R, T]): the top-k into topk
// [R, K]; with MODE 1 (the candidate source) also its block mask into blocks [R, ceil(T / BLOCK)];
// with MODE 2 the top-k only inside the blocks of cand [R, nc] (docs/model.md#two-level-selection).
// With LEAD > 0, also the attention's index list of the row into list [R, LEAD + K]: the row's
// window rows (rows [S, LEAD], of query s = r % S), then the picks plus PLUS, the -1s kept
// (docs/design.md#index-list).
template <int K, int MODE, int BLOCK, int KEEP, int LEAD, int PLUS>
KX_INLINE void ix_select_row(const KX_DEVICE float* scores, const KX_DEVICE bool* cand, u32 nc, KX_DEVICE int* topk,
                             KX_DEVICE bool* blocks, const KX_DEVICE int* rows, KX_DEVICE int* list, u32 T, u32 S,
                             i32 position, u32 ratio, u32 r, KX_THREADGROUP u32* tmp, u32 lid, u32 lane, u32 warp) {
  const i32 visible = ix_visible(position, r % S, ratio);
  const KX_DEVICE float* row = scores + (u64)r * T;
  const IxEntries<MODE, BLOCK> entries = {row, cand + (MODE == 2 ? (u64)r * nc : 0ull)};
  KX_DEVICE int* listed = list + (u64)r * (LEAD + K);
  if (LEAD > 0)
    for (u32 p = lid; p < (u32)LEAD; p += IX_THREADS) listed[p] = rows[(u64)(r % S) * LEAD + p];
  ix_topk<K, (LEAD > 0)>(entries, T, visible, topk + (u64)r * K, listed + LEAD, PLUS, tmp, lid, lane, warp);
  if (MODE == 1) {
    const u32 nb = (T + BLOCK - 1) / BLOCK;
    const IxBlocks<BLOCK> blocks_of_row = {row, T, visible > 0 ? (visible - 1) / BLOCK : -1};
    ix_block_mask(blocks_of_row, nb, (u32)KEEP < nb ? (u32)KEEP : nb, blocks + (u64)r * nb, tmp, lid, lane, warp);
  }
}
