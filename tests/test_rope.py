"""RoPE (docs/model.md#rope) against a float64 numpy rotation written from the docs.

Angles are fp32 in the model, as in the reference (fp32 outer product of positions and
frequencies): an fp32 angle is within about one fp32 ulp (2^-23 relative) of the exact one, so
the tolerance is (1e-6 + 2^-23 · largest angle) · max|x|. Small positions check the semantics
tightly (~1e-6); large ones (up to 70k) check that nothing but fp32 angle rounding appears.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import FLASH_YARN, ref_frequencies, ref_rope

from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.model.rope import RoPE, make_rope, rope_frequencies, yarn_correction_range


def test_flash_yarn_correction_dims_are_floored_and_ceiled():
    # docs/model.md#rope: unfloored 15.45 and 24.71 -> low 15, high 25.
    def corr(rot):
        return 64 * math.log(65536 / (rot * 2 * math.pi)) / (2 * math.log(160000))

    assert round(corr(32), 2) == 15.45 and round(corr(1), 2) == 24.71
    assert yarn_correction_range(64, 160000, 32, 1, 65536) == (15, 25)


def test_frequencies_follow_the_spec():
    # atol=0: numpy's default atol (1e-8) would admit a 1 % error on the high frequencies.
    plain = rope_frequencies(64, 10000.0)
    assert np.allclose(plain, 10000.0 ** (-np.arange(32) * 2 / 64), rtol=1e-15, atol=0)
    base = rope_frequencies(64, 160000.0)
    yarn = rope_frequencies(64, 160000.0, FLASH_YARN)
    assert np.array_equal(yarn[:16], base[:16])  # k <= 15 keep their frequency
    assert np.allclose(yarn[25:], base[25:] / 16, rtol=1e-15, atol=0)  # k >= 25 divided by the factor
    k = 20  # ramp (20 - 15) / (25 - 15) = 0.5
    assert math.isclose(yarn[k], base[k] * 0.5 + base[k] / 16 * 0.5, rel_tol=1e-15)
    assert np.allclose(yarn, ref_frequencies(64, 160000.0, FLASH_YARN), rtol=1e-15, atol=0)


def _tolerance(freqs, max_position, x):
    return (1e-6 + 2.0**-23 * max_position * freqs.max()) * np.abs(x).max()


@pytest.mark.parametrize("yarn", [None, FLASH_YARN], ids=["plain", "yarn"])
@pytest.mark.parametrize("offset", [0, 37, 4093, 70001])
@pytest.mark.parametrize("ndim", [3, 4])
def test_rope_matches_float64_rotation(yarn, offset, ndim):
    theta = 10000.0 if yarn is None else 160000.0
    rope = RoPE(64, theta, yarn)
    rng = np.random.default_rng(offset + ndim)
    shape = (2, 5, 3, 96) if ndim == 4 else (2, 5, 96)
    x = rng.standard_normal(shape).astype(np.float32)
    got = np.array(rope(mx.array(x), offset))
    freqs = ref_frequencies(64, theta, yarn)  # independent of the code under test
    want = ref_rope(x.astype(np.float64).swapaxes(0, 1), offset + np.arange(5), freqs).swapaxes(0, 1)
    assert np.array_equal(got[..., :-64], x[..., :-64])  # only the last dims rotate
    assert np.abs(got - want).max() <= _tolerance(freqs, offset + 5, x)


def test_compressed_positions_step_by_the_ratio():
    # Group j sits at position j·r (docs/model.md#rope): offset=first, step=r.
    rope = RoPE(16, 160000.0, FLASH_YARN)
    x = np.random.default_rng(1).standard_normal((1, 6, 32)).astype(np.float32)
    got = np.array(rope(mx.array(x), 9, step=2))
    freqs = ref_frequencies(16, 160000.0, FLASH_YARN)
    want = ref_rope(x[0].astype(np.float64), 2 * (9 + np.arange(6)), freqs)[None]
    assert np.abs(got - want).max() <= _tolerance(freqs, 30, x)


def test_inverse_is_the_conjugate_rotation():
    rope = RoPE(16, 10000.0)
    x = np.random.default_rng(2).standard_normal((1, 4, 2, 64)).astype(np.float32)
    inv = np.array(rope(mx.array(x), 100, inverse=True))
    freqs = ref_frequencies(16, 10000.0, None)
    want = ref_rope(x.astype(np.float64).swapaxes(0, 1), 100 + np.arange(4), freqs, inverse=True).swapaxes(0, 1)
    assert np.abs(inv - want).max() <= _tolerance(freqs, 104, x)
    back = np.array(rope(rope(mx.array(x), 100), 100, inverse=True))
    assert np.abs(back - x).max() < 1e-5


def test_bf16_input_rotates_in_fp32_and_rounds_once():
    rope = RoPE(16, 10000.0)
    x = mx.array(np.random.default_rng(3).standard_normal((1, 8, 64)).astype(np.float32)).astype(mx.bfloat16)
    got = rope(x, 5)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, rope(x.astype(mx.float32), 5).astype(mx.bfloat16))


def test_make_rope_picks_the_flavour_by_compression_ratio():
    args = ModelArgs()  # Flash
    plain, yarn = make_rope(args, 0), make_rope(args, 2)
    assert np.allclose(plain.frequencies, ref_frequencies(64, 10000.0, None), rtol=1e-15, atol=0)
    assert np.allclose(yarn.frequencies, ref_frequencies(64, 160000.0, FLASH_YARN), rtol=1e-15, atol=0)
    assert np.array_equal(make_rope(args, 30).frequencies, yarn.frequencies)  # ratio 1 layers too


def test_make_rope_rejects_other_scaling_types():
    args = ModelArgs(rope_scaling={"rope_type": "linear", "factor": 2})
    with pytest.raises(ConfigError, match="only rope_type 'yarn'"):
        make_rope(args, 2)
    args = ModelArgs(rope_scaling={"rope_type": "yarn", "factor": 16})
    with pytest.raises(ConfigError, match="missing beta_fast, beta_slow, original_max_position_embeddings"):
        make_rope(args, 2)


@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("inverse", [False, True])
def test_the_gpu_launch_over_the_whole_vector_gives_the_tails_bytes(monkeypatch, ndim, inverse):
    """The GPU path where the rope kernel refuses x (one mx.fast.rope over the whole vector,
    infinite periods for the leading pairs) run through MLX's CPU rope on fp32 input: the leading
    features pass unchanged and the tail gets the CPU path's bytes. (bf16 input: MLX's GPU kernels
    compute in fp32 and round once, as the tail path does; tests/gpu/test_rope_gpu.py checks it on
    the device.)"""
    from mlx_dsv41.kernels import rope as rope_kernel
    from mlx_dsv41.model import rope as rope_module

    monkeypatch.setattr(rope_kernel, "refusal", lambda x, quant, ring=None: "refused for this test")

    rope = RoPE(64, 10000.0, FLASH_YARN)
    shape = (2, 5, 3, 512) if ndim == 4 else (2, 5, 512)
    x = mx.array(np.random.default_rng(ndim).standard_normal(shape).astype(np.float32))
    offset = mx.array(37, mx.int32)
    tail_path = np.array(rope(x, offset, step=4, inverse=inverse))
    monkeypatch.setattr(rope_module, "backend", lambda: "cuda")
    whole = np.array(rope(x, offset, step=4, inverse=inverse))
    assert np.array_equal(whole[..., :-64], np.array(x)[..., :-64])
    assert np.array_equal(whole.view(np.uint32), tail_path.view(np.uint32))
