// fake_quant: x rounded to the values a block float format holds, in x's dtype
// (docs/model.md#fake-quant; the plain-MLX twin is mlx_dsv41/model/fake_quant.py, op for op:
// the same integer bit arithmetic, the same NaN propagation, so the bytes are the same).
// One thread per element, a block of BLOCK (16 or 32) consecutive elements of the last axis in
// consecutive lanes: the block's amax meets in a xor butterfly over those lanes.
// Template: T, BLOCK, MODE (0: e4m3, ue8m0 scale; 1: e2m1, ue8m0 scale; 2: e2m1, e4m3 scale).
const u32 i = KX_TID_X;
const u32 n = x_shape[0] * x_shape[1];  // x [rows, D], D % BLOCK == 0
const bool live = i < n;
const float v = live ? KX_TO_F32(x[i]) : 0.0f;
float amax = fq_abs(v);
for (u32 m = BLOCK / 2; m > 0; m >>= 1) amax = fq_max(amax, KX_SHUFFLE_XOR(amax, m));
float q;
if (MODE == 0) {
  const float s = fq_ue8m0_scale(fq_max(amax, 1e-4f), 448.0f);
  q = fq_round_to_grid(v / s, 3, -6, 448.0f) * s;
} else if (MODE == 1) {
  const float s = fq_ue8m0_scale(fq_max(amax, 6.0f * KX_BITS_F32(0x00800000u)), 6.0f);  // amax/6 >= 2^-126
  q = fq_round_to_grid(v / s, 1, 0, 6.0f) * s;
} else {
  const float s = fq_round_to_grid(fq_max(amax, 6.0f * KX_BITS_F32(0x3B000000u)) / 6.0f, 3, -6, 448.0f);  // 2^-9
  q = fq_round_to_grid(v / s, 1, 0, 6.0f) * s;
}
if (live) out[i] = static_cast<T>(q);
