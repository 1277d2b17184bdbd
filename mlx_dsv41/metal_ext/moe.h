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
