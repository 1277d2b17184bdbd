// Sparse attention, rows: a threadgroup (4 SIMD groups) per (batch, query row, 16 heads), for
// prefill (sparse_attention_rows.h). Per tile of 16 keys: the key rows staged in threadgroup
// memory (zero for a key without a row); the logits of the 16 heads x 16 keys as MMAs over the
// dims, each SIMD group a quarter of the dims, the four partial sums added in group order; the
// online softmax of sparse_attention.h (running maximum from the sink, fmax, exp(x - base),
// rescale only when the maximum moves) per head; then P·V into each group's quarter of the output
// dims. q, window and pool are bf16 (the host refuses other dtypes); out float32.
constexpr u32 RW = SAR_WORDS(DIM), DW = DIM / SAR_WARPS, DT = DW / 8;
KX_SHARED16(u32, qs, SAR_HEADS * RW);
KX_SHARED16(u32, ks, SAR_KEYS * RW);
KX_SHARED(float, partial, SAR_WARPS * SAR_HEADS * SAR_KEYS);
KX_SHARED(int, tile_idx, SAR_KEYS);
const int W = HAS_WINDOW ? window_shape[1] : 0, T = HAS_POOL ? pool_shape[1] : 0;
const int N = HAS_INDICES ? indices_shape[2] : 0, S = q_shape[1], H = q_shape[2];
const u32 t = KX_LID_X, lane = KX_LANE, w = KX_WARP, qd = lane >> 2, c = lane & 3u;
const u32 blocks = (u32)H / SAR_HEADS, hb = KX_TGID_X % blocks, bs = KX_TGID_X / blocks, b = bs / (u32)S;
const float scale = KX_BITS_F32(SCALE_BITS);
const KX_DEVICE u32* qw = (const KX_DEVICE u32*)q + ((u64)bs * H + hb * SAR_HEADS) * (DIM / 2);
// the 16 heads' q rows, 16 bytes per thread and step
for (u32 i = t; i < SAR_HEADS * DIM / 8; i += SAR_WARPS * 32) {
  const u32 r = i / (DIM / 8), ch = i % (DIM / 8);
  u32 v[4];
  KX_LOAD_U32X4(qw + r * (DIM / 2) + 4 * ch, v);
  for (int j = 0; j < 4; j++) qs[r * RW + 4 * ch + j] = v[j];
}
// The lane's heads qd and qd + 8: running maximum (from the sink), sum, output accumulators.
float m[2], sum[2], acc[DT][4];
for (int h = 0; h < 2; h++) {
  m[h] = sinks[hb * SAR_HEADS + qd + 8 * h];
  sum[h] = KX_EXP(KX_FSUB(m[h], sa_exp_base(m[h])));  // the sink's own weight: 1, 0 at -inf, NaN
}
for (u32 i = 0; i < DT; i++)
  for (int e = 0; e < 4; e++) acc[i][e] = 0.0f;
