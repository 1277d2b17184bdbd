"""Reading and validating EXL3 tensors as stored in a checkpoint (docs/exl3.md#stored-tensors).

A quantized linear under prefix P is ``P.trellis`` (int16, (k/16, n/16, 16K)), ``P.suh`` (fp16,
(k,)), ``P.svh`` (fp16, (n,)), an optional ``P.bias`` and at most one 0-dim int32 codebook marker
(``P.mul1`` / ``P.mcg``; neither means 3INST). k and n are the 128-padded dims.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from mlx_dsv41.exl3.codebook import MARKER_VALUES
from mlx_dsv41.exl3.hadamard import BLOCK
from mlx_dsv41.exl3.trellis import check_trellis


def has_exl3(tensors: Mapping, prefix: str) -> bool:
    return f"{prefix}.trellis" in tensors


def codebook_from_markers(tensors: Mapping, prefix: str) -> str:
    """'mul1', 'mcg' or '3inst', from which marker tensor is present; marker values are checked
    against the locked multipliers (an older, user-chosen multiplier would decode wrongly)."""
    present = [name for name in MARKER_VALUES if f"{prefix}.{name}" in tensors]
    if len(present) > 1:
        raise ValueError(f"EXL3 tensor {prefix} has both .mcg and .mul1 markers")
    if not present:
        return "3inst"
    name = present[0]
    marker = np.asarray(tensors[f"{prefix}.{name}"])
    if marker.size != 1 or marker.dtype.kind not in "iu":
        raise ValueError(f"EXL3 marker {prefix}.{name} must be a 0-dim int32, got {marker.dtype} {marker.shape}")
    value = int(marker.reshape(())) & 0xFFFFFFFF
    if value != MARKER_VALUES[name]:
        raise ValueError(
            f"EXL3 marker {prefix}.{name} = {value:#010x} is not the locked {name} multiplier "
            f"{MARKER_VALUES[name]:#010x} (pre-release quant with a custom multiplier?)"
        )
    return name


def _signs_from_bitfield(bits: np.ndarray) -> np.ndarray:
    """Legacy ``su``/``sv``: bit i of int16 word w is the sign of element 16w+i (set = -1)."""
    words = np.asarray(bits).astype(np.uint16).astype(np.uint32)
    set_ = (words[:, None] >> np.arange(16, dtype=np.uint32)) & 1
    return np.where(set_.reshape(-1) == 1, -1.0, 1.0).astype(np.float16)


def _as_mx(a) -> mx.array:
    return a if isinstance(a, mx.array) else mx.array(np.asarray(a))


def linear_tensors(tensors: Mapping, prefix: str) -> dict:
    """{trellis, suh, svh, codebook, bias} for the EXL3 linear stored under ``prefix``."""
    if not has_exl3(tensors, prefix):
        raise KeyError(f"no EXL3 tensor {prefix}.trellis")
    out = {"trellis": _as_mx(tensors[f"{prefix}.trellis"]), "codebook": codebook_from_markers(tensors, prefix)}
    for side, legacy in (("suh", "su"), ("svh", "sv")):
        if f"{prefix}.{side}" in tensors:
            out[side] = _as_mx(tensors[f"{prefix}.{side}"])
        elif f"{prefix}.{legacy}" in tensors:
            out[side] = mx.array(_signs_from_bitfield(tensors[f"{prefix}.{legacy}"]))
        else:
            raise KeyError(f"EXL3 tensor {prefix} has no .{side}")
    bias = tensors.get(f"{prefix}.bias")
    out["bias"] = None if bias is None else _as_mx(bias)
    return out


def check_linear(trellis, suh, svh, codebook, bias=None, in_features=None, out_features=None):
    """Validate one EXL3 linear; returns (k, n, k2, in_features, out_features).

    in/out_features are the true dims (default: the padded k, n); padding is at most 127.
    """
    k2, k, n = check_trellis(trellis, codebook, BLOCK)
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"EXL3 suh/svh must be ({k},)/({n},) for trellis {trellis.shape}, got {suh.shape}/{svh.shape}")
    if bias is not None and bias.shape not in ((n,), (out_features or n,)):
        raise ValueError(f"EXL3 bias must have shape ({out_features or n},), got {bias.shape}")
    in_features = k if in_features is None else int(in_features)
    out_features = n if out_features is None else int(out_features)
    if not (k - BLOCK < in_features <= k) or not (n - BLOCK < out_features <= n):
        raise ValueError(f"EXL3 true dims {in_features}x{out_features} do not pad to the stored {k}x{n}")
    return k, n, k2, in_features, out_features
