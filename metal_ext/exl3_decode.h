// EXL3 trellis decoding for the exl3_* kernels (exl3 spec §2), written against the KX_* macros.
//
// One SIMD group decodes one 16x16 tile: lane t holds trellis positions 8t..8t+7, which are tile
// rows {r0, r0+1, r0+8, r0+9} x cols {c0, c0+8} with r0 = 2(t%4), c0 = t/4 (spec §2.2) -- exactly
// the B fragments of two m16n8k16 MMAs. Bitrates are named by K2 = 2K (even: K = 1..8; odd:
// K = 1.5/2.5/3.5, spec §2.6): position p's 16-bit state is the window of ring bits ending at
// floor((p+1)*K2/2), mod the tile's 128*K2 bits, MSB-first across little-endian uint32 words.
#pragma once

#define EXL3_CB_3INST 0
#define EXL3_CB_MCG 1
#define EXL3_CB_MUL1 2

// Where one lane's bits sit in every tile of a matrix. Lane t needs ring bits
// [4t*K2 - 16, 4t*K2 + 4*K2): at most 80 bits, inside three consecutive words (mod 4*K2).
struct Exl3Lane {
  u32 w0, w1, w2;  // word indices within a tile
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
  l.shift = start & 31u;
  return l;
}

// The lane's raw words of one tile. For K <= 2 the window never reaches a third word.
struct Exl3Words {
  u32 a, b, c;
};

template <int K2>
KX_INLINE Exl3Words exl3_load(const KX_DEVICE u32* tile, Exl3Lane l) {
  Exl3Words w;
  w.a = tile[l.w0];
  w.b = tile[l.w1];
  w.c = (K2 > 4) ? tile[l.w2] : 0u;
  return w;
}

// The window shifted so that its first bit is bit 31 of x0 (then x1, x2): state offsets become
// compile-time constants.
struct Exl3Window {
  u32 x0, x1, x2;
};

KX_INLINE Exl3Window exl3_align(Exl3Words w, u32 shift) {
  Exl3Window r;
  r.x0 = (u32)(((((u64)w.a) << 32) | (u64)w.b) >> (32u - shift));
  r.x1 = (u32)(((((u64)w.b) << 32) | (u64)w.c) >> (32u - shift));
  r.x2 = w.c << shift;
  return r;
}

// The 16 window bits starting at bit E (E <= 64), first bit most significant.
template <int E>
KX_INLINE u32 exl3_bits16(Exl3Window w) {
  const u64 pair = (E < 32) ? ((((u64)w.x0) << 32) | (u64)w.x1) : ((((u64)w.x1) << 32) | (u64)w.x2);
  return (u32)(pair >> ((E < 32) ? (48 - E) : (80 - E))) & 0xFFFFu;
}

// Two states -> their fp16 values packed (first in the low half), bit-exact (spec §2.5):
// MUL1 is fp16(h * K_INV + K_BIAS) with h = 1024 + bytesum as fp16 bits 0x6400 + bytesum, a fused
// multiply-add with one rounding; 3INST/MCG add the two fp16 halves of a masked word (one rounding).
template <int CB>
KX_INLINE u32 exl3_decode_pair(u32 s0, u32 s1) {
  if (CB == EXL3_CB_MUL1) {
    const u32 h0 = KX_BYTE_SUM(s0 * 0x83DCD12Du, 0x6400u);
    const u32 h1 = KX_BYTE_SUM(s1 * 0x83DCD12Du, 0x6400u);
    return KX_HFMA2_BITS(h0 | (h1 << 16), 0x1EEE1EEEu, 0xC931C931u);
  }
  u32 x0 = (CB == EXL3_CB_MCG) ? s0 * 0xCBAC1FEDu : s0 * 89226354u + 64248484u;
  u32 x1 = (CB == EXL3_CB_MCG) ? s1 * 0xCBAC1FEDu : s1 * 89226354u + 64248484u;
  x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
  x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
  return KX_HADD2_BITS((x0 & 0xFFFFu) | (x1 << 16), (x0 >> 16) | (x1 & 0xFFFF0000u));
}

// A lane's 8 decoded weights as fp16 pairs: h[0] = rows (r0, r0+1) and h[1] = rows (r0+8, r0+9) of
// column c0; h[2], h[3] the same rows of column c0+8.
struct Exl3Frag {
  u32 h[4];
};

template <int K2, int CB>
KX_INLINE Exl3Frag exl3_decode(Exl3Words words, Exl3Lane l) {
  // State j of the lane starts floor((j+1)*K2/2) bits into the window.
  const Exl3Window w = exl3_align(words, l.shift);
  Exl3Frag f;
  f.h[0] = exl3_decode_pair<CB>(exl3_bits16<(1 * K2) / 2>(w), exl3_bits16<(2 * K2) / 2>(w));
  f.h[1] = exl3_decode_pair<CB>(exl3_bits16<(3 * K2) / 2>(w), exl3_bits16<(4 * K2) / 2>(w));
  f.h[2] = exl3_decode_pair<CB>(exl3_bits16<(5 * K2) / 2>(w), exl3_bits16<(6 * K2) / 2>(w));
  f.h[3] = exl3_decode_pair<CB>(exl3_bits16<(7 * K2) / 2>(w), exl3_bits16<(8 * K2) / 2>(w));
  return f;
}
