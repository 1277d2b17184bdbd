// mxfp4 values and the mxfp4_gemv loop (docs/numerics.md#mxfp4-gemv): E2M1 codes and E8M0 scales
// (2^(s - 127), 255 NaN), decoded exactly.
#pragma once

// x is read 16 bytes at a time when it starts 16-byte aligned (MLX allocations do; rows are K
// elements apart, K % 32 == 0), else element by element with the same arithmetic. Metal: element
// loads (this kernel serves CUDA; a Metal view's offset is not checked). Tests define
// MXFP4_ELEMENT_LOADS to run the element path.
#if defined(MXFP4_ELEMENT_LOADS)
#define MXFP4_ALIGNED16(p) false
#else
#define MXFP4_ALIGNED16(p) KX_ALIGNED16(p)
#endif

struct mxfp4_f8 {
  float v[8];
};

// x is fp16 (else bf16 when 2 bytes wide).
template <typename T>
struct mxfp4_is_f16 {
  enum { yes = 0 };
};
template <>
struct mxfp4_is_f16<f16> {
  enum { yes = 1 };
};

// The 8 x elements at p as fp32 (exact widening).
template <bool VEC, typename T>
KX_INLINE mxfp4_f8 mxfp4_x8(const KX_DEVICE T* p) {
  mxfp4_f8 r;
  if (VEC && sizeof(T) == 4) {
    KX_LOAD_F32X4((const KX_DEVICE float*)p, r.v);
    KX_LOAD_F32X4((const KX_DEVICE float*)p + 4, r.v + 4);
  } else if (VEC) {
    u32 h[4];
    KX_LOAD_U32X4((const KX_DEVICE u32*)p, h);
    for (int i = 0; i < 4; i++) {
      r.v[2 * i] = mxfp4_is_f16<T>::yes ? KX_F16_BITS_TO_F32(h[i] & 0xFFFFu) : KX_BITS_F32(h[i] << 16);
      r.v[2 * i + 1] = mxfp4_is_f16<T>::yes ? KX_F16_BITS_TO_F32(h[i] >> 16) : KX_BITS_F32(h[i] & 0xFFFF0000u);
    }
  } else {
    for (int t = 0; t < 8; t++) r.v[t] = KX_TO_F32(p[t]);
  }
  return r;
}

// The 8 E2M1 codes of word c (code t at bits 4t: sign, e1, e0, m from the top) as fp32 values
// times 2^-14, exactly. Each code becomes the high byte of an fp16, sign at bit 15 and e1 e0 m at
// bits 11-9: exponent field e1e0, mantissa m, so the value (0, 0.5, ..., 6) times 2^-14, the
// code 0.5 an fp16 subnormal. ev holds codes 0, 2, 4, 6 as such bytes 0-3, od codes 1, 3, 5, 7;
// a byte permute puts two of them in the high bytes of an fp16 pair, widened exactly.
KX_INLINE mxfp4_f8 mxfp4_codes(u32 c) {
  const u32 ev = ((c << 1) & 0x0E0E0E0Eu) | ((c << 4) & 0x80808080u);
  const u32 od = ((c >> 3) & 0x0E0E0E0Eu) | (c & 0x80808080u);
  const u32 h[4] = {KX_BYTE_PERM(ev, 0u, 0x2404u), KX_BYTE_PERM(od, 0u, 0x2404u), KX_BYTE_PERM(ev, 0u, 0x3414u),
                    KX_BYTE_PERM(od, 0u, 0x3414u)};  // codes (0, 4), (1, 5), (2, 6), (3, 7)
  mxfp4_f8 r;
  for (int i = 0; i < 4; i++) {
    r.v[i] = KX_F16_BITS_TO_F32(h[i] & 0xFFFFu);
    r.v[i + 4] = KX_F16_BITS_TO_F32(h[i] >> 16);
  }
  return r;
}

// acc + p · 2^14 · 2^(s - 127), p a sum of products with the codes' 2^-14, for E8M0 scales s <=
// 240: the 2^14 rides on the scale, 2^(s - 113) (normal, exact).
KX_INLINE float mxfp4_scaled(float p, u32 s, float acc) { return KX_FMA(p, KX_BITS_F32((s + 14u) << 23), acc); }

// The same for any s, the larger ones (never seen in weights) and NaN (255) as p · 2^14 (exact)
// times the scale.
KX_INLINE float mxfp4_scaled_any(float p, u32 s, float acc) {
  if (s <= 240u) return mxfp4_scaled(p, s, acc);
  return KX_FMA(p * 16384.0f, s == 255u ? KX_NAN_F32 : KX_BITS_F32(s << 23), acc);
}

