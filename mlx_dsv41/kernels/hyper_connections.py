"""mHC ops (docs/model.md#mhc), each on a Metal/CUDA kernel or plain MLX:

    mixes(streams [.., HC, D], fn, base, scale)     -> pre [.., HC], post [.., HC], comb [.., HC, HC]
    site(streams, prev, weight, eps, fn, base, scale) -> collapse_norm(streams, prev, weight, eps),
                                                       m = pre | post | comb [.., (2+HC)·HC]
    collapse(streams, pre)                         -> Σ_i pre[i]·stream_i, in the stream dtype
    collapse_norm(streams, pre, weight, eps)       -> rms_norm(collapse(streams, pre), weight)
    expand(y [.., D], residual [.., HC, D], m)     -> post[j]·y + Σ_i comb[i, j]·old_i
    expand_site(y, residual, m, prev, weight, eps, fn, base, scale)
                                                   -> streams = expand(y, residual, m), then
                                                      site(streams, prev, ...): (streams, x, m')

A site's mixes travel as one array m [.., (2+HC)·HC] (`split` gives pre, post, comb): the kernels
read their parts in place, so a site costs no slices or reshapes (each a graph node that a decode
step would build and evaluate). Wherever a `pre` is read, an array whose first HC columns are the
pre may be given (a site's m: the next site collapses with it).

On the CPU the plain-MLX reference runs (its bytes are the project's CPU reference); on a GPU:
- ``site`` (a Block site's input and mixes; ``mixes`` alone is a site whose input is dropped):
  fp32_gemv for z · fnᵀ (z the streams in fp32) and hc_mix, which does the site's collapse and
  RMSNorm, the mixes' RMS statistic, the gates, the row softmax and all Sinkhorn iterations in one
  launch (the reference is ~150 MLX primitives per site, most of them Sinkhorn's); on CUDA, given
  the site's counters, the two as one hc_site launch (docs/design.md#grid-finish);
- ``collapse_norm``: hc_collapse_norm (the collapse, its rounding to the stream dtype, the RMSNorm);
- ``expand``: hc_expand; ``expand_site``: hc_expand then the site's launches, or on CUDA, given the
  site's counters, one hc_expand_site launch that forms the streams as the site reads them
  (docs/design.md#expand-site).
The kernels take the arrays in the model's shapes (tokens = the leading dims).
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
from mlx_dsv41.kernels import Kernel, backend, float_bits, fp32_linear, grid_finish, register

_THREADS = 256  # hc_collapse_norm, hc_expand: threads per threadgroup (hc_collapse_norm: one per token)
_MIX_THREADS = 1024  # hc_mix: one threadgroup per token; every stream element's load in flight at once
# The order hc_mix's sums keep (those of 1,024 threads), whatever its threads: hc_site finishes a
# site in one of fp32_gemv's 256-thread threadgroups with the bytes of hc_mix (hc.h: hc_mix_token).
_MIX_ORDER = 1024
# hc_expand_site's threadgroup memory for its part of the streams (rows x a part's columns), under
# the 48 KB a CUDA threadgroup may declare (Flash, 8 bf16 rows: 32 KB)
_EXPAND_SITE_PART_BYTES = 40 << 10
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
SITE = register(
    Kernel(
        "hc_site",
        ("streams", "fn", "base", "scale", "pre", "weight", "counters"),
        ("mm", "out", "x"),
        includes=("grid_finish.h", "fp32_gemv.h", "hc.h"),
        max_threads=fp32_linear.THREADS,
        examples=lambda: _example_site(),
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
        ("y", "residual", "mixes"),
        ("out",),
        includes=("hc.h",),
        max_threads=_THREADS,
        examples=lambda: _example_expand(),
    )
)
EXPAND_SITE = register(
    Kernel(
        "hc_expand_site",
        ("y", "residual", "mixes", "fn", "base", "scale", "pre", "weight", "counters"),
        ("mm", "out", "x", "streams", "scratch"),
        includes=("grid_finish.h", "fp32_gemv.h", "hc.h"),
        max_threads=fp32_linear.THREADS,
        examples=lambda: _example_expand_site(),
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
    """Σ_i pre[i]·stream_i in fp32, cast to the stream dtype: [B, S, HC, D] -> [B, S, D] (pre: the
    first HC columns of [B, S, >= HC])."""
    x = pre[..., None, : streams.shape[-2]] @ streams.astype(mx.float32)  # [B, S, 1, D]
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


def split(m: mx.array, hc: int) -> tuple[mx.array, mx.array, mx.array]:
    """A site's mixes m [.., (2+HC)·HC] -> pre [.., HC], post [.., HC], comb [.., HC, HC]."""
    return m[..., :hc], m[..., hc : 2 * hc], m[..., 2 * hc :].reshape(*m.shape[:-1], hc, hc)


