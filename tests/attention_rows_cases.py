"""The rows sparse-attention kernel's test cases and their float64 answer (docs/model.md#attention-rows),
shared by the simulator test (tests/test_sparse_attention_rows_sim.py) and the GPU test
(tests/gpu/test_sparse_attention_rows_gpu.py)."""

import mlx.core as mx
import numpy as np

BOUND = 3e-5  # of the output scale: the P·V split keeps ~16 bits of p (docs/model.md#attention-rows)


def _bf16(a):
    return mx.array(a.astype(np.float32)).astype(mx.bfloat16)


def make_case(seed, B, S, H, D, W, T, N, poison=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    window = rng.standard_normal((B, W, D)).astype(np.float32)
    pool = rng.standard_normal((B, T, D)).astype(np.float32)
    indices = rng.integers(-1, max(W + T, 1), (B, S, N)).astype(np.int32)
    sinks = rng.standard_normal(H).astype(np.float32)
    if poison == "nonfinite":
        q[0, 0, 1, 5] = np.nan  # one (row, head): NaN outputs
        if W:
            window[0, 0, 7] = np.inf
        if T:
            pool[0, T - 1, 3] = np.nan
        indices[0, min(1, S - 1), 0] = W + T + 3  # invalid: NaN outputs for that row
        indices[0, S - 1] = rng.integers(1, W + T - 1, N)  # the last row avoids the nonfinite keys
        sinks[2] = -np.inf
        sinks[3] = np.nan
    return [_bf16(q), _bf16(window), _bf16(pool), mx.array(indices), mx.array(sinks)]


def float64_attention(q, window, pool, indices, sinks, scale):
    q, window, pool = (np.array(a.astype(mx.float32), np.float64) for a in (q, window, pool))
    indices, sinks = np.array(indices), np.array(sinks, np.float64)
    B, S, H, D = q.shape
    W, T = window.shape[1], pool.shape[1]
    out = np.zeros((B, S, H, D))
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(B):
            kv = np.concatenate([window[b], pool[b]])
            for s in range(S):
                idx = indices[b, s]
                rows = idx[idx >= 0]
                bad = np.any((idx < -1) | (idx >= W + T))
                keys = kv[rows[rows < W + T]]
                for h in range(H):
                    logits = keys @ q[b, s, h] * scale
                    if bad:
                        logits = np.append(logits, np.nan)
                    m = np.max(np.append(logits, sinks[h])) if logits.size else sinks[h]
                    if np.isnan(logits).any():
                        m = np.nan
                    p = np.exp(logits - m)
                    values = p[: len(keys)] @ keys if len(keys) else np.zeros(D)
                    out[b, s, h] = values / (p.sum() + np.exp(sinks[h] - m))
    return out


CASES = {  # name: (seed, B, S, H, D, W, T, N, poison)
    "dim512-keys37": (1, 1, 3, 16, 512, 9, 40, 37, None),
    "dim256-heads32-batch2": (2, 2, 2, 32, 256, 12, 20, 16, None),
    "window-only": (3, 1, 2, 16, 256, 20, 0, 21, None),
    "pool-only": (4, 1, 2, 16, 256, 0, 30, 17, None),
    "no-keys": (5, 1, 2, 16, 256, 4, 4, 0, None),
    "nonfinite": (6, 1, 3, 16, 256, 8, 12, 24, "nonfinite"),
}