// One threadgroup of mxfp4_gemv: COLS outputs n0.. of row group grp (x rows r0.., expert e), S
// SIMD groups; sg and lane are this thread's (Metal has thread attributes in the kernel only).
// A step is 256 consecutive k: lane l takes word l of the step (codes k = 256 step + 8l .. + 7)
// in each column, absent past K in a last, partial step. The steps split into S runs of
// ceil(steps / S), SIMD group sg taking the sg-th, UNROLL steps at a time (loads first). A lane's
// 8 products go into a partial sum (fp32 FMAs, k order), added to its running sum times the
// word's scale; the 32 lane sums meet in a xor butterfly (offsets 16 .. 1, each lane keeping half
// of the values at each offset while it holds more than one), then the S SIMD groups' sums add
// in sg order through red[S · M · COLS].
template <bool VEC, int M, int COLS, typename XP, typename WP, typename SP, typename YP>
KX_INLINE void mxfp4_gemv_tg(XP x, WP w, SP scales, YP y, u32 N, u32 KW, u32 r0, u32 e, u32 grp, u32 n0, u32 S,
                             u32 sg, u32 lane, KX_THREADGROUP float* red) {
  constexpr int UNROLL = 4, V = M * COLS;
  constexpr int VP = V <= 1 ? 1 : V <= 2 ? 2 : V <= 4 ? 4 : V <= 8 ? 8 : V <= 16 ? 16 : 32;  // V <= 32
  const u32 K = 8 * KW, NG = KW / 4, steps = (KW + 31) / 32, run = (steps + S - 1) / S;
  const u32 first = sg * run, end = first + run < steps ? first + run : steps;
  WP wr[COLS];
  SP sr[COLS];
  for (int j = 0; j < COLS; j++) {
    const u64 row = (u64)e * N + (n0 + j < N ? n0 + j : N - 1);  // past N: read, write nothing
    wr[j] = w + row * KW + lane;
    sr[j] = scales + row * NG + lane / 4;
  }
  float acc[M][COLS];
  for (int m = 0; m < M; m++)
    for (int j = 0; j < COLS; j++) acc[m][j] = 0.0f;
  for (u32 st = first; st < end; st += UNROLL) {
    u32 code[UNROLL][COLS], sc[UNROLL][COLS];
    KX_UNROLL
    for (int j = 0; j < COLS; j++) {
      const WP wb = wr[j] + 32 * st;  // then constant offsets
      const SP sb = sr[j] + 8 * st;
      KX_UNROLL
      for (int u = 0; u < UNROLL; u++) {
        const bool in = st + u < end && 32 * (st + u) + lane < KW;
        code[u][j] = in ? wb[32 * u] : 0u;
        sc[u][j] = in ? (u32)sb[8 * u] : 0u;
      }
    }
    const XP xb = x + (u64)r0 * K + 8 * (32 * st + lane);  // then constant offsets per step
    KX_UNROLL
    for (int u = 0; u < UNROLL; u++) {
      if (st + u < end && 32 * (st + u) + lane < KW) {
        mxfp4_f8 xv[M];
        KX_UNROLL
        for (int m = 0; m < M; m++) xv[m] = mxfp4_x8<VEC>(xb + (u64)m * K + 256 * u);
        float p[M][COLS];
        bool usual = true;
        KX_UNROLL
        for (int j = 0; j < COLS; j++) {
          const mxfp4_f8 wv = mxfp4_codes(code[u][j]);
          KX_UNROLL
          for (int m = 0; m < M; m++) {
            p[m][j] = 0.0f;
            KX_UNROLL
            for (int t = 0; t < 8; t++) p[m][j] = KX_FMA(xv[m].v[t], wv.v[t], p[m][j]);
          }
          usual = usual && sc[u][j] <= 240u;
        }
        if (usual) {
          KX_UNROLL
          for (int j = 0; j < COLS; j++)
            for (int m = 0; m < M; m++) acc[m][j] = mxfp4_scaled(p[m][j], sc[u][j], acc[m][j]);
        } else {
          for (int j = 0; j < COLS; j++)
            for (int m = 0; m < M; m++) acc[m][j] = mxfp4_scaled_any(p[m][j], sc[u][j], acc[m][j]);
        }
      }
    }
  }
  // The butterfly, value i = m · COLS + j (padded with zeros to VP): at an offset o where a lane
  // holds c > 1 values, it keeps half (the upper half in lanes with bit o set) and adds its
  // partner's copies: the same sums a + b as a full butterfly (addition commutes), fewer shuffles.
  float v[VP];
  for (int i = 0; i < VP; i++) v[i] = i < V ? acc[i / COLS][i % COLS] : 0.0f;
  u32 base = 0;
  bool dup = false;  // a lane whose value another lane also holds (reported once)
  KX_UNROLL
  for (int k = 0; k < 5; k++) {
    const u32 o = 16u >> k;
    const bool up = (lane & o) != 0;
    const int c = VP >> k;  // values per lane before this offset
    if (c > 1) {
      KX_UNROLL
      for (int i = 0; i < VP / 2; i++)
        if (i < c / 2) {
          const float got = KX_SHUFFLE_XOR(up ? v[i] : v[i + c / 2], o);
          v[i] = (up ? v[i + c / 2] : v[i]) + got;
        }
      base += up ? (u32)(c / 2) : 0u;
    } else {
      dup = dup || up;
      v[0] += KX_SHUFFLE_XOR(v[0], o);
    }
  }
  if (!dup && base < (u32)V) red[sg * V + base] = v[0];
  KX_BARRIER();
  if (sg == 0 && lane < (u32)V) {
    float s = red[lane];
    for (u32 h = 1; h < S; h++) s += red[h * V + lane];
    const u32 m = lane / COLS, j = lane % COLS;
    if (n0 + j < N) y[(u64)(grp * M + m) * N + n0 + j] = s;
  }
}
