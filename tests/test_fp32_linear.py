"""The reference's fp32 linears from weights held as stored (docs/numerics.md#fp32-linears;
mlx_dsv41/kernels/fp32_linear.py), on the CPU: fp32 sums against float64 `x · wᵀ`; the widening in
pieces gives the bytes of one fp32 matmul; a loaded model holds the head, the router, the
compressor and the DSpark heads as stored (bf16) and gives the logits of a model holding their
fp32 copies, bit for bit; loading reads parameters one at a time and peaks at their own bytes.
The kernel itself: tests/test_fp32_gemv_sim.py (simulator) and tests/gpu/test_fp32_linear_gpu.py."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dsv41.kernels import fp32_linear as fl
from mlx_dsv41.loading import load_model
from mlx_dsv41.synthetic import TINY_DSPARK, tiny_args
from mlx_dsv41.synthetic_checkpoints import write_official_checkpoint

FP32_LINEARS = (
    ".ffn.gate.weight",
    ".compressor.wkv.weight",
    ".compressor.wgate.weight",
    ".markov_head.head.weight",
    ".confidence_head.proj.weight",
)


def _xw(seed, rows, K, N, w_dtype=mx.bfloat16):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((rows, K)).astype(np.float32))
    w = mx.array((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)).astype(w_dtype)
    return x, w


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


@pytest.mark.parametrize("w_dtype", [mx.bfloat16, mx.float16])
def test_sums_in_fp32(w_dtype):
    x, w = _xw(0, 3, 5120, 64, w_dtype)
    y = fl.linear(x.astype(mx.bfloat16), w)
    assert y.dtype == mx.float32 and y.shape == (3, 64)
    want = f64(x.astype(mx.bfloat16)) @ f64(w).T
    rel = np.linalg.norm(np.array(y) - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel  # fp32 sums over K = 5120; one bf16 rounding of y would be ~2e-3


def test_pieces_give_the_bytes_of_one_matmul():
    x, w = _xw(1, 4, 96, 1000)
    one = np.array(x @ w.astype(mx.float32).T)
    pieces = np.array(fl.linear_reference(x, w, piece_bytes=96 * 4 * 64))  # 16 pieces, the last shorter
    assert np.array_equal(one.view(np.uint32), pieces.view(np.uint32))


def test_leading_dims_and_bad_shapes():
    x, w = _xw(2, 6, 32, 10)
    assert fl.linear(x.reshape(2, 3, 32), w).shape == (2, 3, 10)
    with pytest.raises(ValueError, match="does not end in K"):
        fl.linear(x[:, :16], w)
    with pytest.raises(ValueError, match="must be a float"):
        fl.linear(x, w.astype(mx.int32))
    assert not fl.takes_kernel(1, w)  # the CPU runs the reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_official_checkpoint(tmp_path_factory.mktemp("official") / "ck", tiny_args(**TINY_DSPARK))


def test_weights_held_as_stored_and_logits_unchanged(checkpoint):
    model = checkpoint.source_model()
    held = dict(tree_flatten(model.parameters()))
    fp32_linears = [k for k in held if k.endswith(FP32_LINEARS) or k == "head.weight"]
    for part in ("head.weight", ".compressor.wkv.", ".markov_head.", ".confidence_head."):
        assert any(part in k for k in fp32_linears), part
    assert {str(held[k].dtype) for k in fp32_linears} == {"mlx.core.bfloat16"}
    tokens = mx.array([[5, 9, 2, 7, 11, 3]])
    logits = model(tokens, model.make_cache())
    # The old holding: fp32 copies of the same weights.
    model.load_weights([(k, held[k].astype(mx.float32)) for k in fp32_linears], strict=False)
    widened = model(tokens, model.make_cache())
    assert logits.dtype == mx.float32
    assert np.array_equal(np.array(logits).view(np.uint32), np.array(widened).view(np.uint32))


def test_loading_peaks_at_the_parameters_own_bytes(checkpoint):
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load_model(checkpoint.path, lazy=False)
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    peak = mx.get_peak_memory() - before
    assert peak <= 1.05 * params, (peak, params)  # the routed experts are stacked at load: 2x if held together
