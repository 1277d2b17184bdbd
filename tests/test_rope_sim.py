"""The rope kernel body (mlx_dsv41/metal_ext/rope.metal) on the CPU simulator, through the model's
own RoPE calls (model/rope.py takes the kernel when the backend is a GPU): for the five uses (queries
[B, S, H, D], window keys with FP8, the fp32 attention output rounded then turned back, compressed
keys at step r with FP4 / e4m3, indexer queries with FP4), forward and inverse, plain and YaRN
frequencies, against the CPU path (slice, fp32 rope, round, concatenate, fake_quant):
- the fake quantization and the cast are exact: the kernel's output is the fake_quant kernel's
  bytes on the kernel's own unquantized rope, and an fp32 input gives the bytes of its bf16 copy;
- the rotation is within one bf16 rounding of the CPU path (cos / sin are the C library's here,
  MLX's own on the CPU; tests/gpu/test_rope_gpu.py holds the kernel to mx.fast.rope's bytes on the
  device);
- guard rows keep their poison."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest
from attention_stack import FLASH_YARN, random_norm

from mlx_dsv41.kernels import fake_quant as fqk
from mlx_dsv41.kernels import rope as rope_kernel
from mlx_dsv41.model import fake_quant as fq
from mlx_dsv41.model import rope as rope_module
from mlx_dsv41.model.rope import RoPE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

USES = {  # name: (shape, input dtype, step, inverse, then, normed)
    "queries": ((1, 3, 4, 128), mx.bfloat16, 1, False, None, False),
    "window_kv": ((2, 3, 128), mx.bfloat16, 1, False, fq.WINDOW_KV, True),
    "output": ((1, 3, 4, 128), mx.float32, 1, True, None, False),
    "compressed_kv": ((1, 2, 128), mx.bfloat16, 4, False, fq.COMPRESSED_KV, False),
    "indexer_q": ((1, 2, 4, 64), mx.bfloat16, 1, False, fq.INDEXER, False),
    "index_keys": ((1, 3, 64), mx.bfloat16, 4, False, fq.INDEXER, True),
}


def _x(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * np.exp2(rng.integers(-4, 5, shape))).astype(np.float32)).astype(dtype)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _np(a):
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("yarn", [None, FLASH_YARN])
def test_the_kernel_gives_the_cpu_path_within_one_rounding(monkeypatch, use, yarn):
    shape, dtype, step, inverse, then, normed = USES[use]
    rope = RoPE(min(64, shape[-1]), 10000.0 if yarn is None else 160000.0, yarn)
    x, offset = _x(shape, dtype), mx.array(4093, mx.int32)
    kw = dict(step=step, inverse=inverse, dtype=mx.bfloat16, norm=random_norm(shape[-1]) if normed else None)
    cpu = _np(rope(x, offset, then=then, **kw))
    plain_cpu = _np(rope(x, offset, **kw))
    monkeypatch.setattr(rope_module, "backend", lambda: "cuda")
    monkeypatch.setattr(fq, "backend", lambda: "cuda")
    calls = []
    sims = {k.name: exl3_sim.launcher(k) for k in (rope_kernel.ROPE, fqk.FAKE_QUANT)}

    def run_on_sim(self, **call):
        calls.append(self.name)
        return sims[self.name](**call)

    monkeypatch.setattr(type(rope_kernel.ROPE), "__call__", run_on_sim)
    got = _np(rope(x, offset, then=then, **kw))
    plain = rope(x, offset, **kw)
    assert calls == ["rope", "rope"]  # one launch each: the cast, the norm, the quantization included
    # the rotation (and norm): within a bf16 rounding or two of the CPU path, relative to the pair
    p, pc = _np(plain), plain_cpu
    scale = np.repeat(np.abs(pc[..., 0::2]) + np.abs(pc[..., 1::2]), 2, axis=-1)
    assert np.all(np.abs(p - pc) <= 2**-7 * scale + 1e-30)
    if not normed:  # the leading features pass unchanged
        lead = _np(x.astype(mx.bfloat16))[..., : shape[-1] - 64]
        assert np.array_equal(_bits(p[..., : shape[-1] - 64]), _bits(lead))
    if then is None:
        assert np.array_equal(_bits(got), _bits(_np(plain)))
        return
    # the quantization: the fake_quant kernel's bytes on the kernel's own rope
    assert np.array_equal(_bits(got), _bits(_np(then(plain))))
    assert calls[-1] == "fake_quant"
    assert np.count_nonzero(got) > got.size // 3
    assert np.mean(got == cpu) > 0.9  # the same blocks, mostly the same values as the CPU path


def test_an_fp32_input_is_rounded_first_and_guard_rows_keep_their_poison():
    x = _x((1, 3, 4, 128), mx.float32, seed=1)
    periods = RoPE(64, 10000.0).whole_width(128)
    offset = mx.array(17, mx.int32)
    specs = [
        (rope_kernel.ROPE, rope_kernel.args(x, offset, periods, mx.bfloat16, 1, True, None, guard=2)),
        (
            rope_kernel.ROPE,
            rope_kernel.args(x.astype(mx.bfloat16), offset, periods, mx.bfloat16, 1, True, None, guard=2),
        ),
    ]
    program = exl3_sim.build(specs, mma=False)
    (from_fp32,), (from_bf16,) = program.run(0), program.run(1)
    assert np.all(_bits(from_fp32[-2:]) == 0xFFFF) and np.all(_bits(from_bf16[-2:]) == 0xFFFF)
    assert np.array_equal(_bits(from_fp32), _bits(from_bf16))
    assert np.count_nonzero(from_fp32[:-2].astype(np.float32)) > from_fp32.size // 2


def test_refusals():
    assert rope_kernel.refusal(mx.zeros((2, 3, 64)), None) is None
    assert rope_kernel.refusal(mx.zeros((2, 64)), None) is not None
    assert rope_kernel.refusal(mx.zeros((2, 3, 63)), None) is not None
    assert rope_kernel.refusal(mx.zeros((2, 3, 48)), (32, fqk.FP8_UE8M0)) is not None


def test_the_norm_is_hc_collapse_norms_for_one_stream():
    """NORM gives the bytes of the launches it replaces: hc_collapse_norm over one stream (the
    model's RMSNorm on a GPU), then the rope kernel on its output."""
    from mlx_dsv41.kernels import hyper_connections as hc

    x = _x((2, 3, 512), mx.bfloat16, seed=3)
    norm = random_norm(512)
    periods, offset = RoPE(64, 10000.0).whole_width(512), mx.array(40, mx.int32)
    one = mx.ones((2, 3, 1), mx.float32)
    specs = [
        (hc.COLLAPSE_NORM, hc.collapse_norm_args(x, one, norm.weight, 1e-20, hc=1)),
        (rope_kernel.ROPE, rope_kernel.args(x, offset, periods, mx.bfloat16, 1, False, (32, fqk.FP8_UE8M0))),
        (
            rope_kernel.ROPE,
            rope_kernel.args(x, offset, periods, mx.bfloat16, 1, False, (32, fqk.FP8_UE8M0), (norm.weight, 1e-20)),
        ),
    ]
    program = exl3_sim.build(specs, mma=False)
    (normed,) = program.run(0)
    (two_launches,) = program.run(1, dict(specs[1][1], inputs=[mx.array(normed), *specs[1][1]["inputs"][1:]]))
    (one_launch,) = program.run(2)
    assert np.array_equal(_bits(one_launch), _bits(two_launches))
    assert np.count_nonzero(one_launch.astype(np.float32)) > one_launch.size // 2


@pytest.mark.parametrize("tokens, at", [(1, 4093), (1, 5), (3, 10), (3, 11), (6, 20)])
def test_the_ring_write_gives_the_bytes_of_the_rope_then_the_slice_update(monkeypatch, tokens, at):
    """RING: the rope kernel writes the window KV's rows into the ring (slots (offset + s) % R,
    wrapping at `at` = 10, 11 with R = 6) and copies the ring's other rows, in one launch: the
    bytes of the rope kernel's own rows stored by cache.store_rows (one dynamic slice update, or
    the scatter of several rows), through the model's RoPE call as Attention.store_window makes it."""
    from mlx_dsv41.cache import store_rows

    rope = RoPE(64, 160000.0, FLASH_YARN)
    x, norm = _x((2, tokens, 128), mx.bfloat16, seed=tokens), random_norm(128)
    ring = _x((2, 6, 128), mx.bfloat16, seed=7)
    offset = mx.array(at, mx.int32)
    monkeypatch.setattr(rope_module, "backend", lambda: "cuda")
    monkeypatch.setattr(fq, "backend", lambda: "cuda")
    calls = []
    sim = exl3_sim.launcher(rope_kernel.ROPE)

    def run_on_sim(self, **call):
        calls.append(dict(call["template"])["RING"])
        return sim(**call)

    monkeypatch.setattr(type(rope_kernel.ROPE), "__call__", run_on_sim)
    kw = dict(dtype=mx.bfloat16, norm=norm, then=fq.WINDOW_KV)
    got = rope(x, offset, ring=ring, **kw)
    rows = rope(x, offset, **kw)
    assert calls == [1, 0]  # the rows and the write: one launch
    want = store_rows(ring, rows, offset, 6)
    assert got.shape == ring.shape and np.array_equal(_bits(_np(got)), _bits(_np(want)))
    slots = {(at + s) % 6 for s in range(tokens)}
    kept = [j for j in range(6) if j not in slots]
    assert np.array_equal(_bits(_np(got)[:, kept]), _bits(_np(ring)[:, kept]))  # copied, not recomputed
    assert np.count_nonzero(_np(got)[:, sorted(slots)]) > tokens * 128  # the new rows hold values


def test_the_ring_write_keeps_its_guard_rows_and_refuses_what_it_cannot_take():
    x = _x((1, 2, 64), mx.bfloat16, seed=2)
    ring = _x((1, 5, 64), mx.bfloat16, seed=3)
    periods, offset = RoPE(64, 10000.0).whole_width(64), mx.array(4, mx.int32)
    call = rope_kernel.args(x, offset, periods, mx.bfloat16, 1, False, None, ring=ring, guard=2)
    (out,) = exl3_sim.build([(rope_kernel.ROPE, call)], mma=False).run(0)
    assert out.shape == (7, 64) and np.all(_bits(out[-2:]) == 0xFFFF)
    assert np.array_equal(_bits(out[1:4].astype(np.float32)), _bits(_np(ring)[0, 1:4]))  # slots 4, 0 take the rows
    assert rope_kernel.refusal(x, None, ring) is None
    assert rope_kernel.refusal(_x((1, 6, 64), mx.bfloat16), None, ring) is not None  # more rows than slots
    assert rope_kernel.refusal(x, None, _x((1, 5, 32), mx.bfloat16)) is not None
    assert rope_kernel.refusal(_x((1, 2, 2, 64), mx.bfloat16), None, ring) is not None  # heads: not a ring's rows


@pytest.mark.parametrize("tokens, at", [(1, 4093), (3, 10), (6, 20)])
def test_the_pair_gives_each_rope_launch_s_bytes(monkeypatch, tokens, at):
    """rope_pair: a layer's queries (the plain rope of [B, S, H, D]) and window keys (norm, rope,
    FP8, ring write) in one launch, through Attention's RoPE.pair: the bytes of the two rope launches,
    every guard row untouched; the pair is refused where either launch would be."""
    rope = RoPE(64, 160000.0, FLASH_YARN)
    q = _x((2, tokens, 4, 128), mx.bfloat16, seed=20 + tokens)
    x, norm = _x((2, tokens, 128), mx.bfloat16, seed=tokens), random_norm(128)
    ring = _x((2, 6, 128), mx.bfloat16, seed=7)
    offset = mx.array(at, mx.int32)
    for mod in (rope_module, fq):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    sims = {k.name: exl3_sim.launcher(k) for k in (rope_kernel.ROPE, rope_kernel.PAIR)}
    calls = []

    def run_on_sim(self, **call):
        calls.append(self.name)
        return sims[self.name](**call)

    monkeypatch.setattr(type(rope_kernel.ROPE), "__call__", run_on_sim)
    kw = dict(norm=norm, then=fq.WINDOW_KV)
    q_out, written = rope.pair(q, x, offset, ring=ring, **kw)
    assert calls == ["rope_pair"]
    want_q, want_ring = rope(q, offset), rope(x, offset, ring=ring, **kw)
    assert calls == ["rope_pair", "rope", "rope"]
    assert np.array_equal(_bits(_np(q_out)), _bits(_np(want_q)))
    assert np.array_equal(_bits(_np(written)), _bits(_np(want_ring)))
    periods = rope.whole_width(128)
    call = rope_kernel.pair_args(
        q, x, offset, periods, mx.bfloat16, 1, False, (32, fq.WINDOW_KV.mode), (norm.weight, norm.eps), ring, guard=2
    )
    guarded_q, guarded_ring = exl3_sim.build([(rope_kernel.PAIR, call)], mma=False).run(0)
    assert np.all(_bits(guarded_q[-2:]) == 0xFFFF) and np.all(_bits(guarded_ring[-2:]) == 0xFFFF)
    assert np.array_equal(_bits(guarded_q[:-2].astype(np.float32)), _bits(_np(want_q).reshape(-1, 128)))
    assert rope.pair(q[..., :96], x, offset, ring=ring, **kw) is None  # q narrower than the keys
    assert rope.pair(q, x.astype(mx.float32), offset, ring=ring, **kw) is None  # the ring's dtype differs
    monkeypatch.setattr(rope_module, "backend", lambda: "cpu")
    assert rope.pair(q, x, offset, ring=ring, **kw) is None


@pytest.mark.parametrize("inverse", [False, True])
def test_the_turn_rounds_as_written(inverse):
    """rope_turned's roundings are the written ones (docs/numerics.md#rope-launch), not the
    compiler's: even element fma(x1, c, -(x2·s)), odd element fma(x2, c, x1·s), each product
    rounded where written; fp32 in and out, so nothing else rounds. The simulator's cos / sin are
    the C library's cosf / sinf, taken here the same way. Not blind: the unfused x1·c - x2·s and
    x1·s + x2·c differ from them in some elements."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for fn in (libm.cosf, libm.sinf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    f32 = np.float32
    B, S, H, D, offset = 1, 3, 8, 64, 40961
    x = np.random.default_rng(5).standard_normal((B, S, H, D)).astype(f32)
    periods = (10000.0 ** (np.arange(0, D, 2) / D)).astype(f32)
    call = rope_kernel.args(mx.array(x), mx.array(offset, mx.int32), mx.array(periods), mx.float32, 1, inverse, None)
    (got,) = exl3_sim.build([(rope_kernel.ROPE, call)], mma=True).run(0)

    def fma(a, b, c):  # a·b is exact in float64; the sum rounds there, then to float32 (a double
        return (a.astype(np.float64) * b + c).astype(f32)  # rounding that these values never meet)

    inv = (1.0 / periods.astype(np.float64)).astype(f32)
    want, unfused = np.empty_like(x), np.empty_like(x)
    for s in range(S):
        theta = f32((-1.0 if inverse else 1.0) * f32(offset + s)) * inv
        c = np.array([libm.cosf(float(t)) for t in theta], f32)
        sn = np.array([libm.sinf(float(t)) for t in theta], f32)
        x1, x2 = x[:, s, :, 0::2], x[:, s, :, 1::2]
        want[:, s, :, 0::2] = fma(x1, c, -(x2 * sn))
        want[:, s, :, 1::2] = fma(x2, c, x1 * sn)
        unfused[:, s, :, 0::2] = x1 * c - x2 * sn
        unfused[:, s, :, 1::2] = x1 * sn + x2 * c
    assert np.array_equal(_bits(got.reshape(x.shape)), _bits(want))
    assert np.any(_bits(unfused) != _bits(want))
