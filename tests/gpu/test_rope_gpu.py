"""RoPE's GPU launches (docs/numerics.md#rope-launch) on the device.
- One mx.fast.rope over the whole bf16 vector with infinite periods for the leading pairs (the path
  where the rope kernel refuses) gives the bytes of the fp32 tail path (slice, fp32, rope, round
  once, concatenate), for 3-D keys and 4-D queries, forward and inverse, at Flash's widths; a
  finite input passes its leading features through unchanged.
- The rope kernel gives the bytes of the launches it replaces (the cast, the RMSNorm's
  hc_collapse_norm, that mx.fast.rope, the fake_quant kernel) for every use in the model, and
  keeps the kernel contract: NaN where they put it, within one bf16 rounding of float64
  elsewhere, poisoned guard rows untouched, five repeats byte-identical, the launch limit
  declared."""

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import FLASH_YARN, random_norm

from mlx_dsv41.kernels import rope as rk
from mlx_dsv41.model import fake_quant as fq
from mlx_dsv41.model import rope as rope_module
from mlx_dsv41.model.rope import RoPE

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1, 1, 64, 512), (2, 7, 64, 512), (1, 3, 512), (1, 9, 32, 128)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("yarn", [None, FLASH_YARN])
def test_one_launch_gives_the_fp32_tail_bytes(monkeypatch, shape, inverse, yarn):
    rope = RoPE(64, 10000.0 if yarn is None else 160000.0, yarn)
    x = mx.array(np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)
    offset = mx.array(4093, mx.int32)
    monkeypatch.setattr(rk, "refusal", lambda x, quant, ring=None: "the path where the kernel refuses")
    whole = np.array(rope(x, offset, step=4 if yarn else 1, inverse=inverse).astype(mx.float32))
    monkeypatch.setattr(rope_module, "backend", lambda: "cpu")  # the tail path, still on the GPU stream
    tail = np.array(rope(x, offset, step=4 if yarn else 1, inverse=inverse).astype(mx.float32))
    assert np.array_equal(whole.view(np.uint32), tail.view(np.uint32))
    assert np.array_equal(whole[..., :-64], np.array(x.astype(mx.float32))[..., :-64])


# ------------------------------------------------------------------------------ the rope kernel

USES = {  # name: (shape, input dtype, step, inverse, fake quantization, normed first)
    "queries": ((1, 1, 64, 512), mx.bfloat16, 1, False, None, False),
    "queries_rows": ((1, 5, 64, 512), mx.bfloat16, 1, False, None, False),
    "window_kv": ((1, 3, 512), mx.bfloat16, 1, False, fq.WINDOW_KV, True),
    "output": ((2, 3, 64, 512), mx.float32, 1, True, None, False),
    "compressed_kv": ((1, 2, 512), mx.bfloat16, 4, False, fq.COMPRESSED_KV, False),
    "indexer_q": ((1, 1, 64, 128), mx.bfloat16, 1, False, fq.INDEXER, False),
    "index_keys": ((1, 3, 128), mx.bfloat16, 128, False, fq.INDEXER, True),
}


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _launches_before(x, rope, offset, step, inverse, then, norm=None):
    """What the model launched before the rope kernel: the cast, the RMSNorm (hc_collapse_norm), the
    whole-width mx.fast.rope (through a transpose for 4-D rows), the fake_quant kernel."""
    y = x.astype(mx.bfloat16) if norm is None else norm(x.astype(mx.bfloat16))
    y = rope._rope(y, y.shape[-1], float(-step if inverse else step), offset, rope.whole_width(y.shape[-1]))
    return y if then is None else then(y)


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("yarn", [None, FLASH_YARN])
def test_the_rope_kernel_gives_the_bytes_of_the_launches_it_replaces(use, yarn):
    shape, dtype, step, inverse, then, normed = USES[use]
    rope = RoPE(64, 10000.0 if yarn is None else 160000.0, yarn)
    rng = np.random.default_rng(len(use))
    x = mx.array((rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, shape))).astype(np.float32)).astype(dtype)
    offset = mx.array(40961, mx.int32)
    norm = random_norm(shape[-1]) if normed else None
    out = rope(x, offset, step=step, inverse=inverse, dtype=mx.bfloat16, norm=norm, then=then)
    got = np.array(out.astype(mx.float32))
    want = np.array(_launches_before(x, rope, offset, step, inverse, then, norm).astype(mx.float32))
    assert np.array_equal(_bits(got), _bits(want))
    assert np.count_nonzero(got) > got.size // 4  # FP4 blocks of widely spread values keep few nonzeros


