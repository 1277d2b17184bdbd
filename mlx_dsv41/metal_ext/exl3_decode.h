// EXL3 trellis decoding for the exl3_* kernels (docs/exl3.md#trellis), written against the KX_*
// macros.
//
// One SIMD group decodes one 16x16 tile: lane t holds trellis positions 8t..8t+7, which are tile
// rows {r0, r0+1, r0+8, r0+9} x cols {c0, c0+8} with r0 = 2(t%4), c0 = t/4
// (docs/exl3.md#tile-permutation). Bitrates are named by K2 = 2K (even: K = 1..8; odd: K =
// 1.5/2.5/3.5, docs/exl3.md#half-integer-k): position p's 16-bit state is the window of ring bits
// ending at floor((p+1)*K2/2), mod the tile's 128*K2 bits, MSB-first across little-endian uint32
// words.
//
// Cost per decoded weight (CUDA, MUL1): one state extraction (a shift and a mask, or one of them),
// one multiply, one byte sum (dp4a) and half of a pack and of a packed-fp16 fma.
#pragma once

#define EXL3_CB_3INST 0
#define EXL3_CB_MCG 1
#define EXL3_CB_MUL1 2

// Where one lane's bits sit in every tile of a matrix. Lane t needs ring bits
// [4t*K2 - 16, 4t*K2 + 4*K2): at most 80 bits, inside three consecutive words (mod 4*K2).
struct Exl3Lane {
  u32 w0, w1, w2;  // word indices within a tile (callers may add a common offset)
  u32 shift;       // offset of the window's first bit in word w0
};

template <int K2>
KX_INLINE Exl3Lane exl3_lane(u32 lane) {
  const u32 words = 4u * K2, ring = 128u * K2;
  const u32 start = (4u * K2 * lane + ring - 16u) % ring;
  Exl3Lane l;
  l.w0 = start >> 5;
  l.w1 = (l.w0 + 1u) % words;
  l.w2 = (l.w0 + 2u) % words;
  l.shift = (4u * K2 * lane - 16u) & 31u;  // = start & 31: the ring is a multiple of 32 bits
  return l;
}

// The lane's raw words of one tile (device or threadgroup memory). The window is 16 + 4*K2 bits
// starting at bit `shift` of a. The lanes' shifts are the multiples of G = gcd(4*K2, 32) below 32
// (G = 32: always 16), so the largest is 32 - G (16): when that window still ends within b (as for
// K = 1..3 and 4, and 2.5), no lane needs the third word, which then is not loaded (0).
#define EXL3_MAX_SHIFT(K2) ((4 * (K2)) % 32 == 0 ? 16 : 32 - ((4 * (K2)) & -(4 * (K2)) & 31))
#define EXL3_THIRD_WORD(K2) (EXL3_MAX_SHIFT(K2) + 16 + 4 * (K2) > 64)

struct Exl3Words {
  u32 a, b, c;
};

template <int K2, typename P>
KX_INLINE Exl3Words exl3_load(P tile, Exl3Lane l) {
  Exl3Words w;
  w.a = tile[l.w0];
  w.b = tile[l.w1];
  w.c = EXL3_THIRD_WORD(K2) ? tile[l.w2] : 0u;
  return w;
}

// The window shifted so that its first bit is bit 31 of x0 (then x1, x2): the state offsets below
// become compile-time constants. x1 exists for windows over 32 bits (K2 > 4), x2 over 64 (K2 > 12).
struct Exl3Window {
  u32 x0, x1, x2;
};

template <int K2>
KX_INLINE Exl3Window exl3_align(Exl3Words w, u32 shift) {
  Exl3Window r;
  r.x0 = KX_FUNNEL_L(w.b, w.a, shift);
  r.x1 = (K2 > 4) ? KX_FUNNEL_L(w.c, w.b, shift) : 0u;
  r.x2 = (K2 > 12) ? (w.c << shift) : 0u;
  return r;
}

