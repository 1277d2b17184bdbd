"""exl3_gemv's ROPE and RING on the GPU (docs/design.md#roped-linears; the simulator's checks in
tests/test_roped_gemv_sim.py): at Flash's shapes (wq_b 1,280 -> 64 heads of 512, K = 3; wq_a with
q_norm and wkv, 5,120 -> 1,280 and 512, K = 5, a ring of 160 slots) and small ones, against the
launches they replace (the GEMV, then the rope kernel), with an inf and a NaN among the output
scales; outputs poisoned (NaN) with guard rows that stay untouched, five launches byte-identical,
the RING counters back at 0, and the model's ops (quant.linear_into, quant.windowed_linears) on
EXL3Linear giving the same bytes."""

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import FLASH_YARN, random_norm
from test_roped_gemv_sim import bits, random_rows

from mlx_dsv41.exl3 import EXL3Linear
from mlx_dsv41.exl3.synthetic import random_linear_tensors
from mlx_dsv41.kernels import exl3 as launch
from mlx_dsv41.kernels import fake_quant as fqk
from mlx_dsv41.kernels import rope as rope_kernel
from mlx_dsv41.kernels.rope import Turn, WindowWrite
from mlx_dsv41.model.norm import RMSNorm
from mlx_dsv41.model.rope import RoPE

NAN = float("nan")


def same(arrays) -> bool:
    return all(np.array_equal(bits(arrays[0]), bits(a)) for a in arrays[1:])


def host(a: mx.array) -> np.ndarray:
    """a's values on the host; bf16 as its uint16 bits."""
    mx.eval(a)
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def floats(a: np.ndarray) -> np.ndarray:
    """host()'s values as float32 (bf16 bits widened)."""
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


def nan(a: np.ndarray) -> np.ndarray:
    return np.isnan(floats(a))


