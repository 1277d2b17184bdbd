"""EXL3 ops: reconstruct, linear, routed experts and grouped linears, each on the GPU kernels
(mlx_dsv41.kernels.exl3 launches them) or in plain MLX; this module chooses which for a call.

    reconstruct(trellis, codebook) -> W̃ (k, n) fp16, bit-exact           (docs/exl3.md#trellis)
    linear(x [m, in], trellis, suh, svh, codebook, bias) -> [m, out]    (docs/exl3.md#forward)
    experts(x [T, D], indices [T, k], weights [T, k], w1, w3, w2, ...) -> [T, k, D] float32

On the CPU every op runs the plain-MLX reference (mlx_dsv41.exl3.reference). On a GPU:
- ``reconstruct``: exl3_reconstruct;
- ``linear`` with m <= GEMV_MAX_ROWS (8) rows: exl3_gemv (+ exl3_gemv_out for narrow outputs).
  With more rows: reconstruct, then the exact product with fp32 sums between the two transforms
  (exl3_rows_in, exl3_rows_out: ``transformed_product``): f16_gemm on CUDA (tensor cores), MLX's
  fp32 matmul elsewhere (exllamav3 runs an fp16 GEMM there, rounding the product to fp16);
- ``experts`` for at most FUSED_MAX_TOKENS tokens: the fused expert kernels, whose bytes for a
  slot never depend on the rest of the call (the k splits come from the weight shapes); for more
  tokens (prefill) ``experts_sorted``: the slots sorted by expert on the host, the routed
  experts' W̃ decoded once per call in batches, the product on f16_gemm (CUDA) or one fp32 GEMM
  per routed expert and projection, between the transform kernels, which read the slots' tokens
  and write their outputs in place
  (docs/exl3.md#many-token-experts). The path is chosen from the token count, which the
  expert-parallel slot split shares with one process.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.exl3 import reference
from mlx_dsv41.exl3.hadamard import BLOCK
from mlx_dsv41.exl3.stored import check_linear
from mlx_dsv41.exl3.trellis import check_trellis
from mlx_dsv41.kernels import backend, f16_gemm
from mlx_dsv41.kernels import exl3 as launch
from mlx_dsv41.kernels.exl3 import GEMV_MAX_ROWS
from mlx_dsv41.kernels.hyper_connections import rms_norm
from mlx_dsv41.quant.experts import check_routing, combine_moe, swiglu

FUSED_MAX_TOKENS = 10  # tokens served by the fused expert kernels (60 slots at Flash top-6)
_X_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _check_linear_args(x, trellis, suh, svh, codebook, bias) -> int:
    """The weight's padded output count n, once the call's arguments are checked."""
    k, n, *_ = check_linear(trellis, suh, svh, codebook)
    if x.ndim < 2:
        raise ValueError(f"exl3 linear: x must be [..., in] with rows, got shape {x.shape}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"exl3 linear: x must be float32, float16 or bfloat16, got {x.dtype}")
    if not k - BLOCK < x.shape[-1] <= k:
        raise ValueError(f"exl3 linear: x has {x.shape[-1]} features, the weight is padded to {k}")
    if bias is not None and (bias.ndim != 1 or not n - BLOCK < bias.shape[0] <= n):
        raise ValueError(f"exl3 linear: bias {bias.shape} does not match {n} (padded) outputs")
    return n


# ----------------------------------------------------------------------------------------- ops


def reconstruct(trellis: mx.array, codebook: str) -> mx.array:
    """W̃ (k, n) fp16, bit-exact (docs/exl3.md#trellis)."""
    check_trellis(trellis, codebook, BLOCK)
    if backend() == "cpu":
        return reference.reconstruct(trellis, codebook)
    return launch.RECONSTRUCT(**launch.reconstruct_args(trellis, codebook))[0]


def linear(
    x, trellis, suh, svh, codebook: str, bias=None, out_features=None, out_dtype=None, owner=None, out_shape=None
):
    """y [..., out_features] = x [..., in] · W (+ bias) in ``out_dtype`` (default x.dtype), rows in
    order; in ``out_shape`` where given (as many values: e.g. the heads [..., H, out / H]). ``owner``
    (the module holding the trellis) keeps the CPU path's decoded W̃ for the next call. A GPU decode
    step's rows go to the kernels as they are and the kernel writes y in its shape (a reshape is a
    graph node)."""
    y = _linear(x, trellis, suh, svh, codebook, bias, out_features, out_dtype, owner, out_shape)
    return y if out_shape is None or y.shape == tuple(out_shape) else y.reshape(out_shape)


def _linear(x, trellis, suh, svh, codebook: str, bias, out_features, out_dtype, owner, out_shape):
    n = _check_linear_args(x, trellis, suh, svh, codebook, bias)
    out_features = n if out_features is None else out_features
    if out_dtype is not None and out_dtype not in _X_DTYPES:
        raise ValueError(f"exl3 linear: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    lead, m = x.shape[:-1], math.prod(x.shape[:-1])
    if m == 0:
        return mx.zeros((*lead, out_features), out_dtype or x.dtype)
    if backend() == "cpu":
        if owner is None:
            w = cpu_weight(trellis, codebook)
        else:
            w, suh, svh = _held_linear(owner, trellis, suh, svh, codebook)
        y = reference.linear(x.reshape(m, -1), trellis, suh, svh, codebook, bias, out_features, out_dtype, w)
        return y.reshape(*lead, out_features)
    out_dtype = out_dtype or x.dtype
    if bias is not None and bias.shape[0] != n:  # the kernels read a bias as long as the padded outputs
        bias = reference.pad_features(bias[None], n)[0]
    if m <= GEMV_MAX_ROWS:
        if out_features != n:
            out_shape = None  # the padded outputs are sliced off first
        y = launch.run_gemv(
            x, trellis, suh, svh, codebook, bias, out_dtype, _split_counters(owner, n // BLOCK), out_shape
        )
        return y if out_features == n else y[..., :out_features]
    # Prefill: W̃ once per call, then the exact product with fp32 sums between the two transforms
    # (docs/exl3.md#many-row-gemm): an fp16 GEMM would round its sums to fp16 before the output
    # transform (a second rounding; issue 15).
    w = reconstruct(trellis, codebook)
    zeros = graph_constants.full((m,), 0, mx.int32)  # every row through the one suh / svh
    y = transformed_product(
        x.reshape(m, -1), suh[None], svh[None], zeros, product_by_span(w[None], None), out_dtype, bias=bias
    )
    return (y if out_features == n else y[:, :out_features]).reshape(*lead, out_features)


def normed_linear(x, trellis, suh, svh, codebook: str, weight, eps: float, bias=None, out_features=None, owner=None):
    """rms_norm(linear(x), weight, eps) (docs/numerics.md#dtypes) from one exl3_gemv launch (NORM,
    docs/design.md#normed-linear) where one gives it here: a GPU, x's rows in one gemv, no padded
    outputs and a launch plan that splits k and finishes itself; None otherwise (the caller norms
    linear(x)). The bytes of the linear then kernels.hyper_connections.rms_norm."""
    n = _check_linear_args(x, trellis, suh, svh, codebook, bias)
    if backend() == "cpu" or (out_features or n) != n or not launch.normed_gemv_fits(x, trellis):
        return None
    if weight.shape != (n,):
        raise ValueError(f"exl3 normed linear: the norm's weight must be [{n}], got {weight.shape}")
    counters = _split_counters(owner, n // BLOCK + 1)  # NORM's count past the column blocks'
    return launch.run_gemv(x, trellis, suh, svh, codebook, bias, x.dtype, counters, norm=(weight, eps))


def roped_linear(x, trellis, suh, svh, codebook: str, rope, bias=None, out_features=None, out_shape=None):
    """linear(x) (in out_shape where given) turned by rope (a kernels.rope.Turn) from one exl3_gemv
    launch (ROPE, docs/design.md#roped-linears) where one gives it here: a GPU, x's rows in one
    gemv, a launch plan that does not split k, no padded outputs; None otherwise (the caller turns
    linear(x)). The bytes of the linear then the rope kernel."""
    n = _check_linear_args(x, trellis, suh, svh, codebook, bias)
    if backend() == "cpu" or (out_features or n) != n or not launch.roped_gemv_fits(x, trellis, rope.periods, x.dtype):
        return None
    return launch.run_gemv(x, trellis, suh, svh, codebook, bias, x.dtype, out_shape=out_shape, rope=rope)


def paired_linear(x, first: tuple, second: tuple, norm=None, owner=None, window=None, out_dtype=None):
    """(first's y, second's y) for two linears of x, first / second = (trellis, suh, svh, codebook,
    bias, out_features), from one exl3_gemv launch (PAIR, docs/design.md#paired-linears) where one
    gives them here; with norm = (weight, eps) the first's y is rms_norm(y) (NORM). With window (a
    kernels.rope.WindowWrite), (first's y, the window ring with second's rows written as the window
    keys: RING, docs/design.md#roped-linears), where the launch can write them. None otherwise (the
    caller runs the linears apart). The bytes of the two launches (and of the norm, the rope). The
    outputs in `out_dtype` (default x.dtype; the kernel widens x to fp32 itself, so fp32 outputs of
    bf16 x are those of its fp32 copy)."""
    ns = [_check_linear_args(x, *f[:5]) for f in (first, second)]
    gemv = [f[:5] for f in (first, second)]
    if backend() == "cpu" or any((f[5] or n) != n for f, n in zip((first, second), ns)):
        return None
    if not launch.paired_gemv_fits(x, *gemv) or (window is not None and not launch.window_gemv_fits(x, *gemv, window)):
        return None
    if norm is not None and norm[0].shape != (ns[0],):
        raise ValueError(f"exl3 paired linear: the norm's weight must be [{ns[0]}], got {norm[0].shape}")
    in_launch = norm if norm is not None and launch.normed_gemv_fits(x, first[0]) else None
    counters = _split_counters(owner, (ns[0] + ns[1]) // BLOCK + (in_launch is not None) + (window is not None), "pair")
    y, y2 = launch.run_gemv_pair(x, first[:4], second[:4], out_dtype or x.dtype, counters, in_launch, window)
    return (y if norm is None or in_launch is not None else rms_norm(y, *norm)), y2


def _split_counters(owner, size: int, name: str = ""):
    """`size` exl3_gemv FINISH counters of the linear `owner` (made once per (name, size), kept on
    it; fresh for a call without an owner): scratch that every launch leaves at 0
    (kernels.exl3.gemv_args)."""
    return launch.split_counters(size) if owner is None else launch.held_counters(owner, size, name)


def _check_experts_args(x, indices, weights, w1, any_lead: bool = False):
    """check_routing's checks and x's dtype; `any_lead`: x's T rows under any leading dims (ops.moe)."""
    if (x.ndim != 2 and not (any_lead and x.ndim > 2)) or x.shape[-1] != w1.in_features or x.dtype not in _X_DTYPES:
        raise ValueError(f"exl3 experts: x must be float [T, {w1.in_features}], got {x.dtype} {x.shape}")
    check_routing(x, indices, weights, w1.in_features, any_lead)


def experts(x, indices, weights, w1, w3, w2, expert_range, limit: float):
    """Per-slot outputs [T, k, D] float32 (see mlx_dsv41.exl3.experts.EXL3Experts)."""
    _check_experts_args(x, indices, weights, w1)
    if indices.size == 0:
        return mx.zeros((*indices.shape, w2.out_features), mx.float32)
    if backend() == "cpu":
        tildes = [_stacked_weight(p) for p in (w1, w3, w2)]
        if all(t is not None for t in tildes):
            return reference.experts_gathered(x, indices, weights, w1, w3, w2, expert_range, limit, tildes)
    if backend() == "cpu" or x.shape[0] > FUSED_MAX_TOKENS:
        return experts_sorted(x, indices, weights, w1, w3, w2, expert_range, limit)
    return launch.run_experts(x, indices, weights, w1, w3, w2, expert_range[0], limit)


# fp16 W̃ bytes of one projection's experts decoded at once by ``experts_sorted`` (Flash's
# 5120 x 2304 experts: 45 per batch; off CUDA one expert at a time is widened to fp32 besides).
EXPERT_GEMM_BYTES = 1 << 30


def experts_sorted(x, indices, weights, w1, w3, w2, expert_range, limit):
    """Per-slot outputs [T, k, D] float32 for many tokens (docs/exl3.md#many-token-experts): one
    host read of the routing; the held slots sorted by expert; for each batch of routed experts
    (at most EXPERT_GEMM_BYTES of fp16 W̃ per projection) their W̃ decoded once and the product of
    each expert's consecutive sorted slots with its W̃ (``product_by_span``: one f16_gemm launch per
    projection and batch on CUDA); experts without slots are never decoded.
    Slots routed outside ``expert_range`` are exactly 0."""
    T, top_k = indices.shape
    lo, hi = expert_range
    local = np.array(indices).reshape(-1).astype(np.int64) - lo
    held = np.nonzero((local >= 0) & (local < hi - lo))[0]
    if held.size == 0:
        return mx.zeros((T, top_k, w2.out_features), mx.float32)
    order = held[np.argsort(local[held], kind="stable")]
    experts = local[order]
    members, counts = np.unique(experts, return_counts=True)
    slots = mx.array(order.astype(np.int32))
    slot_weights = weights.reshape(-1)[slots]
    per_batch = max(1, EXPERT_GEMM_BYTES // (2 * max(p.k * p.n for p in (w1, w3, w2))))
    batches, start = [], 0  # (experts, spans from the batch's first slot, first slot, slot count)
    for b in range(0, len(members), per_batch):
        batch, n = members[b : b + per_batch], int(counts[b : b + per_batch].sum())
        ends = np.cumsum(counts[b : b + per_batch]).tolist()
        batches.append((batch, list(zip([0, *ends[:-1]], ends)), start, n))
        start += n
    if backend() != "cpu":
        return _experts_sorted_on_gpu(
            x, slots, order // top_k, experts, slot_weights, (w1, w3, w2), batches, limit, T * top_k
        ).reshape(T, top_k, -1)
    out = mx.zeros((T * top_k, w2.out_features), mx.float32)
    rows = x[mx.array((order // top_k).astype(np.int32))]
    ys = []
    for batch, spans, start, n in batches:
        tildes = [decoded_stack(p, batch) for p in (w1, w3, w2)]
        ys.append(
            reference.slot_experts(
                rows[start : start + n],
                slot_weights[start : start + n],
                mx.array(experts[start : start + n].astype(np.int32)),
                (w1, w3, w2),
                tildes,
                limit,
                lambda xh, w, spans=spans: product_by_span(w, spans)(xh),
            )
        )
    out[slots] = ys[0] if len(ys) == 1 else mx.concatenate(ys)
    return out.reshape(T, top_k, -1)


def _experts_sorted_on_gpu(x, slots, tokens, experts, slot_weights, projections, batches, limit, n_slots):
    """experts_sorted's GPU side (docs/exl3.md#many-row-transforms): each projection as
    exl3_rows_in, the product of every batch, exl3_rows_out; w1's and w3's rows read x's tokens in
    place, w2's outputs land on their slots (the rest 0), bf16-valued float32 -> [n_slots, D]."""
    w1, w3, w2 = projections
    e = mx.array(experts.astype(np.int32))

    def product(p):
        def by_batch(xh):
            parts = [product_by_span(decoded_stack(p, b), spans)(xh[a : a + n]) for b, spans, a, n in batches]
            return parts[0] if len(parts) == 1 else mx.concatenate(parts)

        return by_batch

    src = mx.array(tokens.astype(np.int32))
    g, u = (
        transformed_product(x, p.suh, p.svh, e, product(p), mx.bfloat16, src=src)[:, : p.out_features] for p in (w1, w3)
    )
    h = swiglu(g, u, limit, slot_weights.reshape(-1, 1).astype(mx.float32))
    y = transformed_product(h, w2.suh, w2.svh, e, product(w2), mx.float32, dst=slots, out_rows=n_slots, round_bf16=True)
    return y[:, : w2.out_features]


def transformed_product(
    x, suh, svh, e, product, out_dtype, src=None, dst=None, out_rows=None, bias=None, round_bf16=False
):
    """A many-row EXL3 linear on the GPU kernels (docs/exl3.md#many-row-transforms): row r is
    x[src[r]] through suh[e[r]] (exl3_rows_in, fp16 xh [R, k]), ``product(xh)`` (float32 [R, n]),
    then svh[e[r]] (+ bias) into row dst[r] of y [out_rows, n] in out_dtype (exl3_rows_out; rows
    that no r names are 0). src and dst default to r, out_rows to R."""
    rows = x.shape[0] if src is None else src.size
    xh = launch.ROWS_IN(**launch.rows_in_args(x, graph_constants.arange(rows) if src is None else src, e, suh))[0]
    out_rows = rows if out_rows is None else out_rows
    dst = graph_constants.arange(rows) if dst is None else dst
    init = 0 if out_rows != rows else None
    return launch.ROWS_OUT(
        **launch.rows_out_args(product(xh), e, dst, svh, bias, out_rows, out_dtype, round_bf16, init_value=init)
    )[0]


def product_by_span(w, spans):
    """xh [S, k] fp16 -> float32 [S, n]: the rows of span j (consecutive; None: one span of every
    row) times w[j] (fp16 [G, k, n]), exact products and fp32 sums: f16_gemm on CUDA (one launch),
    otherwise an fp32 matmul per span (docs/exl3.md#many-row-gemm)."""
    if f16_gemm.takes_kernel(w.shape[1], w.shape[2]):
        return lambda xh: f16_gemm.gemm(xh, w, spans)

    def by_span(xh):
        xh = xh.astype(mx.float32)
        if spans is None:
            return xh @ w[0].astype(mx.float32)
        parts = [xh[a:b] @ w[j].astype(mx.float32) for j, (a, b) in enumerate(spans)]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    return by_span


def decoded_stack(proj, experts) -> mx.array:
    """fp16 [len(experts), k, n]: W̃ of the local ``experts`` (ascending) of an
    EXL3ExpertProjection, one ``reconstruct`` per (K, codebook) group: a group's trellises
    [G, k/16, n/16, 16K] read as one (G·k) x n trellis, since every 16 x 16 tile decodes from its
    own words alone (docs/exl3.md#trellis)."""
    wanted = set(int(e) for e in experts)
    parts, got = [], []
    for group in proj.groups:
        pos = [j for j, e in enumerate(group.experts) if e in wanted]
        if not pos:
            continue
        t = group.trellis if len(pos) == len(group.experts) else group.trellis[mx.array(pos, mx.int32)]
        w = reconstruct(t.reshape(-1, *t.shape[2:]), group.codebook)
        parts.append(w.reshape(len(pos), proj.k, proj.n))
        got += [group.experts[j] for j in pos]
    stack = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    if got != sorted(got):
        stack = stack[mx.array(np.argsort(got).astype(np.int32))]
    return stack


def swiglu_mlp(x, w1, w3, w2, limit: float, routed=None) -> mx.array:
    """w2(bf16(silu(min(g, L)) · clamp(u, -L, L))), g = w1(x), u = w3(x), for EXL3Linear w1, w3, w2:
    the shared expert (docs/model.md#moe, weight 1) -> [T, out] in x.dtype; with ``routed`` (the
    routed slots [T, k, out] fp32), the MoE's output instead (quant.combine_moe's arithmetic). On a
    GPU, up to FUSED_MAX_TOKENS tokens run the fused expert kernels as one expert of weight 1 (w1
    and w3 in one launch, the SwiGLU and w2's input transform in another, the combine with the
    routed slots in the last: 4 launches instead of 7 or 8, the same roundings); otherwise, and on
    the CPU, the three linears."""
    T = x.shape[0]
    if backend() == "cpu" or not 0 < T <= FUSED_MAX_TOKENS:
        return combine_moe(routed, w2(swiglu(w1(x), w3(x), limit, dtype=x.dtype)))
    projections = [lin.as_single_expert() for lin in (w1, w3, w2)]
    one_slot = graph_constants.full((T, 1), 0, mx.int32), graph_constants.full((T, 1), 1.0, mx.float32)
    if routed is not None and w2.out_features == projections[2].n and x.dtype in (mx.bfloat16, mx.float32):
        return launch.run_experts(x, *one_slot, *projections, 0, limit, add=routed)
    y = launch.run_experts(x, *one_slot, *projections, 0, limit)
    return combine_moe(routed, y[:, 0].astype(x.dtype))


def shared_fits(experts, w1, w3, w2, limit: float, tokens: int, dtype) -> bool:
    """Whether the shared expert (EXL3Linear w1, w3, w2 with SwiGLU limit ``limit``) rides in the
    routed experts' launches here (launch.run_moe): a GPU whose expert launches finish
    themselves (and Tuning.shared_in_routed), up to FUSED_MAX_TOKENS tokens, the routed
    experts' shapes and limit, and an output of whole 128-column blocks in bf16 or fp32 (as the
    shared expert's own ADD finish needs)."""
    from mlx_dsv41.exl3.experts import EXL3Experts
    from mlx_dsv41.exl3.linear import EXL3Linear

    if backend() == "cpu" or not 0 < tokens <= FUSED_MAX_TOKENS or not launch.expert_finish():
        return False
    if not launch.TUNING.shared_in_routed:
        return False
    if not isinstance(experts, EXL3Experts) or not all(isinstance(w, EXL3Linear) for w in (w1, w3, w2)):
        return False

    def shape(p):
        return p.k, p.n, p.in_features, p.out_features

    return (
        [shape(w.as_single_expert()) for w in (w1, w3, w2)] == [shape(p) for p in (experts.w1, experts.w3, experts.w2)]
        and float(limit) == experts.swiglu_limit
        and experts.w2.out_features == experts.w2.n
        and dtype in (mx.bfloat16, mx.float32)
    )


def moe(x, indices, weights, experts, w1, w3, w2) -> mx.array:
    """The MoE's output in x's shape and dtype: x [..., D] the tokens' rows as the model holds them
    (e.g. [B, S, D]; the kernels read and write them in order, no reshape node either way), indices
    and weights [T, k]; the routed experts (EXL3Experts) and the shared expert (w1, w3, w2) in one
    set of launches, where `shared_fits` (the caller checks)."""
    _check_experts_args(x, indices, weights, experts.w1, any_lead=True)
    shared = tuple(w.as_single_expert() for w in (w1, w3, w2))
    return launch.run_moe(
        x, indices, weights, experts.w1, experts.w3, experts.w2, experts.expert_range[0], experts.swiglu_limit, shared
    )


def grouped(x, proj) -> mx.array:
    """A grouped linear whose group g is expert g of `proj` (an EXL3ExpertProjection over the groups'
    linears, e.g. `wo_a`'s slices): x [..., G, in] -> [..., G, out] in x.dtype, each group's output
    rounded as its own linear rounds it. On a GPU, up to FUSED_MAX_TOKENS tokens: exl3_expert_down
    (one launch per (K, codebook) group, each forming its groups' xh from x) and
    exl3_expert_down_finish (CUDA: the last launch finishing itself) for every group at once, x read
    as rows [tokens · G, in] (one reshape each way: each is a graph node of a decode step); more
    tokens: the groups' W̃ decoded once and the product as for the sorted experts; on the CPU each
    group through the reference linear."""
    *lead, G, width = x.shape
    if G != proj.n_local or width != proj.in_features:
        raise ValueError(f"exl3 grouped: x must be [..., {proj.n_local}, {proj.in_features}], got {x.shape}")
    T = math.prod(lead)
    if backend() != "cpu" and 0 < T <= FUSED_MAX_TOKENS:
        return launch.run_grouped(x, proj)
    return _grouped_tokens(x.reshape(T, G, width), proj).reshape(*lead, G, proj.out_features)


def grouped_flat(x, proj, lead: int) -> mx.array:
    """`grouped` for x [*L, ...] whose dims after the first `lead` hold each token's G rows of `in`
    in order (the attention output [B, S, H, D]): [*L, G · out]. On a GPU, up to FUSED_MAX_TOKENS
    tokens, the launches read x and write the output in those shapes (no reshape either way);
    otherwise `grouped` of the rows reshaped."""
    dims, G, width = x.shape[:lead], proj.n_local, proj.in_features
    if math.prod(x.shape[lead:]) != G * width:
        raise ValueError(f"exl3 grouped: x must hold [..., {G}, {width}] after its first {lead} dims, got {x.shape}")
    if backend() != "cpu" and 0 < math.prod(dims) <= FUSED_MAX_TOKENS:
        return launch.run_grouped(x, proj, lead=tuple(dims))
    return grouped(x.reshape(*dims, G, width), proj).reshape(*dims, G * proj.out_features)


def _grouped_tokens(x, proj) -> mx.array:
    """`grouped` for x [T, G, in] on the CPU, or of no or many tokens on a GPU."""
    T, G, width = x.shape
    if backend() == "cpu":
        held = _held_groups(proj)
        return mx.stack(
            [
                reference.linear(
                    x[:, g],
                    *(proj.expert(g) if held is None else held[g][:4]),
                    out_features=proj.out_features,
                    w_tilde=None if held is None else held[g][4],
                )
                for g in range(G)
            ],
            axis=1,
        )
    if T == 0:
        return mx.zeros((0, G, proj.out_features), x.dtype)
    # Many tokens: the groups' W̃ decoded once and each group's T rows as one span of the product
    # (docs/exl3.md#many-token-experts), in place of decoding every group's tiles for every token.
    # Group-major rows, read from x and written back token-major in place by the transforms.
    spans = [(g * T, (g + 1) * T) for g in range(G)]
    product = product_by_span(decoded_stack(proj, range(G)), spans)
    rows = graph_constants.group_major(T, G)
    y = transformed_product(
        x.reshape(T * G, width), proj.suh, proj.svh, graph_constants.row_of(G * T, T), product, x.dtype, rows, rows
    )
    return y[:, : proj.out_features].reshape(T, G, proj.out_features)


# The CPU reference decodes W̃ (exact) for every call; a module keeps it, in float32, when it is at
# most this many weights (the tiny and demo models; a real checkpoint on a GPU never takes this path).
CPU_HELD_WEIGHTS = 1 << 24


def cpu_weight(trellis, codebook: str) -> mx.array:
    return reference.reconstruct(trellis, codebook).astype(mx.float32)


def _held(trellis) -> bool:
    return trellis.size // trellis.shape[-1] * 256 <= CPU_HELD_WEIGHTS  # k·n weights


def _held_weight(owner, key, trellis, codebook: str):
    """W̃ of ``trellis`` in float32, kept on ``owner`` (under an underscore name: not a parameter)."""
    if not _held(trellis):
        return cpu_weight(trellis, codebook)
    return graph_constants.held(owner, "_w_tilde", key, lambda: cpu_weight(trellis, codebook))


def _held_linear(owner, trellis, suh, svh, codebook: str):
    """(W̃, suh, svh) of an EXL3 linear for the CPU path: where W̃ is held (_held_weight), suh and
    svh are kept beside it widened to float32 (exact from fp16, the widening the transforms do), so
    no call casts them again."""
    w = _held_weight(owner, "linear", trellis, codebook)
    if not _held(trellis):
        return w, suh, svh
    widen = lambda: (suh.astype(mx.float32), svh.astype(mx.float32))  # noqa: E731
    return (w, *graph_constants.held(owner, "_w_tilde", "transforms", widen))


def _held_groups(proj):
    """Each group's (trellis, suh, svh, codebook, W̃) of an EXL3ExpertProjection held whole on the
    CPU (_stacked_weight), suh and svh in float32; None when not held. Sliced once, not at every
    call (each slice and cast is a graph node)."""
    stack = _stacked_weight(proj)
    if stack is None:
        return None

    def groups():
        return [
            (t, u.astype(mx.float32), v.astype(mx.float32), cb, stack[g])
            for g, (t, u, v, cb) in enumerate(proj.expert(g) for g in range(proj.n_local))
        ]

    return graph_constants.held(proj, "_w_tilde", "groups", groups)


def _stacked_weight(proj):
    """float32 [E, k, n]: every local expert's W̃ of an EXL3ExpertProjection, kept on it; None when
    over CPU_HELD_WEIGHTS (the caller then runs one expert at a time)."""
    if proj.n_local * proj.k * proj.n > CPU_HELD_WEIGHTS:
        return None

    def stack():
        return mx.stack([cpu_weight(t, cb) for t, _, _, cb in (proj.expert(e) for e in range(proj.n_local))])

    return graph_constants.held(proj, "_w_tilde", "stack", stack)


def hold_cpu_weights(root) -> None:
    """On the CPU, decode and keep now every W̃ (and what goes with it) the reference path keeps on
    first use, for each EXL3 layer under `root`: the holders evaluate what they make, so a compiled
    step's trace finds constants, and the decoding happens here rather than at its first step."""
    if backend() != "cpu":
        return
    from mlx_dsv41.exl3.experts import EXL3ExpertProjection  # they call this module
    from mlx_dsv41.exl3.linear import EXL3Linear

    for module in root.modules():
        if isinstance(module, EXL3Linear) and _held(module.trellis):
            _held_linear(module, module.trellis, module.suh, module.svh, module.codebook)
        elif isinstance(module, EXL3ExpertProjection):
            _held_groups(module)  # the stacked W̃ too
