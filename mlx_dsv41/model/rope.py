"""Rotary embedding of DeepSeek-V4.1 (docs/model.md#rope).

Interleaved pairs (2k, 2k+1) of the LAST `dims` features are rotated by position · f_k, with
f_k = θ^(-2k/dims). Two flavours, chosen per layer:
  ratio 0 (window-only layers):  θ = rope_theta (1e4), plain;
  ratio > 0:                     θ = compress_rope_theta (1.6e5) with YaRN: the correction dims are
                                 floored / ceiled (Flash: 15 and 25), mscale = 1 (nothing scales the
                                 logits or cos/sin).
The rotation runs in fp32 and the result is cast back to the input dtype, as in the reference.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlx_dsv41.cache import store_rows
from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.kernels import backend
from mlx_dsv41.kernels import rope as rope_kernel
from mlx_dsv41.model.fake_quant import FakeQuant

# The window KV's ring write rides in the rope kernel's launch on a GPU (RoPE's `ring`); False
# keeps it as its own launches (benchmarks/bench_model.py --separate-ring-writes: an A/B switch).
WRITES_RING = True
# A layer's queries and window keys in one rope_pair launch (RoPE.pair); False: two rope launches
# (benchmarks/bench_model.py --separate-launches: an A/B switch).
PAIRS = True


def yarn_correction_range(
    dims: int, theta: float, beta_fast: float, beta_slow: float, original_max_positions: int
) -> tuple[int, int]:
    """(low, high) frequency indices of the YaRN ramp, floored / ceiled and clamped to the dims."""

    def corr(rotations: float) -> float:
        return dims * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dims - 1)


def rope_frequencies(dims: int, theta: float, yarn: dict | None = None) -> np.ndarray:
    """f_k for k = 0 .. dims/2 - 1 (float64). `yarn` is the config's rope_scaling dict."""
    freqs = theta ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    if yarn is None:
        return freqs
    low, high = yarn_correction_range(
        dims, theta, yarn["beta_fast"], yarn["beta_slow"], yarn["original_max_position_embeddings"]
    )
    ramp = np.clip((np.arange(dims // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
    return freqs * (1 - ramp) + freqs / yarn["factor"] * ramp


class RoPE:
    """Interleaved RoPE on the last `dims` features of x [B, S, D] or [B, S, H, D].

    Row s of x sits at position (offset + s) · step: step is the compression ratio for compressed
    entries (group j sits at position j·r, the first token of the group) and 1 otherwise. offset
    is an int or an int32 array (the model passes arrays, so compiled steps are not specialised on it).
    `inverse=True` rotates by the negative angle (the output's conjugate rotation).
    """

    def __init__(self, dims: int, theta: float, yarn: dict | None = None):
        self.dims = dims
        self.frequencies = rope_frequencies(dims, theta, yarn)
        # mx.fast.rope's `freqs` argument is the period of each pair: angle = position / period.
        self._periods = mx.array((1.0 / self.frequencies).astype(np.float32))
        self._wide: dict[int, mx.array] = {}

    def whole_width(self, width: int) -> mx.array:
        """The periods of a rope over the whole `width` (what the GPU kernels read): inf for the
        leading (width - dims) / 2 pairs."""
        if width not in self._wide:
            lead = np.full((width - self.dims) // 2, np.inf)
            self._wide[width] = mx.array(np.concatenate([lead, 1.0 / self.frequencies]).astype(np.float32))
        return self._wide[width]

    def __call__(
        self,
        x: mx.array,
        offset: mx.array | int,
        *,
        step: int = 1,
        inverse: bool = False,
        dtype=None,
        norm=None,
        then: FakeQuant | None = None,
        ring: mx.array | None = None,
    ) -> mx.array:
        """RoPE of norm(x.astype(dtype)) (dtype: x's own by default; norm: an RMSNorm, or None),
        then the fake quantization `then`. With `ring` (a window ring [B, R, D]; x [B, S <= R, D]):
        that ring with the result's rows stored at slots (offset + s) % R, as cache.store_rows
        stores them (on a GPU in the same launch: docs/cache.md#window-ring)."""
        dtype = x.dtype if dtype is None else dtype
        scale = float(-step if inverse else step)
        on_gpu = backend() != "cpu"
        if on_gpu:
            quant = None if then is None else (then.block, then.mode)
            kernel_writes = ring is None or (WRITES_RING and ring.dtype == dtype)
            if kernel_writes and rope_kernel.refusal(x, quant, ring) is None:
                # One launch for the cast, the norm, the rotation, the fake quantization and the
                # ring write: the bytes of hc_collapse_norm, the whole-width mx.fast.rope below, the
                # fake_quant kernel and store_rows (docs/numerics.md#rope-launch).
                offset = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
                weights = None if norm is None else (norm.weight, norm.eps)
                periods = self.whole_width(x.shape[-1])
                return rope_kernel.run(x, offset, periods, dtype, step, inverse, quant, weights, ring)
        if ring is not None:
            y = self(x, offset, step=step, inverse=inverse, dtype=dtype, norm=norm, then=then)
            offset = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
            return store_rows(ring, y, offset, ring.shape[1])
        x = x.astype(dtype) if norm is None else norm(x.astype(dtype))
        if on_gpu:
            # MLX's GPU rope kernels compute in fp32 from any input dtype and round once, and the
            # leading pairs get an infinite period (angle 0: they pass unchanged) -- the bytes of the
            # fp32 tail below, without its slice, two casts and concatenation.
            y = self._rope(x, x.shape[-1], scale, offset, self.whole_width(x.shape[-1]))
        else:
            d = self.dims
            tail = self._rope(x[..., -d:].astype(mx.float32), d, scale, offset, self._periods)
            y = mx.concatenate([x[..., :-d], tail.astype(x.dtype)], axis=-1)
        return y if then is None else then(y)

    def pair(self, q: mx.array, x: mx.array, offset: mx.array, *, norm, then: FakeQuant, ring: mx.array):
        """(self(q, offset), self(x, offset, norm=norm, then=then, ring=ring)) in one rope_pair launch
        (a layer's queries and window keys: each row the bytes of its own launch), where the GPU
        kernel takes them both; else None."""
        if backend() == "cpu" or not (PAIRS and WRITES_RING) or ring.dtype != x.dtype or q.dtype != x.dtype:
            return None
        quant = (then.block, then.mode)
        if rope_kernel.pair_refusal(q, x, quant, ring) is not None:
            return None
        periods = self.whole_width(x.shape[-1])
        return rope_kernel.run_pair(q, x, offset, periods, x.dtype, 1, False, quant, (norm.weight, norm.eps), ring)

    def turn(self, offset: mx.array, width: int) -> rope_kernel.Turn:
        """This rope of rows `width` wide at offset.., for a kernel that turns the rows it stores
        (quant.linear_into's rope: the queries' wq_b); its `apply` is self(y, offset)."""
        return rope_kernel.Turn(offset, self.whole_width(width), lambda y: self(y, offset))

    def window_write(self, offset: mx.array, *, norm, then: FakeQuant, ring: mx.array):
        """What self(x, offset, norm=norm, then=then, ring=ring) does to window keys x, for a kernel
        that writes them into the ring itself (quant.windowed_linears: wq_a and wkv's launch,
        docs/design.md#roped-linears); None where the ring write is not the rope's (WRITES_RING, the
        A/B switch, and PAIRS off: separate launches)."""
        if not (PAIRS and WRITES_RING):
            return None
        periods = self.whole_width(ring.shape[-1])
        return rope_kernel.WindowWrite(offset, periods, norm.weight, norm.eps, (then.block, then.mode), ring)

    @staticmethod
    def _rope(x: mx.array, dims: int, scale: float, offset, periods: mx.array) -> mx.array:
        if x.ndim == 4:  # mx.fast.rope wants positions on axis -2
            x = x.swapaxes(1, 2)
        y = mx.fast.rope(x, dims, traditional=True, base=None, scale=scale, offset=offset, freqs=periods)
        return y.swapaxes(1, 2) if y.ndim == 4 else y


def make_rope(args: ModelArgs, layer_id: int) -> RoPE:
    """The RoPE flavour of one layer (docs/model.md#rope): by its compression ratio."""
    ratio = args.compress_ratios[layer_id]
    if ratio == 0:
        return RoPE(args.qk_rope_head_dim, args.rope_theta)
    scaling = args.rope_scaling
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise ConfigError(f"rope_scaling: only rope_type 'yarn' is supported, got {kind!r}")
        missing = [
            k for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings") if k not in scaling
        ]
        if missing:
            raise ConfigError(f"rope_scaling (yarn) is missing {', '.join(missing)}")
    return RoPE(args.qk_rope_head_dim, args.compress_rope_theta, scaling)
