"""mHC ops (docs/model.md#mhc), each on a Metal/CUDA kernel or plain MLX:

    mixes(streams [.., HC, D], fn, base, scale)     -> pre [.., HC], post [.., HC], comb [.., HC, HC]
    site(streams, pre, weight, eps, fn, base, scale) -> collapse_norm(streams, pre, weight, eps), mixes(..)
    collapse(streams, pre)                         -> Σ_i pre[i]·stream_i, in the stream dtype
    collapse_norm(streams, pre, weight, eps)       -> rms_norm(collapse(streams, pre), weight)
    expand(y [.., D], residual [.., HC, D], post, comb) -> post[j]·y + Σ_i comb[i, j]·old_i

On the CPU the plain-MLX reference runs (its bytes are the project's CPU reference); on a GPU:
- ``site`` (a Block site's input and mixes; ``mixes`` alone is a site whose input is dropped):
  fp32_gemv for z · fnᵀ (z the streams in fp32) and hc_mix, which does the site's collapse and
  RMSNorm, the mixes' RMS statistic, the gates, the row softmax and all Sinkhorn iterations in one
  launch (the reference is ~150 MLX primitives per site, most of them Sinkhorn's);
- ``collapse_norm``: hc_collapse_norm (the collapse, its rounding to the stream dtype, the RMSNorm);
- ``expand``: hc_expand.
The kernels sum in fp32 in a fixed order (one threadgroup per token), so a token's bytes do not
depend on the other tokens of the call; they differ from the MLX reference on the same GPU only
by fp32 summation order and fused multiply-adds (tests/gpu/test_hc_kernels.py bounds both
against float64).
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import Kernel, backend, float_bits, fp32_linear, register

_THREADS = 256  # hc_collapse_norm, hc_expand: threads per threadgroup (hc_collapse_norm: one per token)
_MIX_THREADS = 1024  # hc_mix: one threadgroup per token; every stream element's load in flight at once
_FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

MIX = register(
    Kernel(
        "hc_mix",
        ("mm", "streams", "base", "scale", "pre", "weight"),
        ("out", "x"),
        includes=("hc.h",),
        max_threads=_MIX_THREADS,
        examples=lambda: _example_mix(),
    )
)
COLLAPSE_NORM = register(
    Kernel(
        "hc_collapse_norm",
        ("streams", "pre", "weight"),
        ("out",),
        includes=("hc.h",),
        max_threads=_THREADS,
        examples=lambda: _example_collapse_norm(),
    )
)
EXPAND = register(
    Kernel(
        "hc_expand",
        ("y", "residual", "post", "comb"),
        ("out",),
        max_threads=_THREADS,
        examples=lambda: _example_expand(),
    )
)


# ------------------------------------------------------------------------------- reference


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Columns first, then (rows, columns) iters - 1 more times; sums over i are axis -2."""
    comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (mx.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


@cache
def _scale_ids(hc: int) -> mx.array:
    return mx.array([0] * hc + [1] * hc + [2] * hc * hc, dtype=mx.int32)


def mixes_reference(streams, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    *lead, hc, dim = streams.shape
    z = streams.reshape(*lead, hc * dim).astype(mx.float32)  # stream-major flatten
    # One RMS statistic over all HC·D values, applied after the projection (docs/model.md#mhc).
    inv_rms = mx.rsqrt(mx.mean(z * z, axis=-1, keepdims=True) + norm_eps)
    m = (z @ fn.astype(mx.float32).T) * inv_rms
    # scale[0] scales the pre columns, scale[1] the post columns, scale[2] the comb columns.
    m = m * scale.astype(mx.float32)[_scale_ids(hc)] + base.astype(mx.float32)
    gates = mx.sigmoid(m[..., : 2 * hc])
    pre = gates[..., :hc] + hc_eps
    post = 2.0 * gates[..., hc:]
    comb = mx.softmax(m[..., 2 * hc :].reshape(*lead, hc, hc), axis=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """Σ_i pre[i]·stream_i in fp32, cast to the stream dtype: [B, S, HC, D] -> [B, S, D]."""
    x = pre[..., None, :] @ streams.astype(mx.float32)  # [B, S, 1, D]
    return x.squeeze(-2).astype(streams.dtype)


def collapse_norm_reference(streams, pre, weight, eps: float) -> mx.array:
    x = collapse(streams, pre)
    # fp32 input and weight: the fused norm then normalises and multiplies in fp32 with no
    # intermediate rounding (docs/numerics.md#rms-eps: never feed bf16 to a fused norm at eps
    # 1e-20).
    return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


def expand_reference(y, residual, post, comb) -> mx.array:
    mixed = comb.swapaxes(-1, -2) @ residual.astype(mx.float32)  # sums over the FIRST index of comb
    out = post[..., None] * y.astype(mx.float32)[..., None, :] + mixed
    return out.astype(residual.dtype)


# ------------------------------------------------------------------------------- checks


def _check_streams(streams, what: str) -> tuple[int, int]:
    if streams.ndim < 3 or streams.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what}: streams must be a float array [..., HC, D], got {streams.dtype} {streams.shape}")
    hc, dim = streams.shape[-2:]
    if hc < 1 or hc & (hc - 1) or hc * hc > 32:
        raise ValueError(f"{what}: the kernels need a power-of-two hc_mult with hc² <= 32, got {hc}")
    return hc, dim


def _rows(shape) -> int:
    return math.prod(shape) if shape else 1


# ------------------------------------------------------------------------------- ops


def mixes(streams, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    """streams [..., HC, D] -> pre [..., HC], post [..., HC], comb [..., HC, HC] (fp32); fn
    [(2+HC)·HC, HC·D], base [(2+HC)·HC], scale [3] are one site's fp32 parameters and comb[..., i, j]
    is the weight of old stream i in new stream j."""
    if backend() == "cpu":
        _check_site(streams, fn, base, scale, iters)
        return mixes_reference(streams, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    hc, dim = _check_streams(streams, "hc mixes")
    unit = graph_constants.full((*streams.shape[:-1],), 1.0, mx.float32)
    weight = graph_constants.full((dim,), 1.0, mx.float32)
    return site(streams, unit, weight, norm_eps, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)[1]


def site(streams, pre, weight, eps: float, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    """One Block site: (its input collapse_norm(streams, pre, weight, eps) [..., D], its mixes (pre,
    post, comb) as `mixes` gives them). On a GPU: fp32_gemv and hc_mix, two launches."""
    hc, dim = _check_site(streams, fn, base, scale, iters)
    _check_collapse(streams, pre, weight, "hc site")
    if backend() == "cpu":
        x = collapse_norm_reference(streams, pre, weight, eps)
        return x, mixes_reference(streams, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    lead = streams.shape[:-2]
    flat = streams.reshape(_rows(lead), hc, dim)
    mm = fp32_linear.linear(flat.reshape(-1, hc * dim), fn)  # [T, mix] fp32 (docs/numerics.md#fp32-linears)
    pre = pre.astype(mx.float32).reshape(-1, hc)
    out, x = MIX(**mix_args(mm, flat, base, scale, pre, weight, iters, hc_eps, norm_eps, eps))
    out = out.reshape(*lead, (2 + hc) * hc)
    mixed = out[..., :hc], out[..., hc : 2 * hc], out[..., 2 * hc :].reshape(*lead, hc, hc)
    return x.reshape(*lead, dim), mixed


def _check_site(streams, fn, base, scale, iters: int) -> tuple[int, int]:
    hc, dim = _check_streams(streams, "hc mixes")
    mix = (2 + hc) * hc
    if fn.shape != (mix, hc * dim) or base.shape != (mix,) or scale.shape != (3,):
        raise ValueError(
            f"hc mixes: fn [{mix}, {hc * dim}], base [{mix}], scale [3] expected, got "
            f"{fn.shape}, {base.shape}, {scale.shape}"
        )
    if iters < 1:
        raise ValueError(f"hc mixes: need at least one Sinkhorn iteration, got {iters}")
    return hc, dim


def _check_collapse(streams, pre, weight, what: str) -> None:
    lead, dim = streams.shape[:-1], streams.shape[-1]
    if pre.shape != lead or weight.shape != (dim,):
        raise ValueError(f"{what}: pre {lead} and weight [{dim}] expected, got {pre.shape}, {weight.shape}")


def collapse_norm(streams, pre, weight, eps: float) -> mx.array:
    """rms_norm(collapse(streams, pre), weight) in the stream dtype: [..., HC, D] -> [..., D]."""
    hc, dim = _check_streams(streams, "hc collapse_norm")
    _check_collapse(streams, pre, weight, "hc collapse_norm")
    if backend() == "cpu":
        return collapse_norm_reference(streams, pre, weight, eps)
    lead = streams.shape[:-2]
    flat = streams.reshape(_rows(lead), hc, dim)
    out = COLLAPSE_NORM(**collapse_norm_args(flat, pre.astype(mx.float32).reshape(-1, hc), weight, eps))[0]
    return out.reshape(*lead, dim)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """The model's RMSNorm of x [..., D] (docs/numerics.md#dtypes: fp32 math, rounded once to
    x.dtype). On a GPU it is hc_collapse_norm over one stream of weight 1 (that collapse is exact):
    one launch, where mx.fast.rms_norm needs a cast on each side to compute in fp32."""
    if backend() == "cpu":
        return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)
    one = graph_constants.full((*x.shape[:-1], 1), 1.0, mx.float32)
    return collapse_norm(x[..., None, :], one, weight, eps)


def expand(y, residual, post, comb) -> mx.array:
    """new_j = post[j]·y + Σ_i comb[i, j]·old_i in fp32, cast to the stream dtype."""
    hc, dim = _check_streams(residual, "hc expand")
    lead = residual.shape[:-2]
    if y.shape != (*lead, dim) or post.shape != (*lead, hc) or comb.shape != (*lead, hc, hc):
        raise ValueError(
            f"hc expand: y {(*lead, dim)}, post {(*lead, hc)}, comb {(*lead, hc, hc)} expected, "
            f"got {y.shape}, {post.shape}, {comb.shape}"
        )
    if backend() == "cpu":
        return expand_reference(y, residual, post, comb)
    rows = _rows(lead)
    out = EXPAND(
        **expand_args(
            y.reshape(rows, dim),
            residual.reshape(rows, hc, dim),
            post.astype(mx.float32).reshape(rows, hc),
            comb.astype(mx.float32).reshape(rows, hc * hc),
        )
    )[0]
    return out.reshape(residual.shape)


# ------------------------------------------------------------------------------- launch kwargs


def mix_args(
    mm,
    streams,
    base,
    scale,
    pre,
    weight,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    eps: float,
    init_value=None,
    guard: int = 0,
) -> dict:
    """hc_mix call kwargs: one threadgroup per token of streams [T, HC, D]; ``guard`` extra output
    rows (tests)."""
    T, hc, dim = streams.shape
    return dict(
        inputs=[mm, streams, base.astype(mx.float32), scale.astype(mx.float32), pre, weight],
        output_shapes=[(T + guard, (2 + hc) * hc), (T + guard, dim)],
        output_dtypes=[mx.float32, streams.dtype],
        grid=(_MIX_THREADS * T, 1, 1),
        threadgroup=(_MIX_THREADS, 1, 1),
        template=[
            ("T", streams.dtype),
            ("HC", hc),
            ("ITERS", int(iters)),
            ("HC_EPS_BITS", float_bits(hc_eps)),
            ("NORM_EPS_BITS", float_bits(norm_eps)),
            ("EPS_BITS", float_bits(eps)),
            ("THREADS", _MIX_THREADS),
        ],
        init_value=init_value,
    )


def collapse_norm_args(streams, pre, weight, eps: float, init_value=None, guard: int = 0) -> dict:
    T, hc, dim = streams.shape
    return dict(
        inputs=[streams, pre, weight],
        output_shapes=[(T + guard, dim)],
        output_dtypes=[streams.dtype],
        grid=(_THREADS * T, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("EPS_BITS", float_bits(eps))],
        init_value=init_value,
    )


def expand_args(y, residual, post, comb, init_value=None, guard: int = 0) -> dict:
    T, hc, dim = residual.shape
    return dict(
        inputs=[y, residual, post, comb],
        output_shapes=[(T + guard, hc, dim)],
        output_dtypes=[residual.dtype],
        grid=(-(-dim // _THREADS) * _THREADS, T, 1),
        threadgroup=(_THREADS, 1, 1),
        template=[("T", residual.dtype), ("HC", hc)],
        init_value=init_value,
    )


# ------------------------------------------------------------------------------- CI examples


def _example_streams(T=3, hc=4, dim=96):
    return mx.random.normal((T, hc, dim), key=mx.random.key(1)).astype(mx.bfloat16)


def _example_mix():
    s = _example_streams()
    T, hc, dim = s.shape
    mix = (2 + hc) * hc
    pre, w = mx.ones((T, hc)), mx.ones((dim,))
    s2 = mx.zeros((T, 2, dim), mx.float32)
    return [
        mix_args(mx.zeros((T, mix)), s, mx.zeros((mix,)), mx.ones((3,)), pre, w, 20, 1e-6, 1e-20, 1e-20),
        mix_args(mx.zeros((T, 8)), s2, mx.zeros((8,)), mx.ones((3,)), mx.ones((T, 2)), w, 3, 1e-6, 1e-20, 1e-6),
    ]


def _example_collapse_norm():
    s = _example_streams()
    return [
        collapse_norm_args(s, mx.ones((s.shape[0], s.shape[1])), mx.ones((s.shape[2],), mx.bfloat16), 1e-20),
        collapse_norm_args(s.astype(mx.float32), mx.ones((s.shape[0], s.shape[1])), mx.ones((s.shape[2],)), 1e-6),
    ]


def _example_expand():
    s = _example_streams()
    T, hc, dim = s.shape
    return [
        expand_args(mx.zeros((T, dim), mx.bfloat16), s, mx.ones((T, hc)), mx.ones((T, hc * hc))),
        expand_args(mx.zeros((T, dim), mx.float32), s.astype(mx.float32), mx.ones((T, hc)), mx.ones((T, hc * hc))),
    ]