const i64 idx0 = (i64)bs * N;
for (int first = 0; first < N; first += SAR_KEYS) {
  KX_BARRIER();  // the previous tile's key rows and partial sums are read
  if (t < SAR_KEYS) tile_idx[t] = first + (int)t < N ? indices[idx0 + first + t] : SA_SKIP;
  KX_BARRIER();
  for (u32 i = t; i < SAR_KEYS * DIM / 8; i += SAR_WARPS * 32) {
    const u32 k = i / (DIM / 8), ch = i % (DIM / 8);
    const int idx = tile_idx[k];
    u32 v[4] = {0u, 0u, 0u, 0u};
    if (sa_readable(idx, W + T)) {
      const KX_DEVICE u32* row = idx < W ? (const KX_DEVICE u32*)window + ((u64)b * W + idx) * (DIM / 2)
                                         : (const KX_DEVICE u32*)pool + ((u64)b * T + (idx - W)) * (DIM / 2);
      KX_LOAD_U32X4(row + 4 * ch, v);
    }
    for (int j = 0; j < 4; j++) ks[k * RW + 4 * ch + j] = v[j];
  }
  KX_BARRIER();
  // this group's quarter of q · k for the 16 x 16 (head, key) pairs, in the MMA's C layout
  float part[2][4];
  for (int n = 0; n < 2; n++)
    for (int e = 0; e < 4; e++) part[n][e] = 0.0f;
#if KX_HAS_MMA_F16
  KX_UNROLL
  for (u32 d = w * DW; d < (w + 1) * DW; d += 16) {
    u32 a[4], kb[4];
    KX_LDMATRIX_X4(qs, (lane & 15u) * RW + (d + 8 * (lane >> 4)) / 2, a);
    KX_LDMATRIX_X4(ks, ((lane & 7u) + 8 * (lane >> 4)) * RW + (d + 8 * ((lane >> 3) & 1u)) / 2, kb);
    KX_MMA_BF16_F32(part[0], a[0], a[1], a[2], a[3], kb[0], kb[1]);
    KX_MMA_BF16_F32(part[1], a[0], a[1], a[2], a[3], kb[2], kb[3]);
  }
#else
  for (int n = 0; n < 2; n++)
    for (int e = 0; e < 4; e++) {
      const u32 head = qd + 8 * (e >> 1), key = 8 * n + 2 * c + (e & 1);
      for (u32 d = w * DW; d < (w + 1) * DW; d++)
        part[n][e] = KX_FMA(sar_elem(qs + head * RW, d), sar_elem(ks + key * RW, d), part[n][e]);
    }
#endif
  for (int n = 0; n < 2; n++)
    for (int e = 0; e < 4; e++)
      partial[(w * SAR_HEADS + qd + 8 * (e >> 1)) * SAR_KEYS + 8 * n + 2 * c + (e & 1)] = part[n][e];
  KX_BARRIER();
  // every group: the logits (quarters added in group order, then scaled), the softmax step
  float p[2][4], tile_max[2] = {-KX_INF_F32, -KX_INF_F32};
  for (int n = 0; n < 2; n++)
    for (int e = 0; e < 4; e++) {
      const u32 head = qd + 8 * (e >> 1), key = 8 * n + 2 * c + (e & 1);
      const int idx = tile_idx[key];
      float l = partial[head * SAR_KEYS + key];
      for (u32 g = 1; g < SAR_WARPS; g++) l = KX_FADD(l, partial[(g * SAR_HEADS + head) * SAR_KEYS + key]);
      l = sa_readable(idx, W + T) ? KX_FMUL(l, scale) : sa_rowless_logit(idx);
      p[n][e] = l;
      tile_max[e >> 1] = KX_FMAX(tile_max[e >> 1], l);
    }
  for (int h = 0; h < 2; h++) {
    tile_max[h] = KX_FMAX(tile_max[h], KX_SHUFFLE_XOR(tile_max[h], 1));
    tile_max[h] = KX_FMAX(tile_max[h], KX_SHUFFLE_XOR(tile_max[h], 2));
    const float m_new = KX_FMAX(m[h], tile_max[h]), alpha = sa_rescale(m[h], m_new), base = sa_exp_base(m_new);
    float tile_sum = 0.0f;
    for (int n = 0; n < 2; n++)
      for (int e = 2 * h; e < 2 * h + 2; e++) {
        p[n][e] = KX_EXP(KX_FSUB(p[n][e], base));
        tile_sum = KX_FADD(tile_sum, p[n][e]);
      }
    tile_sum = KX_FADD(tile_sum, KX_SHUFFLE_XOR(tile_sum, 1));
    tile_sum = KX_FADD(tile_sum, KX_SHUFFLE_XOR(tile_sum, 2));
    sum[h] = KX_FMA(sum[h], alpha, tile_sum);
    m[h] = m_new;
    for (u32 i = 0; i < DT; i++) {
      acc[i][2 * h] = KX_FMUL(acc[i][2 * h], alpha);
      acc[i][2 * h + 1] = KX_FMUL(acc[i][2 * h + 1], alpha);
    }
  }
  // P (16 heads x 16 keys) as the A operand: the logit tiles' C layout is its fragment layout
  const sar_split p0 = sar_split2(p[0][0], p[0][1]), p1 = sar_split2(p[0][2], p[0][3]);
  const sar_split p2 = sar_split2(p[1][0], p[1][1]), p3 = sar_split2(p[1][2], p[1][3]);
#if KX_HAS_MMA_F16
  KX_UNROLL
  for (u32 i = 0; i < DT; i += 2) {
    u32 vb[4];
    KX_LDMATRIX_X4_TRANS(ks, (lane & 15u) * RW + (w * DW + 8 * i + 8 * (lane >> 4)) / 2, vb);
    KX_MMA_BF16_F32(acc[i], p0.hi, p1.hi, p2.hi, p3.hi, vb[0], vb[1]);
    KX_MMA_BF16_F32(acc[i], p0.lo, p1.lo, p2.lo, p3.lo, vb[0], vb[1]);
    KX_MMA_BF16_F32(acc[i + 1], p0.hi, p1.hi, p2.hi, p3.hi, vb[2], vb[3]);
    KX_MMA_BF16_F32(acc[i + 1], p0.lo, p1.lo, p2.lo, p3.lo, vb[2], vb[3]);
  }
#else
  // the lane's outputs summed with FMAs: P's row entries gathered from the 4 lanes of its head
  for (int half = 0; half < 2; half++) {  // hi, then lo
    float row[2][SAR_KEYS];
    for (u32 src = 0; src < 4; src++) {
      const u32 from = 4 * qd + src;
      const u32 words[4] = {half ? p0.lo : p0.hi, half ? p1.lo : p1.hi, half ? p2.lo : p2.hi, half ? p3.lo : p3.hi};
      for (int j = 0; j < 4; j++) {
        const u32 got = KX_SHUFFLE(words[j], from);
        const int h = j & 1, key = 8 * (j >> 1) + 2 * (int)src;
        row[h][key] = KX_BITS_F32(got << 16);
        row[h][key + 1] = KX_BITS_F32(got & 0xffff0000u);
      }
    }
    for (u32 i = 0; i < DT; i++)
      for (int e = 0; e < 4; e++) {
        const u32 col = w * DW + 8 * i + 2 * c + (e & 1);
        for (u32 key = 0; key < SAR_KEYS; key++)
          acc[i][e] = KX_FMA(row[e >> 1][key], sar_elem(ks + key * RW, col), acc[i][e]);
      }
  }
#endif
}
for (int h = 0; h < 2; h++) {
  KX_DEVICE float* o = out + (((u64)bs * H + hb * SAR_HEADS + qd + 8 * h) * DIM + w * DW + 2 * c);
  for (u32 i = 0; i < DT; i++) {
    o[8 * i] = KX_FDIV(acc[i][2 * h], sum[h]);
    o[8 * i + 1] = KX_FDIV(acc[i][2 * h + 1], sum[h]);
  }
}