@pytest.mark.parametrize(
    "B, S, k, heads, width, dtype, at",
    [
        (1, 1, 1280, 64, 512, mx.bfloat16, 4093),  # Flash's wq_b
        (1, 2, 1280, 64, 512, mx.bfloat16, 100),
        (2, 3, 256, 4, 128, mx.bfloat16, 10),
        (1, 2, 256, 4, 128, mx.float16, 7),
        (2, 1, 256, 4, 128, mx.float32, 1),
    ],
)
def test_a_gemv_that_turns_its_rows_gives_the_gemv_then_the_rope_kernel_bytes(
    monkeypatch, B, S, k, heads, width, dtype, at
):
    from mlx_dsv41.quant import linear_into

    n = heads * width
    monkeypatch.setattr(launch, "TUNING", launch.Tuning(dense_single_blocks=min(128, n // 128)))  # one split
    trellis, suh, svh = (mx.array(v) for v in _stored(k, n, 3, k + S).values())
    x = random_rows((B, S, k), dtype, seed=at)
    periods = RoPE(64, 160000.0, FLASH_YARN).whole_width(width)
    offset, shape, m = mx.array(at, mx.int32), (B, S, heads, width), B * S
    turn = Turn(offset, periods)
    y = launch.run_gemv(x, trellis, suh, svh, "mul1", None, dtype, out_shape=shape)
    want = host(rope_kernel.run(y, offset, periods, dtype, 1, False, None)).reshape(m, n)
    (call,) = launch.gemv_args(x, trellis, suh, svh, "mul1", None, dtype, guard_rows=2, init_value=NAN, rope=turn)
    assert dict(call["template"])["ROPE"] == 1 and dict(call["template"])["FUSED"]
    runs = [host(launch.GEMV(**call)[0]) for _ in range(5)]
    assert same(runs)
    got = runs[0]
    assert np.array_equal(bits(got[:m]), bits(want)) and np.all(nan(got[m:]))
    assert nan(want).any() and np.isinf(floats(want)).any() and np.isfinite(floats(want)).mean() > 0.9
    linear = EXL3Linear.from_stored({key: mx.array(v) for key, v in _stored(k, n, 3, k + S, "p").items()}, "p")
    assert np.array_equal(bits(host(linear_into(linear, x, shape, rope=turn)).reshape(m, n)), bits(want))


@pytest.mark.parametrize(
    "B, S, k, n1, n2, bits_k, at, norm",
    [
        (1, 1, 5120, 1280, 512, 5, 4093, True),  # Flash's wq_a (q_norm) and wkv, the ring wrapping
        (1, 1, 5120, 1280, 512, 5, 159, False),
        (2, 3, 2048, 384, 128, 3, 10, True),
        (1, 6, 1024, 512, 256, 4, 20, True),
    ],
)
def test_a_paired_gemv_that_writes_the_window_gives_the_pair_then_the_rope_kernel_bytes(
    B, S, k, n1, n2, bits_k, at, norm
):
    first, second = (
        [mx.array(v) for v in _stored(k, n, bits_k, seed).values()] for n, seed in ((n1, 70 + S), (n2, 71 + S))
    )
    x = random_rows((B, S, k), mx.bfloat16, seed=at)
    R = 160 if n2 == 512 else 6 + S
    ring, kv_norm = random_rows((B, R, n2), mx.bfloat16, seed=7), random_norm(n2)
    periods, offset = RoPE(64, 160000.0, FLASH_YARN).whole_width(n2), mx.array(at, mx.int32)
    quant = (32, fqk.FP8_UE8M0)
    window = WindowWrite(offset, periods, kv_norm.weight, kv_norm.eps, quant, ring)
    q_norm = RMSNorm(n1, 1e-6)
    q_norm.weight = mx.array(np.random.default_rng(3).normal(1, 0.5, n1).astype(np.float32))
    nrm = (q_norm.weight, q_norm.eps) if norm else None
    f4, s4 = (*first, "mul1"), (*second, "mul1")
    assert launch.window_gemv_fits(x, (*f4, None), (*s4, None), window)
    size = (n1 + n2) // 128 + norm
    y, y2 = launch.run_gemv_pair(x, f4, s4, mx.bfloat16, launch.split_counters(size), nrm)
    want_ring = host(
        rope_kernel.run(y2, offset, periods, mx.bfloat16, 1, False, quant, (kv_norm.weight, kv_norm.eps), ring)
    )
    counters = launch.split_counters(size + 1)
    (call,) = launch.gemv_args(
        x, *f4, None, mx.bfloat16, guard_rows=2, init_value=NAN, counters=counters, norm=nrm, pair=s4, window=window
    )
    runs = []
    for _ in range(5):
        _, got_y, got_y2, written = launch.GEMV(**call)
        runs.append((host(got_y), host(got_y2), host(written)))
    assert all(same([r[i] for r in runs]) for i in range(3)) and not np.array(counters).any()
    got_y, got_y2, written = runs[0]
    m = B * S
    assert np.array_equal(bits(got_y[:m]), bits(host(y).reshape(m, n1)))
    assert np.array_equal(bits(got_y2[:m]), bits(host(y2).reshape(m, n2)))
    assert np.all(nan(got_y[m:])) and np.all(nan(got_y2[m:]))
    assert np.array_equal(bits(written), bits(want_ring))
    slots = sorted({(at + s) % R for s in range(S)})
    assert not np.array_equal(bits(written)[:, slots], bits(host(ring))[:, slots])
    # the op the model calls, on EXL3Linear
    from mlx_dsv41.quant import windowed_linears

    a, b = (
        EXL3Linear.from_stored({key: mx.array(v) for key, v in _stored(k, n, bits_k, seed, "p").items()}, "p")
        for n, seed in ((n1, 70 + S), (n2, 71 + S))
    )
    if norm:
        qr, keys = windowed_linears(a, b, x, q_norm, window)
        assert np.array_equal(bits(host(qr)), bits(host(y))) and np.array_equal(bits(host(keys)), bits(want_ring))


def _stored(k: int, n: int, bits_k: int, seed: int, prefix: str | None = None) -> dict:
    """A random linear's stored tensors (trellis, suh, svh: an inf and a NaN in svh), keyed as
    EXL3Linear.from_stored reads them under `prefix`, or by bare name (in that order) without."""
    t = random_linear_tensors(k, n, bits_k, "mul1", seed=seed, prefix=prefix or "p")
    svh = np.array(t["p.svh" if prefix is None else f"{prefix}.svh"])
    svh[[5, n - 3]] = [np.inf, np.nan]
    out = {key: (svh if key.endswith("svh") else v) for key, v in t.items()}
    return out if prefix is not None else {name: out[f"p.{name}"] for name in ("trellis", "suh", "svh")}