# ------------------------------------------------------------------------------- ops


def mixes(streams, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    """streams [..., HC, D] -> pre [..., HC], post [..., HC], comb [..., HC, HC] (fp32); fn
    [(2+HC)·HC, HC·D], base [(2+HC)·HC], scale [3] are one site's fp32 parameters and comb[..., i, j]
    is the weight of old stream i in new stream j."""
    hc, dim = _check_site(streams, fn, base, scale, iters)
    if backend() == "cpu":
        return mixes_reference(streams, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    unit = graph_constants.full((*streams.shape[:-1],), 1.0, mx.float32)
    weight = graph_constants.full((dim,), 1.0, mx.float32)
    m = site(streams, unit, weight, norm_eps, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)[1]
    return split(m, hc)


def site(
    streams, prev, weight, eps: float, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float, counters=None
):
    """One Block site: (its input collapse_norm(streams, prev, weight, eps) [..., D], its mixes m
    [..., (2+HC)·HC]); prev: the previous site's m (or any [..., >= HC] array whose first HC columns
    are the pre). On a GPU: fp32_gemv and hc_mix, two launches; one hc_site launch where a launch
    may finish itself (kernels/grid_finish.py), given the site's ``counters`` (held_counters)."""
    hc, dim = _check_site(streams, fn, base, scale, iters)
    _check_collapse(streams, prev, weight, "hc site")
    if backend() == "cpu":
        x = collapse_norm_reference(streams, prev[..., :hc], weight, eps)
        pre, post, comb = mixes_reference(streams, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
        return x, mx.concatenate([pre, post, comb.reshape(*comb.shape[:-2], hc * hc)], axis=-1)
    one_launch = counters is not None and grid_finish.merges(backend())
    if one_launch and fp32_linear.takes_kernel(_rows(streams.shape[:-2]), fn):
        _, out, x = SITE(**site_args(streams, fn, base, scale, prev, weight, counters, iters, hc_eps, norm_eps, eps))
        return x, out
    mm = fp32_linear.linear(streams.reshape(*streams.shape[:-2], hc * dim), fn)  # fp32 (docs/numerics.md#fp32-linears)
    out, x = MIX(**mix_args(mm, streams, base, scale, prev, weight, iters, hc_eps, norm_eps, eps))
    return x, out


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
    lead, hc, dim = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    if pre.shape[:-1] != lead or pre.shape[-1] < hc or weight.shape != (dim,):
        raise ValueError(
            f"{what}: pre {(*lead, hc)} (or wider) and weight [{dim}] expected, got {pre.shape}, {weight.shape}"
        )


def collapse_norm(streams, pre, weight, eps: float) -> mx.array:
    """rms_norm(collapse(streams, pre), weight) in the stream dtype: [..., HC, D] -> [..., D] (pre:
    the first HC columns of [..., >= HC])."""
    hc, _ = _check_streams(streams, "hc collapse_norm")
    _check_collapse(streams, pre, weight, "hc collapse_norm")
    if backend() == "cpu":
        return collapse_norm_reference(streams, pre[..., :hc], weight, eps)
    return COLLAPSE_NORM(**collapse_norm_args(streams, pre, weight, eps))[0]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """The model's RMSNorm of x [..., D] (docs/numerics.md#dtypes: fp32 math, rounded once to
    x.dtype). On a GPU it is hc_collapse_norm over one stream of weight 1 (that collapse is exact):
    one launch, where mx.fast.rms_norm needs a cast on each side to compute in fp32. x is that one
    stream as it is ([..., D] read as [..., 1, D]: no reshape)."""
    if backend() == "cpu":
        return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)
    if x.ndim < 2 or x.dtype not in _FLOAT_DTYPES or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: x float [..., D] and weight [D] expected, got {x.dtype} {x.shape}, {weight.shape}")
    one = graph_constants.full((*x.shape[:-1], 1), 1.0, mx.float32)
    return COLLAPSE_NORM(**collapse_norm_args(x, one, weight, eps, hc=1))[0]


def _check_expand(y, residual, m) -> int:
    hc, dim = _check_streams(residual, "hc expand")
    lead = residual.shape[:-2]
    if y.shape != (*lead, dim) or m.shape != (*lead, (2 + hc) * hc):
        raise ValueError(
            f"hc expand: y {(*lead, dim)} and mixes {(*lead, (2 + hc) * hc)} expected, got {y.shape}, {m.shape}"
        )
    return hc


def expand(y, residual, m) -> mx.array:
    """new_j = post[j]·y + Σ_i comb[i, j]·old_i in fp32, cast to the stream dtype (post, comb: the
    parts of a site's mixes m)."""
    hc = _check_expand(y, residual, m)
    if backend() == "cpu":
        _, post, comb = split(m, hc)
        return expand_reference(y, residual, post, comb)
    return EXPAND(**expand_args(y, residual, m))[0]


def expand_site(
    y,
    residual,
    m,
    prev,
    weight,
    eps: float,
    fn,
    base,
    scale,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    counters=None,
):
    """An expand and the next site: (streams = expand(y, residual, m), then that site's input and
    mixes as `site` gives them for streams). One hc_expand_site launch where a launch may finish
    itself and the site's fp32_gemv takes its rows, given the site's ``counters``; else `expand`,
    then `site` (the same bytes)."""
    if counters is not None and backend() != "cpu" and grid_finish.merges(backend()):
        hc, dim = _check_site(residual, fn, base, scale, iters)
        if dim % 8 == 0 and fp32_linear.takes_kernel(_rows(residual.shape[:-2]), fn):
            _check_expand(y, residual, m)
            _check_collapse(residual, prev, weight, "hc site")
            site_rest = (fn, base, scale, prev, weight, counters, iters, hc_eps, norm_eps, eps)
            call = expand_site_args(y, residual, m, *site_rest)
            if call is not None:
                _, out, x, streams, _ = EXPAND_SITE(**call)
                return streams, x, out
    streams = expand(y, residual, m)
    x, out = site(
        streams, prev, weight, eps, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, counters=counters
    )
    return streams, x, out


# ------------------------------------------------------------------------------- launch kwargs


def _out_shape(lead, width: int, guard: int) -> tuple:
    """An output [*lead, width], or [rows + guard, width] with ``guard`` rows past the end (tests)."""
    return (*lead, width) if not guard else (_rows(lead) + guard, width)


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
    """hc_mix call kwargs: one threadgroup per token of streams [..., HC, D] (pre: [..., >= HC])."""
    *lead, hc, dim = streams.shape
    return dict(
        inputs=[mm, streams, *_mix_params(base, scale, pre), weight],
        **_mix_outputs(streams, guard),
        grid=(_MIX_THREADS * _rows(lead), 1, 1),
        threadgroup=(_MIX_THREADS, 1, 1),
        template=_mix_template(streams, iters, hc_eps, norm_eps, eps, _MIX_THREADS),
        init_value=init_value,
    )


def site_args(
    streams,
    fn,
    base,
    scale,
    pre,
    weight,
    counters,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    eps: float,
    init_value=None,
    guard: int = 0,
) -> dict:
    """hc_site call kwargs: fp32_gemv's launch over the tokens of streams [..., HC, D] (read in place
    as [T, HC·D]) against fn, finished by hc_mix's work for each token; outputs mm (fp32_gemv's), then
    hc_mix's two. counters: uint32 [>= 1] zeros (held_counters)."""
    *lead, hc, _ = streams.shape
    grid_finish.check_counters(counters, 1, "hc site")
    launch = fp32_linear.gemv_launch(_rows(lead), fn)
    outputs = _mix_outputs(streams, guard)  # after fp32_gemv's mm
    return dict(
        inputs=[streams, fn, *_mix_params(base, scale, pre), weight, counters],
        output_shapes=[_out_shape(lead, (2 + hc) * hc, guard), *outputs["output_shapes"]],
        output_dtypes=[mx.float32, *outputs["output_dtypes"]],
        grid=launch["grid"],
        threadgroup=launch["threadgroup"],
        template=launch["template"] + _mix_template(streams, iters, hc_eps, norm_eps, eps, fp32_linear.THREADS),
        init_value=init_value,
    )


def expand_site_args(y, residual, m, *site, init_value=None, guard: int = 0) -> dict | None:
    """hc_expand_site call kwargs: hc_site's launch whose streams are expand(y, residual, m) (y [..., D],
    residual [..., HC, D], m the expanding site's mixes [..., (2+HC)·HC]; `site`: site_args'
    arguments after the streams, fn .. eps), a threadgroup per (part of K, 8 outputs); outputs
    hc_site's three, the streams [..., HC, D] (or [rows + guard, HC, D]) and the scratch (the part
    sums, the site's sums of squares by summing thread, the rounded collapse). None
    where its threadgroup memory would not hold a part's streams, or fn's outputs are not split
    (fp32_gemv's SPLIT 1: the launch is built on the split)."""
    args = site_args(residual, *site, init_value=init_value, guard=guard)
    template = dict(args["template"])
    *lead, hc, dim = residual.shape
    rows, outputs, split = _rows(lead), site[0].shape[0], template["SPLIT"]
    cap = -(-(hc * dim // 8) // split)
    if split == 1 or rows * cap * 8 * residual.dtype.size > _EXPAND_SITE_PART_BYTES:
        return None
    args["inputs"][:1] = [y, residual, m.astype(mx.float32)]
    streams = tuple(residual.shape) if not guard else (rows + guard, hc, dim)
    # the part sums, the summing threads' chains (z², x²) and the rounded collapse (hc_expand_site.metal)
    args["output_shapes"] += [streams, (rows * (outputs * split + 2 * _MIX_ORDER + dim),)]
    args["output_dtypes"] += [residual.dtype, mx.float32]
    warps = fp32_linear.THREADS // 32  # a threadgroup's outputs, one a SIMD group
    args["grid"] = (fp32_linear.THREADS * split * -(-outputs // warps), 1, 1)
    args["template"] += [("CAP", cap)]
    return args


def _mix_params(base, scale, pre) -> list:
    """hc_mix's fp32 parameters as its launches take them (hc_mix, hc_site, hc_expand_site)."""
    return [base.astype(mx.float32), scale.astype(mx.float32), pre.astype(mx.float32)]


def _mix_outputs(streams, guard: int) -> dict:
    """hc_mix's outputs for streams [..., HC, D]: the mixes [..., (2+HC)·HC] fp32 and x [..., D]."""
    *lead, hc, dim = streams.shape
    return dict(
        output_shapes=[_out_shape(lead, (2 + hc) * hc, guard), _out_shape(lead, dim, guard)],
        output_dtypes=[mx.float32, streams.dtype],
    )


def _mix_template(streams, iters: int, hc_eps: float, norm_eps: float, eps: float, threads: int) -> list:
    return [
        ("T", streams.dtype),
        ("HC", streams.shape[-2]),
        ("ITERS", int(iters)),
        ("HC_EPS_BITS", float_bits(hc_eps)),
        ("NORM_EPS_BITS", float_bits(norm_eps)),
        ("EPS_BITS", float_bits(eps)),
        ("THREADS", threads),
        ("ORDER", _MIX_ORDER),
    ]


def collapse_norm_args(streams, pre, weight, eps: float, init_value=None, guard: int = 0, hc=None) -> dict:
    """hc_collapse_norm call kwargs for streams [..., HC, D] (hc=1: x [..., D] as one stream)."""
    if hc is None:
        *lead, hc, dim = streams.shape
    else:
        *lead, dim = streams.shape
    return dict(
        inputs=[streams, pre.astype(mx.float32), weight],
        output_shapes=[_out_shape(lead, dim, guard)],
        output_dtypes=[streams.dtype],
        grid=(_THREADS * _rows(lead), 1, 1),
        threadgroup=(_THREADS, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("EPS_BITS", float_bits(eps))],
        init_value=init_value,
    )


def expand_args(y, residual, m, init_value=None, guard: int = 0) -> dict:
    """hc_expand call kwargs: residual [..., HC, D], y [..., D], the site's mixes m [..., (2+HC)·HC]."""
    *lead, hc, dim = residual.shape
    shape = tuple(residual.shape) if not guard else (_rows(lead) + guard, hc, dim)
    return dict(
        inputs=[y, residual, m.astype(mx.float32)],
        output_shapes=[shape],
        output_dtypes=[residual.dtype],
        grid=(-(-dim // _THREADS) * _THREADS, _rows(lead), 1),
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
    prev, w = mx.ones((T, mix)), mx.ones((dim,))
    s2 = mx.zeros((1, T, 2, dim), mx.float32)
    return [
        mix_args(mx.zeros((T, mix)), s, mx.zeros((mix,)), mx.ones((3,)), prev, w, 20, 1e-6, 1e-20, 1e-20),
        mix_args(mx.zeros((1, T, 8)), s2, mx.zeros((8,)), mx.ones((3,)), mx.ones((1, T, 2)), w, 3, 1e-6, 1e-20, 1e-6),
    ]


def _example_site():
    s = _example_streams()
    T, hc, dim = s.shape
    mix = (2 + hc) * hc
    fn = mx.random.normal((mix, hc * dim), key=mx.random.key(3))
    prev, w, counters = mx.ones((T, mix)), mx.ones((dim,)), grid_finish.split_counters(1)
    return [
        site_args(s, fn, mx.zeros((mix,)), mx.ones((3,)), prev, w, counters, 20, 1e-6, 1e-20, 1e-20),
        site_args(
            s[:1].astype(mx.float32), fn, mx.zeros((mix,)), mx.ones((3,)), prev[:1], w, counters, 3, 1e-6, 1e-20, 1e-6
        ),
    ]


def _example_expand_site():
    s = _example_streams()
    T, hc, dim = s.shape
    mix = (2 + hc) * hc
    fn = mx.random.normal((mix, hc * dim), key=mx.random.key(3))
    m, w, counters = mx.ones((T, mix)), mx.ones((dim,)), grid_finish.split_counters(1)
    y = mx.zeros((T, dim), mx.bfloat16)
    return [
        expand_site_args(y, s, m, fn, mx.zeros((mix,)), mx.ones((3,)), m, w, counters, 20, 1e-6, 1e-20, 1e-20),
        expand_site_args(
            y[:1].astype(mx.float32),
            s[:1].astype(mx.float32),
            m[:1],
            fn,
            mx.zeros((mix,)),
            mx.ones((3,)),
            m[:1],
            w,
            counters,
            3,
            1e-6,
            1e-20,
            1e-6,
        ),
    ]


def _example_collapse_norm():
    s = _example_streams()
    T, hc, dim = s.shape
    return [
        collapse_norm_args(s, mx.ones((T, (2 + hc) * hc)), mx.ones((dim,), mx.bfloat16), 1e-20),
        collapse_norm_args(s.astype(mx.float32), mx.ones((T, hc)), mx.ones((dim,)), 1e-6),
        collapse_norm_args(s[:, 0], mx.ones((T, 1)), mx.ones((dim,)), 1e-20, hc=1),  # rms_norm
    ]


def _example_expand():
    s = _example_streams()
    T, hc, dim = s.shape
    m = mx.ones((T, (2 + hc) * hc))
    return [
        expand_args(mx.zeros((T, dim), mx.bfloat16), s, m),
        expand_args(mx.zeros((1, T, dim), mx.float32), s.astype(mx.float32)[None], m[None]),
    ]
