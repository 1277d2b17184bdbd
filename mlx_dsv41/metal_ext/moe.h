// Helpers of moe_route (docs/model.md#moe).
#pragma once

// log(1 + x) for x >= 0, accurate where 1 + x rounds (Kahan: log(u) · x / (u - 1), u = 1 + x).
KX_INLINE float moe_log1p(float x) {
  const float u = 1.0f + x;
  return (u == 1.0f) ? x : KX_LOG(u) * (x / (u - 1.0f));
}

// The better of a and (v, i): the larger value, or the lower index on a tie; NaN never wins.
struct MoeBest {
  float v;
  int i;
};
KX_INLINE MoeBest moe_better(MoeBest a, float v, int i) {
  if (v > a.v || (v == a.v && i < a.i)) {
    const MoeBest b = {v, i};
    return b;
  }
  return a;
}

// moe_route's work for token t (moe_route.metal: what it computes, in which order) by a threadgroup
// of 256 threads. Threadgroup memory: score and key 1024 floats each, best_v 8 floats, best_i 8 ints,
// chosen 16 ints. logits are read through L2: in moe_gate the other threadgroups of the launch
// wrote them. Shared by moe_route and moe_gate, so both give the same bytes.
template <int K>
KX_INLINE void moe_route_token(const KX_DEVICE float* logits, const KX_DEVICE float* bias, KX_DEVICE int* indices,
                               KX_DEVICE float* weights, u32 E, u32 t, u32 temp_bits, u32 scale_bits,
                               KX_THREADGROUP float* score, KX_THREADGROUP float* key, KX_THREADGROUP float* best_v,
                               KX_THREADGROUP int* best_i, KX_THREADGROUP int* chosen, u32 lid, u32 lane, u32 warp) {
  const float temp = KX_BITS_F32(temp_bits);
  for (u32 e = lid; e < E; e += 256) {
    float l = KX_LOAD_CG(logits + (u64)t * E + e);
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
    const float scale = KX_BITS_F32(scale_bits);
    for (int j = 0; j < K; j++) {
      indices[(u64)t * K + j] = chosen[j];
      weights[(u64)t * K + j] = score[chosen[j]] / (sum + 1e-20f) * scale;
    }
  }
}
