"""The whole tiny model (every layer role, two Engram layers, MoE, mHC) on the GPU backend
(run by `bash benchmarks/gpu_run.sh tests`; skipped on CPU; no mlx-lm needed).

- fp32 weights: GPU logits agree with MLX's CPU stream to fp32-level noise (fake-quant boundary
  flips aside) and pick the same greedy tokens;
- bf16 weights (the checkpoint dtype): close on average, mostly the same greedy tokens (GPU bf16
  GEMMs round differently; a near-tie in routing or top-k then flips a whole expert or entry);
- decode one token at a time and chunked prefill == one prefill, to the same bounds (GPU GEMMs
  change with the number of rows, so not bit for bit as on the CPU).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.synthetic import random_weights, tiny_args, tiny_model

L = 24


def _model(dtype):
    args = tiny_args()
    weights = {k: v.astype(dtype) if v.dtype == mx.bfloat16 else v for k, v in random_weights(args, 0).items()}
    return tiny_model(args, weights=weights)


def _ids():
    return mx.array(np.random.default_rng(1).integers(0, 159, (2, L)))


def _check(got, ref, dtype, what):
    assert np.isfinite(got).all(), what
    # Per-row error relative to the logit scale. A few rows may jump: one rounding difference at a
    # fake-quant boundary or a near-tie in routing / top-k flips a whole value or expert, and the
    # random tiny model amplifies it; most rows must agree to the dtype's rounding level.
    scale = np.abs(ref).max()
    row_err = np.abs(got - ref).max(-1) / scale
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    if dtype == mx.float32:
        ok = np.median(row_err) <= 1e-3 and np.quantile(row_err, 0.9) <= 2e-2 and agree >= 0.9
    else:
        ok = np.median(row_err) <= 3e-2 and agree >= 0.8
    assert ok, (what, float(np.median(row_err)), float(np.quantile(row_err, 0.9)), float(row_err.max()), agree)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gpu_matches_cpu_stream(dtype):
    model, ids = _model(dtype), _ids()
    gpu = np.array(model(ids, model.make_cache()))
    with mx.stream(mx.cpu):
        cpu = np.array(model(ids, model.make_cache()))
    _check(gpu, cpu, dtype, "GPU vs CPU")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gpu_decode_and_chunks_equal_prefill(dtype):
    model, ids = _model(dtype), _ids()
    full = np.array(model(ids, model.make_cache()))
    cache = model.make_cache()
    decode = np.concatenate([np.array(model(ids[:, t : t + 1], cache)) for t in range(L)], axis=1)
    _check(decode, full, dtype, "decode vs prefill")
    for n in (3, 8, 13):
        cache = model.make_cache()
        chunks = np.concatenate([np.array(model(ids[:, s : s + n], cache)) for s in range(0, L, n)], axis=1)
        _check(chunks, full, dtype, f"chunks of {n}")
