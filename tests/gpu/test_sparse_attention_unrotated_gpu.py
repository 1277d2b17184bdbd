"""The attention output turned back in the attention launch (sparse_attention_unrotated,
docs/numerics.md#unrotated-output) on the device, at Flash's attention (64 heads of 512, a
128-row window and a compressed pool, top-k picks): for the serial and the parallel kernel, the
bytes of that kernel's float32 output, then the rope kernel's inverse; one and three query rows at
positions past 2^15; outputs poisoned (NaN) before launch and every element written; five repeats
byte-identical; NaN / inf inputs where the two launches put them; the launch limit declared; and
the model's attention takes the one launch."""

import mlx.core as mx
import numpy as np
import pytest
from test_sparse_attention_unrotated_sim import make_inputs

from mlx_dsv41.kernels import rope as rope_kernel
from mlx_dsv41.kernels import sparse_attention as sa
from mlx_dsv41.model.rope import RoPE

pytestmark = pytest.mark.gpu
H, D, W, T, N = 64, 512, 128, 300, 640


def _inputs(B, S, seed, nonfinite=False):
    return make_inputs(seed, B, S, H, D, W, T, N, nonfinite)


def _bytes(a):
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes()


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("B,S,position,nonfinite", [(1, 1, 40961, False), (1, 3, 70000, False), (2, 1, 5, True)])
def test_the_unrotated_output_gives_the_attention_then_rope_bytes(variant, B, S, position, nonfinite):
    q, window, pool, indices, sinks = _inputs(B, S, B * 10 + S, nonfinite)
    period, offset = RoPE(64, 160000.0).whole_width(D), mx.array(position, mx.int32)
    call = sa.unrotated_args(q, window, pool, indices, sinks, D**-0.5, period, offset, mx.bfloat16, variant)
    call["init_value"] = float("nan")
    runs = [_bytes(sa.UNROTATED(**call)[0]) for _ in range(5)]
    assert all(r == runs[0] for r in runs)
    got = sa.UNROTATED(**call)[0]
    o = sa._run(variant, q, window, pool, indices, sinks, D**-0.5)
    want = rope_kernel.run(o, offset, period, mx.bfloat16, 1, True, None)
    assert _bytes(got) == _bytes(want)
    values = np.array(got.astype(mx.float32))
    if nonfinite:  # make_inputs: a NaN in q[0, 0, head 1], an inf in q[0, S - 1, head 2]
        assert np.isnan(values[0, 0, 1]).all() and not np.isfinite(values[0, S - 1, 2]).all()
        values[0, 0, 1] = values[0, S - 1, 2] = 0.0
    assert np.isfinite(values).all()  # every element written (the poison is NaN), finite


def test_launch_limit_and_the_model_attention_takes_one_launch():
    assert sa.UNROTATED.max_threads == 256
    with pytest.raises(ValueError, match="over its declared limit"):
        sa.UNROTATED(inputs=[], output_shapes=[], output_dtypes=[], grid=(512, 1, 1), threadgroup=(512, 1, 1))
    q, window, pool, indices, sinks = _inputs(1, 1, 3)
    period, offset = RoPE(64, 160000.0).whole_width(D), mx.array(12, mx.int32)
    one = sa.sparse_attention_unrotated(
        q, window, pool, indices, sinks, D**-0.5, period, offset, mx.bfloat16, "parallel"
    )
    assert one is not None
    two = rope_kernel.run(
        sa.sparse_attention(q, window, pool, indices, sinks, D**-0.5, "parallel"),
        offset,
        period,
        mx.bfloat16,
        1,
        True,
        None,
    )
    assert _bytes(one) == _bytes(two)
