// exl3_reconstruct: W̃ (k, n) fp16 from an EXL3 trellis (k/16, n/16, 16K), bit-exact
// (docs/exl3.md#trellis). Threadgroup = 8 SIMD groups = tile row KX_TGID_Y x tile columns
// 8*KX_TGID_X .. +7, one tile per group; the 16 x 128 block is staged in threadgroup memory and
// written as contiguous rows. Template: K2 (= 2K), CB (codebook). The int16 trellis is read as
// little-endian uint32 words.
const u32 lane = KX_LANE, warp = KX_WARP;
const u32 tk = KX_TGID_Y, col_block = KX_TGID_X;
const u32 tiles_n = trellis_shape[1];
const u32 n = tiles_n * 16;
KX_SHARED(u32, stage, 16 * 64);  // 16 rows x 128 fp16
KX_THREADGROUP u16* stage16 = (KX_THREADGROUP u16*)stage;

const Exl3Lane l = exl3_lane<K2>(lane);
const KX_DEVICE u32* tile = (const KX_DEVICE u32*)trellis + ((u64)tk * tiles_n + col_block * 8 + warp) * (4 * K2);
const Exl3Frag f = exl3_decode<K2, CB>(exl3_load<K2>(tile, l), l.shift);
const u32 r0 = 2 * (lane & 3u), col = warp * 16 + (lane >> 2);
for (int h = 0; h < 2; h++) {  // columns c0 and c0 + 8
  stage16[r0 * 128 + col + 8 * h] = (u16)(f.h[2 * h] & 0xFFFFu);
  stage16[(r0 + 1) * 128 + col + 8 * h] = (u16)(f.h[2 * h] >> 16);
  stage16[(r0 + 8) * 128 + col + 8 * h] = (u16)(f.h[2 * h + 1] & 0xFFFFu);
  stage16[(r0 + 9) * 128 + col + 8 * h] = (u16)(f.h[2 * h + 1] >> 16);
}
KX_BARRIER();
KX_DEVICE u32* out_words = (KX_DEVICE u32*)out;
for (u32 i = KX_LID_X; i < 16 * 64; i += 256) {
  const u32 r = i / 64, j = i % 64;
  out_words[((u64)(tk * 16 + r) * n + col_block * 128) / 2 + j] = stage[i];
}
