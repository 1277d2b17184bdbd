"""The official DeepSeek-V4.1 release formats (docs/checkpoint.md#official-formats) → MLX-native
quantized weights.

FP8 linears: `weight` F8_E4M3 [out, in] + `scale` E8M0 [ceil(out/32), ceil(in/32)], one scale per
32x32 tile. MLX's mxfp8 stores the same e4m3 bytes with one E8M0 scale per 32 inputs of a row, so
the tile scale is repeated over its 32 rows and the bytes are reinterpreted as uint32 (no
re-rounding: the conversion is exact).

FP4 experts: `weight` I8 [out, in/2], two E2M1 codes per byte, low nibble = lower index, + `scale`
E8M0 [out, in/32]. That is MLX's mxfp4 layout byte for byte.

A scale byte of 255 encodes NaN in E8M0; a real checkpoint never holds one, so it is refused.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dsv41.kernels import mxfp4_gemv
from mlx_dsv41.quant.accumulation import quantized_input
from mlx_dsv41.quant.errors import FormatError

GROUP = 32  # MX block: 32 inputs share one E8M0 scale
MODES = {"mxfp4": 4, "mxfp8": 8}  # MLX's MX modes and their bits per weight


def fp8_shapes(out: int, inp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(weight, scale) shapes of an official FP8 linear [out, in]: one scale per 32x32 tile."""
    return (out, inp), (-(-out // GROUP), -(-inp // GROUP))


def fp4_shapes(out: int, inp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(weight, scale) shapes of an official FP4 linear [out, in]: two codes per byte, one scale
    per 32 inputs."""
    return (out, inp // 2), (out, inp // GROUP)


def mx_shapes(out: int, inp: int, bits: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(weight uint32, scales uint8) shapes of an MLX mxfp4 / mxfp8 linear [out, in]."""
    return (out, inp * bits // 32), (out, inp // GROUP)


def _check_scales(scale: mx.array, name: str) -> None:
    if scale.dtype != mx.uint8:
        raise FormatError(f"{name}: E8M0 scales must be stored as uint8 bytes, got {scale.dtype}")
    if bool(mx.any(scale == 255).item()):
        raise FormatError(f"{name}: E8M0 scale byte 255 (NaN) in the checkpoint")


def fp8_block_to_mxfp8(weight: mx.array, scale: mx.array, name: str = "fp8 weight"):
    """(w_q uint32 [out, in/4], scales uint8 [out, in/32]) for `mx.quantized_matmul(mode='mxfp8')`."""
    if weight.ndim != 2 or weight.dtype != mx.uint8:
        raise FormatError(f"{name}: expected F8_E4M3 bytes [out, in], got {weight.dtype} {weight.shape}")
    out, inp = weight.shape
    if inp % GROUP:
        raise FormatError(f"{name}: input dim {inp} is not a multiple of {GROUP}")
    want = fp8_shapes(out, inp)[1]
    if tuple(scale.shape) != want:
        raise FormatError(
            f"{name}: scale shape {tuple(scale.shape)} does not tile weight {weight.shape} by 32x32 (want {want})"
        )
    _check_scales(scale, name)
    rows = mx.repeat(scale, GROUP, axis=0)[:out]
    return weight.view(mx.uint32), rows


def fp4_to_mxfp4(weight: mx.array, scale: mx.array, name: str = "fp4 weight"):
    """(w_q uint32 [out, in/8], scales uint8 [out, in/32]) for `mx.quantized_matmul(mode='mxfp4')`."""
    if weight.ndim != 2 or weight.dtype not in (mx.int8, mx.uint8):
        raise FormatError(f"{name}: expected I8 packed E2M1 [out, in/2], got {weight.dtype} {weight.shape}")
    out, half = weight.shape
    inp = 2 * half
    if inp % GROUP:
        raise FormatError(f"{name}: input dim {inp} is not a multiple of {GROUP}")
    if tuple(scale.shape) != fp4_shapes(out, inp)[1]:
        raise FormatError(f"{name}: scale shape {tuple(scale.shape)} != {fp4_shapes(out, inp)[1]} (one per 32 inputs)")
    _check_scales(scale, name)
    return weight.view(mx.uint8).view(mx.uint32), scale


def dequantize_fp8_block(weight, scale, dtype=mx.bfloat16, name: str = "fp8 weight") -> mx.array:
    """Dense [out, in] (docs/checkpoint.md#official-conversion: `wo_a` must be dequantized with its
    scales, never used raw)."""
    wq, rows = fp8_block_to_mxfp8(weight, scale, name)
    return mx.dequantize(wq, rows, group_size=GROUP, bits=8, mode="mxfp8", dtype=dtype)


def dequantize_fp4(weight, scale, dtype=mx.bfloat16, name: str = "fp4 weight") -> mx.array:
    wq, rows = fp4_to_mxfp4(weight, scale, name)
    return mx.dequantize(wq, rows, group_size=GROUP, bits=4, mode="mxfp4", dtype=dtype)


class MXLinear(nn.QuantizedLinear):
    """An MX-quantized linear that sums in fp32 and rounds once to x.dtype (quant/accumulation.py:
    MLX's quantized_matmul would keep bf16 partial sums for bf16 x on some backends; where that is
    CUDA's mxfp4 qmv, the mxfp4_gemv kernel takes the rows in their own dtype)."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim else 1
        if mxfp4_gemv.takes_kernel(self.bits, self.mode, rows):
            y = mxfp4_gemv.linear(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"])
            return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)
        y = mx.quantized_matmul(
            quantized_input(x, "quantized_matmul", self.bits, rows),
            self["weight"],
            scales=self["scales"],
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return y.astype(x.dtype)


def mx_quantized_linear(wq: mx.array, scales: mx.array, mode: str) -> MXLinear:
    """An `MXLinear` holding already-quantized MX weights (no re-quantization)."""
    bits = MODES[mode]
    out = wq.shape[0]
    inp = wq.shape[1] * 32 // bits
    layer = MXLinear(GROUP, GROUP, bias=False, group_size=GROUP, bits=bits, mode=mode)
    layer.weight, layer.scales = wq, scales
    layer.input_dims, layer.output_dims = inp, out  # informational; the matmul reads the arrays
    return layer


# numpy oracles for tests and the converter's spot checks: value of each code, independent of MLX.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def e4m3_values() -> np.ndarray:
    """float64 value of each of the 256 E4M3 (fn) codes; 0x7F/0xFF are NaN."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val
