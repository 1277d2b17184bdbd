// moe_route: the router's choice for token KX_TGID_X (docs/model.md#moe) from its fp32 logits:
//   s = sqrt(softplus(logit / TEMP)); pick the K largest s + bias (ties: the lower expert id);
//   indices ascending; weights = s[idx] / (Σ s[idx] + 1e-20) · SCALE, the sum in index order.
// softplus(l) = max(l, 0) + log1p(exp(-|l|)) (MLX's logaddexp(l, 0)). 256 threads: scores in
// threadgroup memory, K rounds of a fixed-order arg-max (xor butterflies, then SIMD groups in order).
// Inputs: logits [T, E] float32 (E <= 1024), bias [E] float32. Outputs: indices [T, K] int32,
// weights [T, K] float32. Template: K (<= 16), TEMP_BITS, SCALE_BITS.
KX_SHARED(float, score, 1024);
KX_SHARED(float, key, 1024);
KX_SHARED(float, best_v, 8);
KX_SHARED(int, best_i, 8);
KX_SHARED(int, chosen, 16);
moe_route_token<K>(logits, bias, indices, weights, logits_shape[1], KX_TGID_X, TEMP_BITS, SCALE_BITS, score, key,
                   best_v, best_i, chosen, KX_LID_X, KX_LANE, KX_WARP);
