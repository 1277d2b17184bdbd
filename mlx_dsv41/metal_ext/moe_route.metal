// moe_route: the router's choice for token KX_TGID_X (docs/model.md#moe) from its fp32 logits:
//   s = sqrt(softplus(logit / TEMP)); pick the K largest s + bias (ties: the lower expert id);
//   indices ascending; weights = s[idx] / (Σ s[idx] + 1e-20) · SCALE, the sum in index order.
// softplus(l) = max(l, 0) + log1p(exp(-|l|)) (MLX's logaddexp(l, 0)). 256 threads: scores in
// threadgroup memory, K rounds of a fixed-order arg-max (xor butterflies, then SIMD groups in order).
// Inputs: logits [T, E] float32 (E <= 1024), bias [E] float32. Outputs: indices [T, K] int32,
// weights [T, K] float32. Template: K (<= 16), TEMP_BITS, SCALE_BITS.
const u32 lid = KX_LID_X, lane = KX_LANE, warp = KX_WARP;
const u32 t = KX_TGID_X;
const u32 E = logits_shape[1];
KX_SHARED(float, score, 1024);
KX_SHARED(float, key, 1024);
KX_SHARED(float, best_v, 8);
KX_SHARED(int, best_i, 8);
KX_SHARED(int, chosen, 16);
const float temp = KX_BITS_F32(TEMP_BITS);
for (u32 e = lid; e < E; e += 256) {
  float l = logits[(u64)t * E + e];
  if (temp != 1.0f) l = l / temp;
  const float s = KX_SQRT(KX_FMAX(l, 0.0f) + moe_log1p(KX_EXP(-(l < 0.0f ? -l : l))));
  score[e] = s;
  key[e] = s + bias[e];
}
KX_BARRIER();
for (int r = 0; r < K; r++) {
  MoeBest b = {-KX_INF_F32, (int)E};
  for (u32 e = lid; e < E; e += 256) b = moe_better(b, key[e], (int)e);
  for (u32 m = 16; m > 0; m >>= 1) b = moe_better(b, KX_SHUFFLE_XOR(b.v, m), KX_SHUFFLE_XOR(b.i, m));
  if (lane == 0) {
    best_v[warp] = b.v;
    best_i[warp] = b.i;
  }
  KX_BARRIER();
  if (lid == 0) {
    MoeBest w0 = {best_v[0], best_i[0]};
    for (int w = 1; w < 8; w++) w0 = moe_better(w0, best_v[w], best_i[w]);
    const int pick = w0.i < (int)E ? w0.i : r;  // all NaN: any index (the weights are NaN)
    chosen[r] = pick;
    key[pick] = -KX_INF_F32;
  }
  KX_BARRIER();
}
if (lid == 0) {
  for (int a = 1; a < K; a++) {  // ascending expert id: the reference's accumulation order
    const int v = chosen[a];
    int b = a - 1;
    for (; b >= 0 && chosen[b] > v; b--) chosen[b + 1] = chosen[b];
    chosen[b + 1] = v;
  }
  float sum = 0.0f;
  for (int j = 0; j < K; j++) sum += score[chosen[j]];
  const float scale = KX_BITS_F32(SCALE_BITS);
  for (int j = 0; j < K; j++) {
    indices[(u64)t * K + j] = chosen[j];
    weights[(u64)t * K + j] = score[chosen[j]] / (sum + 1e-20f) * scale;
  }
}
