"""RoPE's GPU launch (docs/numerics.md#rope-launch) on the device: one mx.fast.rope over the whole
bf16 vector with infinite periods for the leading pairs gives the bytes of the fp32 tail path
(slice, fp32, rope, round once, concatenate), for 3-D keys and 4-D queries, forward and inverse,
at Flash's widths; and a finite input passes its leading features through unchanged."""

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import FLASH_YARN

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
    whole = np.array(rope(x, offset, step=4 if yarn else 1, inverse=inverse).astype(mx.float32))
    monkeypatch.setattr(rope_module, "backend", lambda: "cpu")  # the tail path, still on the GPU stream
    tail = np.array(rope(x, offset, step=4 if yarn else 1, inverse=inverse).astype(mx.float32))
    assert np.array_equal(whole.view(np.uint32), tail.view(np.uint32))
    assert np.array_equal(whole[..., :-64], np.array(x.astype(mx.float32))[..., :-64])