def test_the_rope_kernel_contract_nonfinite_poison_guards_repeats_and_limit():
    rope = RoPE(64, 10000.0)
    rng = np.random.default_rng(5)
    raw = rng.standard_normal((2, 3, 4, 128)).astype(np.float32)
    raw[0, 0, 0, 3], raw[0, 1, 2, 100], raw[1, 2, 3, 127], raw[1, 0, 1, 64] = np.nan, np.inf, -np.inf, np.inf
    x = mx.array(raw).astype(mx.bfloat16)
    offset = mx.array(9, mx.int32)
    periods = rope.whole_width(128)
    for then in (None, fq.INDEXER):
        quant = None if then is None else (then.block, then.mode)
        call = rk.args(x, offset, periods, mx.bfloat16, 1, False, quant, init_value=float("nan"), guard=2)
        runs = [np.array(rk.ROPE(**call)[0].astype(mx.float32)) for _ in range(5)]
        assert all(np.array_equal(_bits(r), _bits(runs[0])) for r in runs)
        assert np.all(np.isnan(runs[0][-2:]))  # guard rows keep the poison
        got = runs[0][:-2].reshape(x.shape)
        want = np.array(_launches_before(x, rope, offset, 1, False, then).astype(mx.float32))
        nan = np.isnan(want)
        assert nan.any() and np.array_equal(np.isnan(got), nan)  # NaN where MLX's launches put it
        assert np.array_equal(_bits(got[~nan]), _bits(want[~nan]))
        # float64: the rotated pairs of finite inputs, within one bf16 rounding
        f = np.array(x.astype(mx.float32)).astype(np.float64)
        angle = (9 + np.arange(3))[None, :, None, None] * (1.0 / np.array(periods, np.float64)[32:])
        a, b = f[..., 64::2], f[..., 65::2]
        turned = np.stack([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)
        turned = turned.reshape(*f.shape[:-1], 64)
        size = np.repeat(np.abs(a) + np.abs(b), 2, axis=-1)  # the pair's scale: bounds cancellation
        ok = np.isfinite(turned)
        if then is None:  # one bf16 rounding (2^-9 relative) and fp32 cos / sin
            assert np.all(np.abs(got[..., 64:] - turned)[ok] <= 2**-8 * size[ok])
    with pytest.raises(ValueError, match="declared limit"):
        rk.ROPE(**dict(rk.args(x, offset, periods, mx.bfloat16, 1, False, None), threadgroup=(512, 1, 1)))


@pytest.mark.parametrize("tokens, at", [(1, 40961), (1, 160), (5, 158), (33, 4000)])
def test_the_ring_write_gives_the_bytes_of_the_rope_then_the_cache_write(monkeypatch, tokens, at):
    """RING (docs/cache.md#window-ring): the window KV's rows written into a Flash-sized ring (128 +
    32 slots of 512) in the rope launch give the bytes of the rope kernel's rows stored by
    cache.store_rows (MLX's dynamic slice update, or its scatter for several rows: 5 tokens wrap at
    158); NaN / inf inputs where those launches put them; poisoned guard rows untouched; five repeats
    byte-identical."""
    from mlx_dsv41.cache import store_rows

    rope = RoPE(64, 160000.0, FLASH_YARN)
    rng = np.random.default_rng(tokens)
    raw = (rng.standard_normal((2, tokens, 512)) * np.exp2(rng.integers(-6, 7, (2, tokens, 512)))).astype(np.float32)
    raw[0, 0, 7], raw[1, -1, 500] = np.nan, np.inf
    x = mx.array(raw).astype(mx.bfloat16)
    ring = mx.array(rng.standard_normal((2, 160, 512)).astype(np.float32)).astype(mx.bfloat16)
    offset, norm = mx.array(at, mx.int32), random_norm(512)
    kw = dict(dtype=mx.bfloat16, norm=norm, then=fq.WINDOW_KV)
    got = np.array(rope(x, offset, ring=ring, **kw).astype(mx.float32))
    monkeypatch.setattr(rope_module, "WRITES_RING", False)
    want = np.array(store_rows(ring, rope(x, offset, **kw), offset, 160).astype(mx.float32))
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(_bits(got[~nan]), _bits(want[~nan]))
    slots = [(at + s) % 160 for s in range(tokens)]
    assert np.count_nonzero(got[:, slots]) > got[:, slots].size // 4
    call = _window_keys_call(rk.args, rope, x, offset, norm, ring)
    runs = [np.array(rk.ROPE(**call)[0].astype(mx.float32)) for _ in range(5)]
    assert all(np.array_equal(_bits(r), _bits(runs[0])) for r in runs)
    assert np.all(np.isnan(runs[0][-3:]))
    assert np.array_equal(_bits(runs[0][:-3].reshape(got.shape)), _bits(got))


@pytest.mark.parametrize("tokens, at", [(1, 40961), (5, 158)])
def test_the_pair_gives_the_bytes_of_the_two_rope_launches(tokens, at):
    """rope_pair (RoPE.pair, Attention.queries_and_window): Flash's queries (64 heads of 512) and
    window keys into a Flash-sized ring in one launch give the bytes of the two rope launches, NaN /
    inf where they put them; poisoned guard rows of both outputs untouched; five repeats
    byte-identical; the launch limit declared."""
    rope = RoPE(64, 160000.0, FLASH_YARN)
    rng = np.random.default_rng(50 + tokens)

    def rows(shape):
        raw = (rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, shape))).astype(np.float32)
        raw.reshape(-1, 512)[0, 7], raw.reshape(-1, 512)[-1, 500] = np.nan, np.inf
        return mx.array(raw).astype(mx.bfloat16)

    q, x = rows((1, tokens, 64, 512)), rows((1, tokens, 512))
    ring = mx.array(rng.standard_normal((1, 160, 512)).astype(np.float32)).astype(mx.bfloat16)
    offset, norm = mx.array(at, mx.int32), random_norm(512)
    q_out, written = rope.pair(q, x, offset, norm=norm, then=fq.WINDOW_KV, ring=ring)
    want_q, want_ring = rope(q, offset), rope(x, offset, norm=norm, then=fq.WINDOW_KV, ring=ring)
    for got, want in ((q_out, want_q), (written, want_ring)):
        got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        assert np.isnan(want).any() and np.array_equal(_bits(got), _bits(want))
    call = _window_keys_call(rk.pair_args, rope, x, offset, norm, ring, q)
    runs = [[np.array(o.astype(mx.float32)) for o in rk.PAIR(**call)] for _ in range(5)]
    assert all(np.array_equal(_bits(r[i]), _bits(runs[0][i])) for r in runs for i in (0, 1))
    assert np.all(np.isnan(runs[0][0][-3:])) and np.all(np.isnan(runs[0][1][-3:]))
    assert np.array_equal(_bits(runs[0][0][:-3].reshape(q.shape)), _bits(np.array(want_q.astype(mx.float32))))
    with pytest.raises(ValueError, match="declared limit"):
        rk.PAIR(**dict(call, threadgroup=(512, 1, 1)))


def _window_keys_call(make_args, rope, x, offset, norm, ring, *queries):
    """Launch kwargs for Flash's window keys (norm, rope, FP8, ring write; after `queries` for
    rope_pair) with NaN-poisoned outputs and 3 guard rows."""
    quant = (fq.WINDOW_KV.block, fq.WINDOW_KV.mode)
    weights, periods = (norm.weight, norm.eps), rope.whole_width(x.shape[-1])
    nan = float("nan")
    return make_args(*queries, x, offset, periods, mx.bfloat16, 1, False, quant, weights, ring, init_value=nan, guard=3)
