"""exl3_gemv's ROPE and RING (docs/design.md#roped-linears) on the CPU simulator: a one-split
launch that turns the rows it stores (the queries' wq_b), and a paired launch whose second
linear's rows it writes into the window ring as the window keys (wq_a and wkv), each against the
bytes of the launches they replace (the GEMV, then the rope kernel). Outputs start poisoned: guard
rows stay untouched; the linears' data are random with an inf and a NaN among the output scales,
so nonfinite values go through the rope as they do through the rope kernel. Then the attention's
queries and window keys through the model (Attention.queries_and_window) on the simulated kernels:
two launches where there were three, the same q, qr and ring.
tests/gpu/test_roped_gemv_gpu.py repeats the kernel checks on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import mlx.utils
import numpy as np
import pytest
from attention_stack import FLASH_YARN, random_norm, tiny_args

from mlx_dsv41.cache import make_layer_cache
from mlx_dsv41.exl3 import EXL3Linear
from mlx_dsv41.exl3.synthetic import random_linear_tensors
from mlx_dsv41.kernels import exl3 as launch
from mlx_dsv41.kernels import fake_quant as fqk
from mlx_dsv41.kernels import rope as rope_kernel
from mlx_dsv41.kernels.rope import Turn, WindowWrite
from mlx_dsv41.model.rope import RoPE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

NAN = float("nan")


def linear_arrays(k: int, n: int, seed: int, nonfinite: bool = True):
    """(trellis, suh, svh) of a random 3-bit mul1 linear; svh holds an inf and a NaN."""
    t = random_linear_tensors(k, n, 3, "mul1", seed=seed)
    svh = np.array(t["svh"])
    if nonfinite:
        svh[[5, n - 3]] = [np.inf, np.nan]
    return mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(svh)


def random_rows(shape, dtype, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32)).astype(dtype)


def to_mx(a: np.ndarray, dtype) -> mx.array:
    """A simulator output back as an MLX array of `dtype`."""
    return mx.array(a.view(np.uint16)).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(a)


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.array(a.view(mx.uint16)) if isinstance(a, mx.array) and a.dtype == mx.bfloat16 else a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize(
    "dtype, B, S, at, mma",
    [
        (mx.bfloat16, 1, 1, 4093, True),
        (mx.bfloat16, 2, 3, 10, False),
        (mx.float16, 1, 2, 7, True),
        (mx.float32, 2, 1, 1, True),
    ],
)
def test_a_gemv_that_turns_its_rows_gives_the_gemv_then_the_rope_kernel_bytes(dtype, B, S, at, mma):
    """ROPE: the rows a one-split exl3_gemv stores, turned in its own threadgroups (4 heads of 128 at
    positions at + s, YaRN periods and the leading inf periods of whole_width), have the bytes of
    the GEMV's output then the rope kernel's; the guard rows keep their poison."""
    trellis, suh, svh = linear_arrays(256, 512, seed=B * 10 + S)
    x = random_rows((B, S, 256), dtype, seed=at)
    periods = RoPE(64, 160000.0, FLASH_YARN).whole_width(128)
    offset, heads = mx.array(at, mx.int32), (B, S, 4, 128)
    turned = launch.gemv_args(
        x, trellis, suh, svh, "mul1", None, dtype, splits=1, guard_rows=2, init_value=NAN, rope=Turn(offset, periods)
    )
    plain = launch.gemv_args(x, trellis, suh, svh, "mul1", None, dtype, splits=1, out_shape=heads)
    rope = rope_kernel.args(mx.zeros(heads, dtype), offset, periods, dtype, 1, False, None)
    assert len(turned) == len(plain) == 1 and dict(turned[0]["template"])["ROPE"] == 1
    program = exl3_sim.build([(launch.GEMV, turned[0]), (launch.GEMV, plain[0]), (rope_kernel.ROPE, rope)], mma=mma)
    got, y = program.run(0)[0], program.run(1)[0]
    (want,) = program.run(2, dict(rope, inputs=[to_mx(y, dtype), *rope["inputs"][1:]]))
    m = B * S
    assert np.array_equal(bits(got[:m]), bits(want.reshape(m, 512)))
    assert np.all(np.isnan(got[m:].astype(np.float32)))  # the guard rows
    rotated = np.array(periods)[np.arange(512) % 128 // 2] < np.inf
    assert not np.array_equal(bits(got[:m])[:, rotated], bits(y.reshape(m, 512))[:, rotated])  # turned, really
    assert np.isnan(got[:m].astype(np.float32)).any() and np.isinf(got[:m].astype(np.float32)).any()


@pytest.mark.parametrize("B, S, at, norm", [(1, 1, 4093, True), (2, 3, 10, False), (1, 6, 20, True), (2, 1, 5, True)])
def test_a_paired_gemv_that_writes_the_window_gives_the_pair_then_the_rope_kernel_bytes(monkeypatch, B, S, at, norm):
    """RING: a paired launch (wq_a with or without its norm, wkv) whose second linear's finishing
    threadgroups write its rows through the window keys' norm, rope and FP8 into the ring (6 slots,
    wrapping at `at` = 10, 20), its other threadgroups copying the other slots: y, y2 and the ring
    have the bytes of the paired launch then the rope kernel's ring write; y's guard rows keep their
    poison."""
    monkeypatch.setattr(launch, "backend", lambda: "cuda")
    tuning = launch.Tuning(dense_split_warps=96)
    first, second = linear_arrays(1024, 384, seed=40 + S), linear_arrays(1024, 128, seed=41 + S)
    x = random_rows((B, S, 1024), mx.bfloat16, seed=at)
    ring, kv_norm = random_rows((B, 6, 128), mx.bfloat16, seed=7), random_norm(128)
    periods, offset = RoPE(64, 160000.0, FLASH_YARN).whole_width(128), mx.array(at, mx.int32)
    quant = (32, fqk.FP8_UE8M0)
    window = WindowWrite(offset, periods, kv_norm.weight, kv_norm.eps, quant, ring)
    nrm = (mx.array(np.random.default_rng(3).normal(1, 0.5, 384).astype(np.float32)), 1e-6) if norm else None
    common = dict(tuning=tuning, norm=nrm, pair=(*second, "mul1"), guard_rows=2, init_value=NAN)
    size = 512 // 128 + norm
    one = launch.gemv_args(
        x, *first, "mul1", None, mx.bfloat16, counters=launch.split_counters(size + 1), window=window, **common
    )
    two = launch.gemv_args(x, *first, "mul1", None, mx.bfloat16, counters=launch.split_counters(size), **common)
    rope = rope_kernel.args(
        mx.zeros((B, S, 128), mx.bfloat16),
        offset,
        periods,
        mx.bfloat16,
        1,
        False,
        quant,
        (kv_norm.weight, kv_norm.eps),
        ring,
    )
    assert dict(one[0]["template"])["RING"] == 1 and len(one) == len(two) == 1
    program = exl3_sim.build([(launch.GEMV, one[0]), (launch.GEMV, two[0]), (rope_kernel.ROPE, rope)], mma=False)
    _, y, y2, written = program.run(0)
    _, want_y, want_y2, _ = program.run(1)
    (want,) = program.run(
        2, dict(rope, inputs=[to_mx(want_y2[: B * S], mx.bfloat16).reshape(B, S, 128), *rope["inputs"][1:]])
    )
    assert np.array_equal(bits(y), bits(want_y)) and np.array_equal(bits(y2), bits(want_y2))
    assert np.all(np.isnan(y[B * S :].astype(np.float32)))
    assert written.shape == ring.shape and np.array_equal(bits(written), bits(want))
    slots = sorted({(at + s) % 6 for s in range(S)})
    assert not np.array_equal(bits(written)[:, slots], bits(ring)[:, slots])  # the new rows are written


def test_what_rope_and_ring_refuse(monkeypatch):
    """The launches refuse what they cannot do (a one-line ValueError naming the fit function), and
    the fit functions agree: ROPE on a k-split launch or a rope width that does not divide the
    outputs, both at once, RING without a pair, a ring of another batch or dtype, or more rows
    than slots; the tuning switch turns both off."""
    monkeypatch.setattr(launch, "backend", lambda: "cuda")
    trellis, suh, svh = linear_arrays(256, 512, seed=1, nonfinite=False)
    x = random_rows((1, 1, 256), mx.bfloat16, seed=2)
    periods = RoPE(64, 10000.0).whole_width(128)
    turn = Turn(mx.array(3, mx.int32), periods)
    with pytest.raises(ValueError, match="ROPE.*roped_gemv_fits"):
        launch.gemv_args(x, trellis, suh, svh, "mul1", None, splits=2, counters=launch.split_counters(4), rope=turn)
    with pytest.raises(ValueError, match="ROPE"):
        launch.gemv_args(x, trellis, suh, svh, "mul1", None, splits=1, rope=Turn(turn.offset, periods[:48]))
    ring = random_rows((1, 6, 128), mx.bfloat16, seed=3)
    window = WindowWrite(turn.offset, periods, mx.ones((128,)), 1e-6, (32, fqk.FP8_UE8M0), ring)
    with pytest.raises(ValueError, match="not both"):
        launch.gemv_args(x, trellis, suh, svh, "mul1", None, splits=1, rope=turn, window=window)
    with pytest.raises(ValueError, match="RING"):
        launch.gemv_args(x, trellis, suh, svh, "mul1", None, splits=1, window=window)
    single = launch.Tuning(dense_single_blocks=4)
    assert launch.roped_gemv_fits(x, trellis, periods, mx.bfloat16, single)
    assert not launch.roped_gemv_fits(x, trellis, periods, mx.bfloat16, launch.Tuning(dense_single_blocks=5))  # split
    assert not launch.roped_gemv_fits(x, trellis, periods[:48], mx.bfloat16, single)
    assert not launch.roped_gemv_fits(
        x, trellis, periods, mx.bfloat16, launch.Tuning(dense_single_blocks=4, roped_gemv=0)
    )
    first, second = (
        (*linear_arrays(1024, 384, 1, False), "mul1", None),
        (*linear_arrays(1024, 128, 2, False), "mul1", None),
    )
    xs = random_rows((1, 2, 1024), mx.bfloat16, seed=4)
    assert launch.window_gemv_fits(xs, first, second, window)
    for other in (
        WindowWrite(turn.offset, periods, mx.ones((128,)), 1e-6, (32, 0), random_rows((2, 6, 128), mx.bfloat16, 5)),
        WindowWrite(turn.offset, periods, mx.ones((128,)), 1e-6, (32, 0), random_rows((1, 6, 128), mx.float16, 5)),
        WindowWrite(turn.offset, periods, mx.ones((128,)), 1e-6, (32, 0), random_rows((1, 1, 128), mx.bfloat16, 5)),
    ):
        assert not launch.window_gemv_fits(xs, first, second, other)
    assert not launch.window_gemv_fits(xs, first, second, window, launch.Tuning(roped_gemv=0))
    assert not launch.window_gemv_fits(xs.reshape(2, 1024), first, second, window)  # rows without [B, S]


def _exl3_attention(monkeypatch):
    """Layer 0 (window only) of a tiny config with EXL3 wq_a, wkv and wq_b of 128-multiple dims and
    random bf16 norms (wq_b unsplit: Tuning.dense_single_blocks 4)."""
    from mlx_dsv41.model.attention import Attention

    args = tiny_args(
        hidden_size=256, q_lora_rank=256, head_dim=128, num_attention_heads=4, qk_rope_head_dim=64, index_head_dim=64
    )
    layer = Attention(args, 0)
    rng = np.random.default_rng(0)
    for norm in (layer.q_norm, layer.kv_norm):
        norm.weight = mx.array((1 + 0.2 * rng.standard_normal(norm.weight.shape)).astype(np.float32))
    for i, (name, k, n) in enumerate((("wq_a", 256, 256), ("wkv", 256, 128), ("wq_b", 256, 512))):
        stored = random_linear_tensors(k, n, 3, "mul1", seed=60 + i, prefix="p")
        setattr(layer, name, EXL3Linear.from_stored({key: mx.array(v) for key, v in stored.items()}, "p"))
    mx.eval(mlx.utils.tree_flatten(layer.parameters()))
    monkeypatch.setattr(launch, "TUNING", launch.Tuning(dense_single_blocks=4))
    return args, layer


@pytest.mark.parametrize("B, S, at", [(1, 1, 4093), (2, 2, 9)])
def test_the_attention_s_queries_and_window_keys_take_two_launches_with_the_three_launches_bytes(monkeypatch, B, S, at):
    """Attention.queries_and_window on the simulated GPU kernels: wq_a (q_norm) + wkv with RING, then
    wq_b with ROPE (two exl3_gemv launches) where the twenty-third session's step launched the
    paired GEMV, wq_b and rope_pair; the same q, qr and ring bytes, at a wrapping ring position too."""
    import mlx_dsv41.kernels as kernels
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.kernels import grid_finish
    from mlx_dsv41.model import fake_quant as fq
    from mlx_dsv41.model import rope as rope_module

    args, layer = _exl3_attention(monkeypatch)
    for module in (ops, launch, rope_module, fq):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setitem(grid_finish.GRID_FINISH, "cuda", True)
    sims, seen = {}, []

    def run_on_sim(self, **call):
        t = dict(call.get("template", ()))
        seen.append((self.name, t.get("PAIR"), t.get("ROPE"), t.get("RING")))
        sims.setdefault(self.name, exl3_sim.launcher(self, mma=True))
        return sims[self.name](**call)

    monkeypatch.setattr(kernels.Kernel, "__call__", run_on_sim)
    x = random_rows((B, S, 256), mx.bfloat16, seed=at)
    ring = random_rows((B, args.sliding_window + make_layer_cache(args, 0).trim_slack, 128), mx.bfloat16, seed=1)
    outs = []
    for tuning in (launch.Tuning(dense_single_blocks=4), launch.Tuning(dense_single_blocks=4, roped_gemv=0)):
        monkeypatch.setattr(launch, "TUNING", tuning)
        cache = make_layer_cache(args, 0)
        cache.offset = at
        cache.reserve(B, S, 128, 0, mx.bfloat16)
        cache.ring = ring
        seen.clear()
        q, qr, (window, rows) = layer.queries_and_window(x, mx.array(at, mx.int32), cache)
        outs.append(([bits(a) for a in (q, qr, window)], list(seen)))
    (got, launches), (want, before) = outs
    assert launches == [("exl3_gemv", 2, 0, 1), ("exl3_gemv", 0, 1, 0)]
    assert before == [("exl3_gemv", 2, 0, 0), ("exl3_gemv", 0, 0, 0), ("rope_pair", None, None, 1)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