// The 16 window bits starting at bit E (E <= 64), first bit most significant: one shift and one
// mask inside a word, a funnel shift and a mask across two. (Shift counts are masked to 0..31 so
// that the branches not taken for this E stay well-formed.)
template <int E>
KX_INLINE u32 exl3_bits16(Exl3Window w) {
  if (E + 16 <= 32) return (w.x0 >> ((16 - E) & 31)) & 0xFFFFu;
  if (E < 32) return KX_FUNNEL_R(w.x1, w.x0, (48 - E) & 31) & 0xFFFFu;
  if (E + 16 <= 64) return (w.x1 >> ((48 - E) & 31)) & 0xFFFFu;
  if (E < 64) return KX_FUNNEL_R(w.x2, w.x1, (80 - E) & 31) & 0xFFFFu;
  return (w.x2 >> ((80 - E) & 31)) & 0xFFFFu;
}

// The 32 window bits starting at bit E (E < 48, E % 32 != 0), first bit most significant.
template <int E>
KX_INLINE u32 exl3_bits32(Exl3Window w) {
  return (E < 32) ? KX_FUNNEL_L(w.x1, w.x0, E & 31) : KX_FUNNEL_L(w.x2, w.x1, E & 31);
}

// State j (1..8) of the lane: the 16 bits at E = floor(j*K2/2). For K = 4 and 8 the state 16 bits
// later is the lane's too, and one funnel shift yields both (top and bottom half): 1.5
// instructions per state instead of 2.
template <int K2, int J>
KX_INLINE u32 exl3_state(Exl3Window w) {
  const int E = J * K2 / 2;
  if ((K2 == 8 || K2 == 16) && E % 16 != 0) {
    if (E % 32 < 16) return exl3_bits32<E>(w) >> 16;
    return exl3_bits32<(E >= 16 ? E - 16 : 0)>(w) & 0xFFFFu;
  }
  return exl3_bits16<E>(w);
}

// Two states -> their fp16 values packed (first in the low half), bit-exact
// (docs/exl3.md#codebooks): MUL1 is fp16(h * K_INV + K_BIAS) with h = 1024 + bytesum as fp16 bits
// 0x6400 + bytesum, a fused multiply-add with one rounding (exact for every byte sum:
// tests/test_exl3_decode.py); 3INST/MCG add the two fp16 halves of a masked word (one rounding).
template <int CB>
KX_INLINE u32 exl3_decode_pair(u32 s0, u32 s1) {
  if (CB == EXL3_CB_MUL1) {
    const u32 h0 = KX_BYTE_SUM(s0 * 0x83DCD12Du, 0x6400u);
    const u32 h1 = KX_BYTE_SUM(s1 * 0x83DCD12Du, 0x6400u);
    return KX_HFMA2_BITS(KX_PACK_LO16(h0, h1), 0x1EEE1EEEu, 0xC931C931u);
  }
  u32 x0 = (CB == EXL3_CB_MCG) ? s0 * 0xCBAC1FEDu : s0 * 89226354u + 64248484u;
  u32 x1 = (CB == EXL3_CB_MCG) ? s1 * 0xCBAC1FEDu : s1 * 89226354u + 64248484u;
  x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
  x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
  return KX_HADD2_BITS(KX_PACK_LO16(x0, x1), (x0 >> 16) | (x1 & 0xFFFF0000u));
}

// A lane's 8 decoded weights as fp16 pairs: h[0] = rows (r0, r0+1) and h[1] = rows (r0+8, r0+9) of
// column c0; h[2], h[3] the same rows of column c0+8.
struct Exl3Frag {
  u32 h[4];
};

template <int K2, int CB>
KX_INLINE Exl3Frag exl3_decode(Exl3Words words, u32 shift) {
  // Position 8t + j - 1 of the lane is its state j.
  const Exl3Window w = exl3_align<K2>(words, shift);
  Exl3Frag f;
  f.h[0] = exl3_decode_pair<CB>(exl3_state<K2, 1>(w), exl3_state<K2, 2>(w));
  f.h[1] = exl3_decode_pair<CB>(exl3_state<K2, 3>(w), exl3_state<K2, 4>(w));
  f.h[2] = exl3_decode_pair<CB>(exl3_state<K2, 5>(w), exl3_state<K2, 6>(w));
  f.h[3] = exl3_decode_pair<CB>(exl3_state<K2, 7>(w), exl3_state<K2, 8>(w));
  return f;
}
