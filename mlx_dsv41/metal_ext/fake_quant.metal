// fake_quant: x rounded to the values a block float format holds, in x's dtype
// (docs/model.md#fake-quant; the plain-MLX twin is mlx_dsv41/model/fake_quant.py, op for op:
// the same integer bit arithmetic, the same NaN propagation, so the bytes are the same).
// One thread per element, a block of BLOCK (16 or 32) consecutive elements of the last axis in
// consecutive lanes (fq_quantize, fake_quant.h).
// Template: T, BLOCK, MODE (0: e4m3, ue8m0 scale; 1: e2m1, ue8m0 scale; 2: e2m1, e4m3 scale).
const u32 i = KX_TID_X;
const u32 n = x_shape[0] * x_shape[1];  // x [rows, D], D % BLOCK == 0
const bool live = i < n;
const float q = fq_quantize(live ? KX_TO_F32(x[i]) : 0.0f, BLOCK, MODE);
if (live) out[i] = static_cast<T>(q);
