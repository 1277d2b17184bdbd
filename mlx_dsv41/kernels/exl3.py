"""EXL3 kernel launches: the kernels, their launch shapes and the kwargs of each launch.

What each op computes, and which of these launches serves a call of a given shape (or the plain-MLX
reference on the CPU), is decided in mlx_dsv41.exl3.ops; this module only builds and launches:

- exl3_reconstruct: W̃ (k, n) fp16 from a trellis, one tile per SIMD group;
- exl3_gemv (+ exl3_gemv_out): y = x·W for up to GEMV_MAX_ROWS rows, decoding the trellis on the
  fly (mlx_dsv41/metal_ext/exl3_matmul.h: a threadgroup per 128 output columns and k range). A wide
  output (``dense_single_blocks`` or more 128-column blocks) is one launch that also applies the
  output transform; a narrow one splits k over enough threadgroups to fill the GPU
  (``dense_split_warps``) and exl3_gemv_out finishes it (two launches);
- the expert kernels (run_experts): exl3_expert_gate_up (k-split partials of w1 and w3 of each
  selected expert, k split to reach ``gate_up_split_warps``; one launch per (K, codebook) group
  present), one exl3_expert_swiglu (finishes g and u, the routed SwiGLU and w2's input transform:
  xh once per slot), exl3_expert_down (k-split partials of w2, k split to reach
  ``down_split_warps``; one launch per w2 group) and one exl3_expert_down_finish (the splits' sum
  and w2's output side); a grouped linear's groups run as experts through exl3_expert_down alone,
  each launch transforming its slots' inputs itself (run_grouped). Where the backend lets a
  launch's last threadgroup finish the others' work (CUDA), the last gate_up launch does the
  SwiGLU's work and the last down launch the finish's (``finish_splits``).
  Which group's launch writes which slot is the SlotStack rule, shared with exl3_experts.h.
Every path sums in fp32 and rounds once to the output dtype (xh is fp16 by the format). The k
splits come from the weight shapes only, so a slot's bytes never depend on the rest of the call.
Launch shapes come from ``TUNING`` (a Tuning); benchmarks/bench_exl3.py --sweep measures others.
Nothing here imports mlx_dsv41.exl3 at import time (the format package launches through this
module); the CI example launches build EXL3 weights with it when CI asks for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import Kernel, backend, float_bits, grid_finish, register, scalar_int32
from mlx_dsv41.kernels.grid_finish import held_counters, no_counters, split_counters
from mlx_dsv41.kernels.rope import Turn, WindowWrite

BLOCK = 128  # the kernels' column block: the format's Hadamard block (mlx_dsv41.exl3.hadamard.BLOCK)
GEMV_MAX_ROWS = 8  # rows served by exl3_gemv (the M template: 1, 2, 4 or 8)
_LANES = 32
_SMALL_WARPS = 4  # exl3_expert_swiglu / _down_finish: SIMD groups (one 128-block each) per threadgroup
_OUT_KIND = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}  # the kernels' OUT template value
_XS_WORDS = 4096  # largest xh staging (XSW template in exl3_matmul.h): 16 KiB
# Threadgroup memory the product kernels' trellis ring and xh staging may take, in words: what a
# kernel may declare statically (48 KiB on CUDA, 32 KiB on Metal) less 16 bytes for the rest (the
# FINISH flag word: grid_finish_arrival).
_SHARED_WORDS = {"cuda": 12288 - 4, "metal": 8192 - 4}
# The kernels' CB template value of each codebook (EXL3_CB_* of exl3_decode.h).
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}


class SlotStack(IntEnum):
    """Which launch writes a routed slot: the expert kernels read p1 / p3 / p2 [E] (local expert ->
    its position in this launch's (K, codebook) stack). A position >= 0 means this launch computes
    the slot; the negative values below mean it does not. The kernels get these as #defines
    (SLOT_DEFINES, used by exl3_experts.h), so the numbers are written only here."""

    OTHER_GROUP = -1  # the expert's projection is in another group: that group's launch writes it
    NOT_HELD = -2  # the expert is outside the held range: the slot is 0


SLOT_DEFINES = tuple((f"EXL3_SLOT_{s.name}", int(s)) for s in SlotStack)


def _k2(trellis) -> int:
    """2K of a trellis (k/16, n/16, 16K) int16, already checked by the caller (mlx_dsv41.exl3)."""
    return trellis.shape[-1] // 8


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of the EXL3 product kernels (exl3_gemv and the expert kernels).

    A threadgroup has ``warps`` SIMD groups in exl3_gemv, ``gate_up_warps`` in
    exl3_expert_gate_up and ``down_warps`` in exl3_expert_down; each SIMD group decodes ``nc``
    adjacent tile columns of the threadgroup's 8, so warps * nc / 8 k groups share each tile column. ``ring_words`` of
    threadgroup memory hold the trellis ring: as many 128-blocks in flight as fit (2 to 4). A
    dense launch with fewer than ``dense_single_blocks`` 128-column output blocks splits k until
    it has ``dense_split_warps`` SIMD groups; its last threadgroup per column block then finishes
    it where the backend allows and ``finish_splits`` is 1, else exl3_gemv_out does; exl3_expert_gate_up
    and exl3_expert_down split k until they have ``gate_up_split_warps`` / ``down_split_warps``
    for ``plan_slots`` slots, whatever the call's slot count (see expert_plan). With
    ``shared_in_routed`` the MoE's shared expert rides in the routed experts' last launches
    (run_moe) where it fits (exl3.ops.shared_fits). With ``normed_gemv`` a finishing k-split
    exl3_gemv also gives the RMSNorm of its output where the model asks for it (NORM,
    normed_gemv_fits), and with ``paired_gemv`` two such linears of one input share a launch
    (PAIR, paired_gemv_fits). With ``roped_gemv`` a one-split exl3_gemv also turns its output
    by the rope where the model asks (ROPE, roped_gemv_fits), and a paired launch writes its second
    linear's rows into the window ring (RING, window_gemv_fits).
    """

    warps: int = 8
    gate_up_warps: int = 8
    down_warps: int = 8
    nc: int = 4
    ring_words: int = 6144
    dense_split_warps: int = 2112  # 132 SMs x 16
    dense_single_blocks: int = 128
    finish_splits: int = 1  # 1: a k-split exl3_gemv finishes itself (FINISH) where GRID_FINISH allows
    normed_gemv: int = 1  # 1: such a launch norms its output too where asked (NORM; 0: hc_collapse_norm)
    paired_gemv: int = 1  # 1: two such linears of one input share a launch where they can (PAIR)
    roped_gemv: int = 1  # 1: a GEMV turns its rows / writes the window ring itself where asked (ROPE, RING)
    gate_up_split_warps: int = 6336  # 132 SMs x 48
    down_split_warps: int = 12672  # 132 SMs x 96
    plan_slots: int = 6  # slots the expert k splits are planned for (Flash top-k)
    shared_in_routed: int = 1  # 1: the shared expert rides in the routed experts' launches (run_moe)

    def __post_init__(self):
        for warps in (self.warps, self.gate_up_warps, self.down_warps):
            if warps not in (4, 8, 16) or self.nc not in (2, 4, 8) or warps * self.nc > 64:
                raise ValueError(
                    f"exl3 tuning: warps {warps} x nc {self.nc} is not one of (4, 8) x (2, 4, 8), 16 x (2, 4)"
                )
        if (
            min(
                self.ring_words,
                self.dense_split_warps,
                self.dense_single_blocks,
                self.gate_up_split_warps,
                self.down_split_warps,
                self.plan_slots,
            )
            < 1
        ):
            raise ValueError(f"exl3 tuning: sizes must be positive, got {self}")

    def stages(self, k2: int) -> int:
        """Trellis blocks in the ring for bitrate k2 (2 to 4): with xh, within the 48 KiB of static
        threadgroup memory a CUDA kernel may declare (ys, at most 8 k groups x 8 rows x 128 floats,
        reuses the ring and fits as well)."""
        block = 256 * k2
        return max(2, min(4, self.ring_words // block, (_SHARED_WORDS["cuda"] - _XS_WORDS) // block))

    def template(self, warps: int, k2: int, rows: int, blocks: int, backend_name: str = "cuda") -> list:
        """Launch-shape template values for ``warps`` SIMD groups, bitrate k2, ``rows`` rows (the M
        template) and a threadgroup k range of ``blocks`` 128-blocks (xh staging is sized to it, at
        most 16 KiB; 8 KiB on Metal, whose kernels have no trellis ring and 32 KiB in all)."""
        need = rows * blocks * 64
        ys_words = warps * self.nc // 8 * rows * 128
        ring_words = ys_words if backend_name == "metal" else max(self.stages(k2) * 256 * k2, ys_words)
        limit = _SHARED_WORDS.get(backend_name, _SHARED_WORDS["cuda"])
        # xh staged in chunks when the whole k range does not fit beside the ring (K = 8: 2 x 4096)
        cap = max(
            w
            for w in (1024, 2048, _XS_WORDS if backend_name != "metal" else _XS_WORDS // 2)
            if w <= limit - ring_words or w == 1024
        )
        xs_words = next(w for w in (1024, 2048, cap) if need <= w or w == cap)
        if ring_words + xs_words > limit:
            raise ValueError(
                f"exl3 tuning {self}: {warps} SIMD groups x {rows} rows need "
                f"{4 * (ring_words + xs_words)} bytes of threadgroup memory on {backend_name}"
            )
        return [("NC", self.nc), ("NW", warps), ("STAGES", self.stages(k2)), ("XSW", xs_words)]


TUNING = Tuning()

_HEADERS = ("float_bits.h", "grid_finish.h", "exl3_decode.h", "exl3_matmul.h")
_EXPERT_HEADERS = _HEADERS + ("exl3_experts.h",)

# The example launches (CI) are defined at the end of this module, hence the lambdas.
RECONSTRUCT = register(
    Kernel(
        "exl3_reconstruct",
        ("trellis",),
        ("out",),
        includes=("exl3_decode.h",),
        max_threads=256,
        examples=lambda: _example_reconstruct(),
    )
)
GEMV = register(
    Kernel(
        "exl3_gemv",
        (
            *("x", "suh", "trellis", "svh", "bias", "counters", "norm_w", "suh2", "trellis2", "svh2"),
            *("offset", "period", "norm2_w", "window"),
        ),
        ("out", "y", "y2", "window_out"),
        # hc.h: NORM's RMSNorm (hc_rms_norm_row); the rest: ROPE's and RING's rope (rope_row)
        includes=_HEADERS + ("hc.h", "fake_quant.h", "rope.h", "exl3_rope.h"),
        max_threads=512,
        examples=lambda: _example_gemv(),
    )
)
GEMV_OUT = register(
    Kernel(
        "exl3_gemv_out",
        ("partial", "svh", "bias"),
        ("out",),
        includes=_HEADERS,
        max_threads=256,
        examples=lambda: _example_gemv_out(),
    )
)
EXPERT_GATE_UP = register(
    Kernel(
        "exl3_expert_gate_up",
        (
            *("x", "indices", "suh1", "t1", "p1", "suh3", "t3", "p3", "prev", "weights", "svh1", "svh3", "suh2"),
            *("counters", "s1", "s3", "ssuh1", "ssuh3", "ssvh1", "ssvh3", "ssuh2", "sidx", "sw"),
        ),
        ("out", "xh"),
        includes=_EXPERT_HEADERS,
        defines=SLOT_DEFINES,
        max_threads=512,
        examples=lambda: _example_gate_up(),
    )
)
EXPERT_SWIGLU = register(
    Kernel(
        "exl3_expert_swiglu",
        ("gu", "weights", "indices", "svh1", "svh3", "suh2"),
        ("xh",),
        includes=_EXPERT_HEADERS,
        defines=SLOT_DEFINES,
        max_threads=256,
        examples=lambda: _example_swiglu(),
    )
)
EXPERT_DOWN = register(
    Kernel(
        "exl3_expert_down",
        ("xh", "indices", "t2", "p2", "prev", "svh2", "add", "counters", "suh2", "s2", "ssvh2", "sidx", "counters2"),
        ("out", "y", "moe"),
        includes=_EXPERT_HEADERS,
        defines=SLOT_DEFINES,
        max_threads=512,
        examples=lambda: _example_down(),
    )
)
EXPERT_DOWN_FINISH = register(
    Kernel(
        "exl3_expert_down_finish",
        ("partial", "indices", "svh2", "add"),
        ("out",),
        includes=_EXPERT_HEADERS,
        defines=SLOT_DEFINES,
        max_threads=256,
        examples=lambda: _example_down_finish(),
    )
)
# The two sides of an EXL3 linear for many rows, around f16_gemm (docs/exl3.md#many-row-transforms).
ROWS_IN = register(
    Kernel(
        "exl3_rows_in",
        ("x", "src", "e", "suh"),
        ("xh",),
        includes=_HEADERS,
        max_threads=256,
        examples=lambda: _example_rows(),
    )
)
ROWS_OUT = register(
    Kernel(
        "exl3_rows_out",
        ("acc", "e", "dst", "svh", "bias"),
        ("y",),
        includes=_HEADERS,
        max_threads=256,
        examples=lambda: _example_rows(out=True),
    )
)


# --------------------------------------------------------------------------------- launch plans


def _even_splits(k_blocks: int, splits: int) -> tuple[int, int]:
    """(splits, 128-blocks per split) for about ``splits`` equal splits; only the last one shorter."""
    per_split = -(-k_blocks // splits)
    return -(-k_blocks // per_split), per_split


def _k_splits(k_blocks: int, units: int, target: int) -> tuple[int, int]:
    """(splits, 128-blocks per split): k split until units * splits reaches target threadgroups."""
    return _even_splits(k_blocks, max(1, min(k_blocks, -(-target // units))))


def dense_plan(k_blocks: int, n_blocks: int, tuning: Tuning | None = None) -> tuple[int, int]:
    """(splits, 128-blocks per split) of exl3_gemv for a k x n trellis in 128-blocks."""
    t = tuning or TUNING
    if n_blocks >= t.dense_single_blocks:
        return 1, k_blocks
    return _k_splits(k_blocks, n_blocks, -(-t.dense_split_warps // t.warps))


def _rows_template(m: int) -> int:
    return 1 << max(0, math.ceil(math.log2(m)))


# ------------------------------------------------------------------------------- launch kwargs


def reconstruct_args(trellis, codebook: str, guard_rows: int = 0, init_value=None) -> dict:
    """exl3_reconstruct call kwargs; ``guard_rows`` extra output rows (tests) are never written."""
    k2 = _k2(trellis)
    tk, tn, _ = trellis.shape
    return dict(
        inputs=[trellis],
        output_shapes=[(tk * 16 + guard_rows, tn * 16)],
        output_dtypes=[mx.float16],
        grid=(tn // 8 * 256, tk, 1),
        threadgroup=(256, 1, 1),
        template=[("K2", k2), ("CB", CODEBOOK_IDS[codebook])],
        init_value=init_value,
    )


def _grid_finish(t: Tuning) -> bool:
    """Whether exl3_gemv may finish its own k splits here (the backend, and exl3_gemv_out's 8 SIMD
    groups, whose order of sums the FINISH path repeats)."""
    return t.warps == 8 and grid_finish.available(backend())


@graph_constants.constant
def _no_weights() -> np.ndarray:
    return np.zeros(1, np.float32)


def expert_finish(tuning: Tuning | None = None) -> bool:
    """Whether the expert kernels' last launches finish themselves here (FINISH: exl3_expert_gate_up
    does exl3_expert_swiglu's work, exl3_expert_down exl3_expert_down_finish's), as a k-split
    exl3_gemv does (the backend, and ``finish_splits``)."""
    return bool((tuning or TUNING).finish_splits) and grid_finish.available(backend())


def finish_counters(proj, slots: int) -> mx.array:
    """The FINISH counters of an expert projection's launches over ``slots`` slots: one per (slot,
    128-column block), kept on ``proj`` (held_counters)."""
    return held_counters(proj, slots * (proj.n // BLOCK))


def _check_counters(counters, slots: int, n: int, what: str) -> None:
    grid_finish.check_counters(counters, slots * (n // BLOCK), f"exl3 {what}: FINISH")


def _rows_out(x, n: int, guard_rows: int, out_shape=None) -> tuple:
    """The output of x [..., in]'s rows: [..., n] (or out_shape, holding as many values), or
    [m + guard_rows, n] with guard rows (tests)."""
    m = math.prod(x.shape[:-1])
    if guard_rows:
        return (m + guard_rows, n)
    if out_shape is None:
        return (*x.shape[:-1], n)
    if math.prod(out_shape) != m * n:
        raise ValueError(f"exl3 gemv: out_shape {tuple(out_shape)} must hold {m} x {n} values")
    return tuple(out_shape)


# long: one launch's whole argument list (inputs, outputs, grid, template), read beside exl3_gemv.metal
def gemv_args(
    x,
    trellis,
    suh,
    svh,
    codebook: str,
    bias=None,
    out_dtype=None,
    splits=None,
    tuning=None,
    guard_rows: int = 0,
    init_value=None,
    counters=None,
    out_shape=None,
    norm=None,
    pair=None,
    rope: Turn | None = None,
    window: WindowWrite | None = None,
) -> list[dict]:
    """Call kwargs of exl3_gemv (and exl3_gemv_out when k is split) for x [..., in] (rows in order,
    not reshaped: y is [..., n], or out_shape holding the same m · n values, e.g. a linear's heads
    [..., H, n / H]); the second call's partial input is filled in by the caller.
    Tests: ``splits`` / ``tuning`` override the plan; ``guard_rows`` adds never-written rows to y
    ([m + guard_rows, n]; splits to the partial sums). With ``counters`` (uint32 [n / 128], zeros:
    `split_counters`) a k-split launch finishes itself where the backend can (FINISH: one call,
    y its second output); otherwise exl3_gemv_out does (two calls). ``norm`` = (weight, eps): y is
    rms_norm of the linear's output (NORM; such a launch only, counters [n / 128 + 1]). ``pair`` =
    (trellis2, suh2, svh2, codebook2): a second linear of x in the same launch (PAIR; such a launch
    only, see paired_gemv_fits), y2 [..., n2] its third output, counters for both linears' blocks.
    ``rope`` (a one-split launch only, see roped_gemv_fits): y's rows turned by it (ROPE). ``window``
    (with pair: see window_gemv_fits): the fourth output is window.ring with y2's rows written as the
    window keys (RING; counters: one more)."""
    t = tuning or TUNING
    k2 = _k2(trellis)
    m = math.prod(x.shape[:-1])
    rows_t = _rows_template(m)
    k_blocks, n_blocks = trellis.shape[0] // 8, trellis.shape[1] // 8
    n = n_blocks * BLOCK
    splits, per_split = dense_plan(k_blocks, n_blocks, t) if splits is None else _even_splits(k_blocks, splits)
    out_dtype = out_dtype or x.dtype
    fused = splits == 1
    finish_here = not fused and counters is not None and t.finish_splits and _grid_finish(t)
    y_shape = _rows_out(x, n, guard_rows, out_shape)
    first = (trellis, suh, svh, codebook, bias)
    pair_in, y2_shape, n2, plan2 = _pair_inputs(pair, first, finish_here, t, x, guard_rows)
    counters_in, norm_w, eps = _finish_inputs(counters, norm, finish_here, n, n2, svh, window is not None)
    rope_in, ring_shape, rope_template = _rope_inputs(rope, window, fused, x, n, n2, out_dtype, svh)
    y_dtype = out_dtype if finish_here else mx.float32
    gemv = dict(
        inputs=[x, suh, trellis, svh, svh if bias is None else bias, counters_in, norm_w, *pair_in, *rope_in],
        output_shapes=[
            y_shape if fused else (max(splits, plan2[0]) + guard_rows, m, n + n2),
            y_shape if finish_here else (1,),
            y2_shape,
            ring_shape,
        ],
        output_dtypes=[out_dtype if fused else mx.float32, y_dtype, y_dtype, out_dtype],
        grid=((n + n2) // BLOCK * _LANES * t.warps, max(splits, plan2[0]), 1),
        threadgroup=(_LANES * t.warps, 1, 1),
        template=[
            ("K2", k2),
            ("CB", CODEBOOK_IDS[codebook]),
            ("M", rows_t),
            *t.template(t.warps, k2, rows_t, max(per_split, plan2[1]), backend()),
            ("FUSED", fused),
            ("FINISH", finish_here),
            ("HAS_BIAS", bias is not None),
            ("OUT", _OUT_KIND[out_dtype] if fused or finish_here else 0),
            ("PER_SPLIT", per_split),
            ("NORM", norm is not None),
            ("EPS_BITS", float_bits(eps)),
            ("PAIR", n_blocks if pair is not None else 0),
            ("PER_SPLIT2", plan2[1]),
            *rope_template,
        ],
        init_value=init_value,
        absent=_gemv_absent(bias, finish_here, norm, pair, rope, window),
    )
    if fused or finish_here:
        return [gemv]
    return [gemv, _gemv_out_args(x, svh, bias, out_dtype, n_blocks, y_shape, init_value)]


def _gemv_absent(bias, finish_here: bool, norm, pair, rope, window) -> tuple[str, ...]:
    """The exl3_gemv arguments a launch's template never reads or writes (their stand-ins: see
    _pair_inputs, _finish_inputs, _rope_inputs); a CUDA launch leaves them out."""
    return (
        *(("bias",) if bias is None else ()),
        *(() if finish_here else ("counters", "y")),
        *(("norm_w",) if norm is None else ()),
        *(("suh2", "trellis2", "svh2", "y2") if pair is None else ()),
        *(("offset", "period") if rope is None and window is None else ()),
        *(("norm2_w", "window", "window_out") if window is None else ()),
    )


def _pair_inputs(pair, first: tuple, finish_here: bool, t: Tuning, x, guard_rows: int) -> tuple:
    """(suh2, trellis2, svh2 inputs, y2's shape, n2, its (splits, per split)) of an exl3_gemv
    launch: PAIR's second linear, or the first's arrays as stand-ins (never read), a 1-element y2,
    0 and (0, 0). The second linear takes its own launch's plan; it must have the first's bits,
    codebook, k and transform dtypes, split k, and neither may have a bias (see paired_gemv_fits)."""
    if pair is None:
        return [first[1], first[0], first[2]], (1,), 0, (0, 0)
    trellis2, suh2, svh2, _ = pair
    if not finish_here or not paired_gemv_fits(x, first, (*pair, None), t):
        raise ValueError(
            "exl3 gemv: PAIR needs two k-split linears that finish themselves, with the same bits, "
            "codebook, k and dtypes and no bias (paired_gemv_fits)"
        )
    plan2 = dense_plan(trellis2.shape[0] // 8, trellis2.shape[1] // 8, t)
    n2 = trellis2.shape[1] * 16
    m = math.prod(x.shape[:-1])
    return [suh2, trellis2, svh2], (m + guard_rows, n2) if guard_rows else (*x.shape[:-1], n2), n2, plan2


def _pair_key(trellis, suh, svh, codebook: str) -> tuple:
    """What two linears sharing an exl3_gemv launch (PAIR) must have in common."""
    return _k2(trellis), codebook, trellis.shape[0], suh.dtype, svh.dtype


def _finish_inputs(counters, norm, finish_here: bool, n: int, n2: int, svh, ring: bool = False) -> tuple:
    """(counters input, norm_w input, eps) of an exl3_gemv launch: counters where it finishes itself
    (a stand-in otherwise; one per column block of both linears with PAIR); NORM's (weight [n], eps),
    or svh as a stand-in and 0. NORM needs the launch to finish itself and one counter past the
    column blocks', RING one more."""
    if counters is not None:
        _check_counters(counters, 1, n + n2, "gemv")
        if ring:
            grid_finish.check_counters(counters, (n + n2) // BLOCK + (norm is not None) + 1, "exl3 gemv: RING")
    counters_in = counters if finish_here else no_counters()
    if norm is None:
        return counters_in, svh, 0.0
    weight, eps = norm
    if not finish_here:
        raise ValueError("exl3 gemv: NORM needs a k-split launch that finishes itself (normed_gemv_fits)")
    if weight.shape != (n,):
        raise ValueError(f"exl3 gemv: the norm's weight must be [{n}], got {weight.shape}")
    grid_finish.check_counters(counters, (n + n2) // BLOCK + 1, "exl3 gemv: NORM")
    return counters_in, weight, eps


@graph_constants.constant
def _no_offset() -> np.ndarray:
    return np.zeros((), np.int32)


def _rope_inputs(rope, window, fused: bool, x, n: int, n2: int, out_dtype, svh) -> tuple:
    """(offset, period, norm2_w, ring inputs; ring_out's shape; the ROPE, RING, EPS2_BITS, QBLOCK,
    QMODE template values) of an exl3_gemv launch: ROPE's turn of y (a one-split launch), RING's
    window write of y2 (a paired launch), or stand-ins never read (a 0-d offset: the kernels read
    a scalar), a 1-element ring_out and zeros."""
    if rope is not None and window is not None:
        raise ValueError("exl3 gemv: ROPE turns a one-split launch's rows, RING a paired launch's: not both")
    if rope is not None:
        why = _turn_refusal(x, n, rope.periods, out_dtype) or (None if fused else "its k is split")
        if why is not None:
            raise ValueError(f"exl3 gemv: ROPE cannot turn this launch's rows: {why} (roped_gemv_fits)")
        inputs = [scalar_int32(rope.offset), rope.periods, svh, svh]
        return inputs, (1,), _rope_template(1, 0)
    if window is not None:
        why = _window_refusal(x, n2, window, out_dtype)
        if why is not None:
            raise ValueError(f"exl3 gemv: RING cannot write this launch's rows: {why} (window_gemv_fits)")
        inputs = [scalar_int32(window.offset), window.periods, window.weight, window.ring]
        block, mode = window.quant
        return inputs, window.ring.shape, _rope_template(0, 1, float_bits(window.eps), block, mode)
    return [_no_offset(), svh, svh, svh], (1,), _rope_template(0, 0)


def _rope_template(rope: int, ring: int, eps_bits: int = 0, block: int = 32, mode: int = 0) -> list:
    return [("ROPE", rope), ("RING", ring), ("EPS2_BITS", eps_bits), ("QBLOCK", block), ("QMODE", mode)]


def _turn_refusal(x, n: int, periods, out_dtype) -> str | None:
    """Why ROPE cannot turn the rows of x's linear (n outputs) by periods, or None."""
    D = 2 * periods.shape[0]
    if x.ndim < 2 or D % 4 or n % D or periods.dtype != mx.float32:
        return f"rows [.., S, in] and float32 periods of a rope width dividing {n} by 4s, got {x.shape}, {D}"
    return None if out_dtype in _OUT_KIND else f"an output dtype {out_dtype}"


def _window_refusal(x, n2: int, window: WindowWrite, out_dtype) -> str | None:
    """Why RING cannot write the window keys of x's tokens from a second linear of n2 outputs, or None."""
    if x.ndim != 3 or window.ring.dtype != out_dtype or window.ring.shape[0] != x.shape[0]:
        return f"x [B, S, in] and a ring [B, R, D] in the output dtype, got {x.shape}, {window.ring.shape}"
    return window.refusal((*x.shape[:2], n2))


def roped_gemv_fits(x, trellis, periods, out_dtype, tuning: Tuning | None = None) -> bool:
    """Whether exl3_gemv can turn its own rows by the rope here (ROPE): x's rows fit the kernel, its
    launch plan does not split k (the threadgroup holding a column block stores it), the rope's
    width divides the outputs, and the tuning allows it (any GPU backend)."""
    t = tuning or TUNING
    if backend() == "cpu" or math.prod(x.shape[:-1]) > GEMV_MAX_ROWS or not t.roped_gemv:
        return False
    if dense_plan(trellis.shape[0] // 8, trellis.shape[1] // 8, t)[0] != 1:
        return False
    return _turn_refusal(x, trellis.shape[1] * 16, periods, out_dtype) is None


def window_gemv_fits(x, first, second, window: WindowWrite, tuning: Tuning | None = None) -> bool:
    """Whether a paired exl3_gemv can also write its second linear's rows into the window ring here
    (RING): the two pair (paired_gemv_fits), the rope kernel would take the rows and the ring, and
    the tuning allows it."""
    t = tuning or TUNING
    if not (t.roped_gemv and paired_gemv_fits(x, first, second, t)):
        return False
    return _window_refusal(x, second[0].shape[1] * 16, window, x.dtype) is None


def normed_gemv_fits(x, trellis, tuning: Tuning | None = None) -> bool:
    """Whether exl3_gemv can give rms_norm(x · W) itself here (NORM): x's rows fit the kernel
    and its launch plan splits k and finishes itself (where the backend has grid finish)."""
    t = tuning or TUNING
    if math.prod(x.shape[:-1]) > GEMV_MAX_ROWS or not (t.normed_gemv and t.finish_splits and _grid_finish(t)):
        return False
    return dense_plan(trellis.shape[0] // 8, trellis.shape[1] // 8, t)[0] > 1


def paired_gemv_fits(x, first, second, tuning: Tuning | None = None) -> bool:
    """Whether exl3_gemv can give two linears of x in one launch here (PAIR): first / second =
    (trellis, suh, svh, codebook, bias) of each; x's rows fit the kernel, both linears have the same
    bits, codebook, k and transform dtypes, split k (each in its own plan) and finish themselves,
    and neither has a bias."""
    t = tuning or TUNING
    if math.prod(x.shape[:-1]) > GEMV_MAX_ROWS or not (t.paired_gemv and t.finish_splits and _grid_finish(t)):
        return False
    if first[4] is not None or second[4] is not None or _pair_key(*first[:4]) != _pair_key(*second[:4]):
        return False
    return all(dense_plan(w.shape[0] // 8, w.shape[1] // 8, t)[0] > 1 for w in (first[0], second[0]))


def _gemv_out_args(x, svh, bias, out_dtype, n_blocks: int, y_shape: tuple, init_value) -> dict:
    """exl3_gemv_out call kwargs (its partial input filled in by the caller)."""
    return dict(
        inputs=[None, svh, svh if bias is None else bias],
        output_shapes=[y_shape],
        output_dtypes=[out_dtype],
        grid=(n_blocks * 8 * _LANES, math.prod(x.shape[:-1]), 1),
        threadgroup=(8 * _LANES, 1, 1),
        template=[("HAS_BIAS", bias is not None), ("OUT", _OUT_KIND[out_dtype])],
        init_value=init_value,
    )


def expert_plan(w1, tuning: Tuning | None = None) -> tuple[int, int]:
    """(splits, 128-blocks per split) of exl3_expert_gate_up. Decided from the projection's shape
    for ``plan_slots`` slots, never from the slots of the call: a slot's bytes must not depend on
    what else is in the batch (batched == solo; the expert-parallel slot split == one process)."""
    t = tuning or TUNING
    units = 2 * t.plan_slots * (w1.n // BLOCK)
    return _k_splits(w1.k // BLOCK, units, -(-t.gate_up_split_warps // t.gate_up_warps))


def down_plan(w2, tuning: Tuning | None = None) -> tuple[int, int]:
    """(splits, 128-blocks per split) of exl3_expert_down, from w2's shape only (as expert_plan)."""
    t = tuning or TUNING
    units = t.plan_slots * (w2.n // BLOCK)
    return _k_splits(w2.k // BLOCK, units, -(-t.down_split_warps // t.down_warps))


@graph_constants.constant
def _shared_indices(tokens: int) -> np.ndarray:
    return np.zeros((tokens, 1), np.int32)


@graph_constants.constant
def _shared_weights(tokens: int) -> np.ndarray:
    return np.ones((tokens, 1), np.float32)


def shared_routing(tokens: int) -> tuple:
    """The shared expert's routing as one expert: indices [T, 1] zeros and weights [T, 1] ones."""
    return _shared_indices(tokens), _shared_weights(tokens)


def _stacks_template(t: Tuning, warps: int, key, per_split: int, shared) -> list:
    """Launch-shape template values of an expert launch for its routed stack ``key`` and, where
    ``shared`` (a single-expert projection) rides along, the shared expert's stack: K2S, CBS,
    STAGES_S (the routed stack's own values without it), the xh staging the smaller of the two."""
    own = t.template(warps, key[0], 1, per_split, backend())
    if shared is None:
        return [*own, ("K2S", key[0]), ("CBS", CODEBOOK_IDS[key[1]]), ("STAGES_S", t.stages(key[0]))]
    group = shared.groups[0]
    other = dict(t.template(warps, group.k2, 1, per_split, backend()))
    values = [(k, min(v, other["XSW"]) if k == "XSW" else v) for k, v in own]
    return [*values, ("K2S", group.k2), ("CBS", CODEBOOK_IDS[group.codebook]), ("STAGES_S", other["STAGES"])]


_SHARED_GATE_UP = ("s1", "s3", "ssuh1", "ssuh3", "ssvh1", "ssvh3", "ssuh2", "sidx", "sw")
_SHARED_DOWN = ("s2", "ssvh2", "sidx", "counters2", "moe")


def _expert_absent(prev, finish, shared, finishing: tuple, sharing: tuple) -> tuple[str, ...]:
    """The arguments of an expert launch its template never reads or writes (their stand-ins: prev
    without HAS_PREV, the finishing part's without FINISH, the shared expert's without SHARED); a
    CUDA launch leaves them out."""
    return (
        *(("prev",) if prev is None else ()),
        *(finishing if finish is None else ()),
        *(sharing if shared is None else ()),
    )


def gate_up_args(
    x, indices, w1, w3, key, lo: int, prev=None, tuning=None, guard: int = 0, init_value=None, finish=None, shared=None
) -> dict:
    """exl3_expert_gate_up call kwargs for the (k2, codebook) group ``key`` of w1 and w3 (tests:
    ``tuning`` overrides the launch shape, ``guard`` adds never-written slots). ``finish`` =
    (weights, w2, limit, counters) for the last group's launch where `expert_finish`: it also does
    exl3_expert_swiglu's work, w2's input xh [slots, I / 2] its second output (`finish_counters`).
    ``shared`` = the shared expert's (w1, w3, w2) as single experts (`shared_fits`), with ``finish``:
    its slots (one per token) follow the routed ones in the same launch (SHARED; ``counters`` then
    cover them too)."""
    t = tuning or TUNING
    slots = indices.size + (0 if shared is None else indices.shape[0])
    splits, per_split = expert_plan(w1, t)
    if finish is None:  # stand-ins of the same dtypes (one source text), never read
        weights, suh2, limit, counters, xh_shape = _no_weights(), w1.svh, 0.0, no_counters(), (1,)
        if shared is not None:
            raise ValueError("exl3 expert gate_up: the shared expert's slots need the finishing launch")
    else:
        weights, w2, limit, counters = finish
        _check_counters(counters, slots, w1.n, "expert gate_up")
        suh2, xh_shape = w2.suh, (slots + guard, w1.n // 2)
    g1, g3 = _group(w1, key), _group(w3, key)
    t1 = (g1 or g3).trellis
    t3 = (g3 or g1).trellis
    # A projection with no expert in this group: every expert is in another group.
    p1 = g1.position if g1 else graph_constants.array((int(SlotStack.OTHER_GROUP),) * w1.n_local, mx.int32)
    p3 = g3.position if g3 else graph_constants.array((int(SlotStack.OTHER_GROUP),) * w3.n_local, mx.int32)
    if shared is None:  # stand-ins, never read
        stack = (t1, t3, w1.suh, w3.suh, w1.svh, w3.svh, suh2, indices, weights)
    else:
        s1, s3, s2 = shared
        stack = (s1.groups[0].trellis, s3.groups[0].trellis, s1.suh, s3.suh, s1.svh, s3.svh, s2.suh)
        stack += shared_routing(indices.shape[0])
    return dict(
        inputs=[
            *(x, indices, w1.suh, t1, p1, w3.suh, t3, p3, indices if prev is None else prev),
            *(weights, w1.svh, w3.svh, suh2, counters, *stack),
        ],
        output_shapes=[(slots + guard, 2, splits, w1.n), xh_shape],
        output_dtypes=[mx.float32, mx.uint32],
        grid=(w1.n // BLOCK * _LANES * t.gate_up_warps, splits, 2 * slots),
        threadgroup=(_LANES * t.gate_up_warps, 1, 1),
        template=[
            ("K2", key[0]),
            ("CB", CODEBOOK_IDS[key[1]]),
            *_stacks_template(t, t.gate_up_warps, key, per_split, None if shared is None else shared[0]),
            ("HAS_PREV", prev is not None),
            ("LO", int(lo)),
            ("PER_SPLIT", per_split),
            ("SPLITS", splits),
            ("FINISH", finish is not None),
            ("SHARED", shared is not None),
            ("INTER", w1.out_features),
            ("LIMIT_BITS", float_bits(limit if limit > 0 else 0.0)),
        ],
        init_value=init_value,
        absent=_expert_absent(prev, finish, shared, ("weights", "suh2", "counters", "xh"), _SHARED_GATE_UP),
    )


def _block_per_simd_group_launch(blocks: int, slots: int) -> dict:
    """grid / threadgroup of exl3_expert_swiglu and exl3_expert_down_finish: one SIMD group per
    128-block (x, _SMALL_WARPS per threadgroup, the last ones possibly idle) and slot (y)."""
    return dict(
        grid=(-(-blocks // _SMALL_WARPS) * _SMALL_WARPS * _LANES, slots, 1), threadgroup=(_SMALL_WARPS * _LANES, 1, 1)
    )


def swiglu_args(gu, weights, indices, w1, w3, w2, lo: int, limit: float, guard: int = 0, init_value=None) -> dict:
    """exl3_expert_swiglu call kwargs: w2's input xh [slots, I / 2] (fp16 pairs) from the gate/up
    partials of every group."""
    slots = indices.size
    return dict(
        inputs=[gu, weights, indices, w1.svh, w3.svh, w2.suh],
        output_shapes=[(slots + guard, w1.n // 2)],
        output_dtypes=[mx.uint32],
        **_block_per_simd_group_launch(w1.n // BLOCK, slots),
        template=[
            ("LO", int(lo)),
            ("INTER", w1.out_features),
            ("LIMIT_BITS", float_bits(limit if limit > 0 else 0.0)),
            ("SPLITS", gu.shape[2]),
        ],
        init_value=init_value,
    )


# long: one launch's whole argument list (inputs, outputs, grid, template), read beside exl3_expert_down.metal
def down_args(
    xh,
    indices,
    w2,
    group,
    lo: int,
    prev=None,
    tuning=None,
    guard: int = 0,
    init_value=None,
    finish=None,
    shared=None,
    y_shape=None,
    moe_shape=None,
) -> dict:
    """exl3_expert_down call kwargs (k-split partials) for one (k2, codebook) group of w2 (tests: as
    gate_up_args). ``xh``: w2's input xh [slots, k / 2] (uint32 fp16 pairs, formed earlier), or the
    slots' rows x [slots, in] (float; or any shape holding them in order), which the launch
    transforms itself (STAGE_X). ``finish`` = (out_dtype, add, counters) for the last group's launch
    where `expert_finish`: it also does exl3_expert_down_finish's work (see down_finish_args), y its
    second output. ``shared`` = (the shared expert's w2 as a single expert, moe_dtype, counters2),
    with ``finish`` (float32, no add): its slots (one per token, xh rows after the routed ones) in
    the same launch (SHARED), y [slots + T, n] float32 and the MoE's output [T, n] in moe_dtype the
    third output. ``y_shape``: y in that shape (slots · n elements, e.g. a grouped linear's
    [..., G · n]) instead of [slots, n]; ``moe_shape`` the MoE's output so (e.g. [B, S, n])."""
    t = tuning or TUNING
    slots = indices.size + (0 if shared is None else indices.shape[0])
    if xh.dtype != mx.uint32 and xh.size < indices.size * w2.in_features:
        raise ValueError(f"exl3 expert down: x {xh.shape} holds fewer than {indices.size} rows of {w2.in_features}")
    splits, per_split = down_plan(w2, t)
    out_dtype, add, counters, y_shape = _down_finish(finish, shared, slots, w2.n, guard, y_shape)
    stack, moe_dtype, moe_shape = _down_shared(
        shared, xh, indices, w2, group, out_dtype, add, counters, guard, moe_shape
    )
    return dict(
        inputs=[
            *(xh, indices, group.trellis, group.position, indices if prev is None else prev),
            *(w2.svh, w2.svh if add is None else add, counters, w2.suh, *stack),
        ],
        output_shapes=[(slots + guard, splits, w2.n), y_shape, moe_shape],
        output_dtypes=[mx.float32, out_dtype, moe_dtype],
        grid=(w2.n // BLOCK * _LANES * t.down_warps, splits, slots),
        threadgroup=(_LANES * t.down_warps, 1, 1),
        template=[
            ("K2", group.k2),
            ("CB", CODEBOOK_IDS[group.codebook]),
            *_stacks_template(
                t, t.down_warps, (group.k2, group.codebook), per_split, None if shared is None else shared[0]
            ),
            ("HAS_PREV", prev is not None),
            ("LO", int(lo)),
            ("PER_SPLIT", per_split),
            ("SPLITS", splits),
            ("FINISH", finish is not None),
            ("SHARED", shared is not None),
            ("T", out_dtype),
            ("TM", moe_dtype),
            ("ADD", add is not None),
            ("STAGE_X", xh.dtype != mx.uint32),
            ("X_WIDTH", w2.in_features if xh.dtype != mx.uint32 else 0),
        ],
        init_value=init_value,
        absent=(
            *_expert_absent(prev, finish, shared, ("counters", "y"), _SHARED_DOWN),
            *(("add",) if add is None else ()),
        ),
    )


def down_finish_args(
    partial, indices, w2, lo: int, guard: int = 0, init_value=None, out_dtype=mx.float32, add=None
) -> dict:
    """exl3_expert_down_finish call kwargs: y [slots, n] from the partials of every w2 group, bf16
    values held in ``out_dtype`` (float32 or bfloat16: the same values). ``add`` [slots, k, n] fp32
    (one slot per token: the shared expert): y is the MoE's output, out_dtype(Σ add + y)."""
    slots = indices.size
    return dict(
        inputs=[partial, indices, w2.svh, w2.svh if add is None else add],
        output_shapes=[(slots + guard, w2.n)],
        output_dtypes=[out_dtype],
        **_block_per_simd_group_launch(w2.n // BLOCK, slots),
        template=[("T", out_dtype), ("LO", int(lo)), ("SPLITS", partial.shape[1]), ("ADD", add is not None)],
        init_value=init_value,
    )


def rows_in_args(x, src, e, suh, guard: int = 0, init_value=None) -> dict:
    """exl3_rows_in call kwargs: xh [R, k] fp16 of x's rows src [R] through suh[e] ([E, k]); R = src.size."""
    rows, k = src.size, suh.shape[1]
    return dict(
        inputs=[x, src, e, suh],
        output_shapes=[(rows + guard, k)],
        output_dtypes=[mx.float16],
        **_block_per_simd_group_launch(k // BLOCK, rows),
        init_value=init_value,
    )


def rows_out_args(acc, e, dst, svh, bias, out_rows: int, out_dtype, round_bf16: bool = False, init_value=None) -> dict:
    """exl3_rows_out call kwargs: y [out_rows, n] in out_dtype, row dst[r] from acc [R, n] (float32)
    through svh[e[r]] ([E, n]) and bias ([n], or None); rows no r names keep init_value."""
    rows, n = acc.shape
    return dict(
        inputs=[acc, e, dst, svh, svh[0] if bias is None else bias],  # (an unread stand-in)
        output_shapes=[(out_rows, n)],
        output_dtypes=[out_dtype],
        **_block_per_simd_group_launch(n // BLOCK, rows),
        template=[("HAS_BIAS", bias is not None), ("ROUND_BF16", round_bf16), ("OUT", _OUT_KIND[out_dtype])],
        init_value=init_value,
    )


def gate_up_keys(w1, w3) -> list[tuple[int, str]]:
    """The (k2, codebook) groups of w1 and w3, in launch order: one exl3_expert_gate_up each."""
    return sorted({(g.k2, g.codebook) for g in (*w1.groups, *w3.groups)})


def _group(proj, key):
    for g in proj.groups:
        if (g.k2, g.codebook) == key:
            return g
    return None


# ------------------------------------------------------------------------------------ launches


def run_gemv(
    x, trellis, suh, svh, codebook: str, bias, out_dtype, counters=None, out_shape=None, norm=None, rope=None
) -> mx.array:
    """exl3_gemv, and exl3_gemv_out when k is split and the launch does not finish itself (see
    gemv_args): y [..., n] (or out_shape) for x [..., in] of at most GEMV_MAX_ROWS rows (bias, if
    any, padded to n); with norm = (weight, eps), rms_norm(y) (NORM: see normed_gemv_fits); with
    rope (a Turn), y turned by it (ROPE: see roped_gemv_fits)."""
    calls = gemv_args(
        x, trellis, suh, svh, codebook, bias, out_dtype, counters=counters, out_shape=out_shape, norm=norm, rope=rope
    )
    out, y, _, _ = GEMV(**calls[0])
    if dict(calls[0]["template"])["FINISH"]:
        return y
    if len(calls) == 2:
        calls[1]["inputs"][0] = out
        out = GEMV_OUT(**calls[1])[0]
    return out


def run_gemv_pair(x, first: tuple, second: tuple, out_dtype, counters, norm=None, window=None) -> tuple:
    """(y, y2): two linears of x [..., in] in one exl3_gemv launch (PAIR; see paired_gemv_fits),
    first / second = (trellis, suh, svh, codebook); with norm = (weight, eps) y is rms_norm of the
    first's output (NORM). With window (a WindowWrite; see window_gemv_fits), (y, the window ring
    with y2's rows written: RING). counters: both linears' column blocks (+ 1 with norm, + 1 with
    window)."""
    (call,) = gemv_args(x, *first, None, out_dtype, counters=counters, norm=norm, pair=second, window=window)
    _, y, y2, ring = GEMV(**call)
    return y, (y2 if window is None else ring)


def run_experts(x, indices, weights, w1, w3, w2, lo, limit, add=None):
    """The fused expert kernels: per-slot outputs [T, k, w2.out_features] float32 (bf16-valued); with
    ``add`` (routed slots [T, k', n] fp32; one slot per token here: the shared expert), the MoE's
    output [T, n] in x.dtype instead (see down_finish_args). Where `expert_finish`, the last
    exl3_expert_gate_up and exl3_expert_down launches finish themselves (two launches fewer, the same
    bytes)."""
    T, top_k = indices.shape
    finish = expert_finish()
    xh = _gate_up(x, indices, weights, w1, w3, w2, lo, limit, finish)
    y = _down(xh, indices, w2, lo, x.dtype if add is not None else mx.float32, add, finish)
    if add is not None:
        return y
    if w2.out_features != w2.n:
        y = y[:, : w2.out_features]
    return y.reshape(T, top_k, w2.out_features)


def run_moe(x, indices, weights, w1, w3, w2, lo, limit, shared) -> mx.array:
    """The MoE's output [..., n] in x.dtype (x [..., in]: the tokens' rows as the model holds them, no
    reshape either way) from the routed experts and the shared expert in one set of launches
    (docs/design.md#shared-in-routed): the last exl3_expert_gate_up and exl3_expert_down
    launches also serve the shared expert's slots, one per token after the routed ones, and the
    down launch adds the slots as the shared expert's ADD finish does (the same bytes as
    run_experts followed by the shared expert's run_experts with ``add``). ``shared`` = its (w1,
    w3, w2) as single experts, fitting the routed ones (ops.shared_fits); needs `expert_finish`."""
    xh = _gate_up(x, indices, weights, w1, w3, w2, lo, limit, True, shared)
    return _down(xh, indices, w2, lo, mx.float32, None, True, (shared[2], x.dtype), moe_shape=(*x.shape[:-1], w2.n))


def _gate_up(x, indices, weights, w1, w3, w2, lo: int, limit: float, finish: bool, shared=None) -> mx.array:
    """exl3_expert_gate_up per (K, codebook) group of w1 and w3, the last finishing itself where
    ``finish`` (with ``shared``, the shared expert's (w1, w3, w2) single experts, its slots too),
    else exl3_expert_swiglu after them: w2's input xh [slots, I / 2]."""
    slots = indices.size + (0 if shared is None else indices.shape[0])
    keys = gate_up_keys(w1, w3)
    gu = xh = None
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        fin = (weights, w2, limit, finish_counters(w1, slots)) if finish and last else None
        call = gate_up_args(x, indices, w1, w3, key, lo, prev=gu, finish=fin, shared=shared if last else None)
        gu, xh = EXPERT_GATE_UP(**call)
    if not finish:
        xh = EXPERT_SWIGLU(**swiglu_args(gu, weights, indices, w1, w3, w2, lo, limit))[0]
    return xh


def _down_shared(shared, xh, indices, w2, group, out_dtype, add, counters, guard: int, moe_shape=None) -> tuple:
    """down_args' (the shared expert's stack inputs, the MoE output's dtype and shape: [T, n], or
    moe_shape holding as many values; stand-ins without ``shared``)."""
    if shared is None:  # stand-ins, never read
        return (group.trellis, w2.svh, indices, counters), mx.float32, (1,)
    s2, moe_dtype, counters2 = shared
    if out_dtype != mx.float32 or add is not None or xh.dtype != mx.uint32:
        raise ValueError("exl3 expert down: the shared expert's slots take fp32 rows of a formed xh, no add")
    _check_counters(counters2, indices.shape[0], w2.n, "expert down (per token)")
    stack = (s2.groups[0].trellis, s2.svh, shared_routing(indices.shape[0])[0], counters2)
    if moe_shape is None or guard:
        return stack, moe_dtype, (indices.shape[0] + guard, w2.n)
    if math.prod(moe_shape) != indices.shape[0] * w2.n:
        raise ValueError(f"exl3 expert down: moe_shape {tuple(moe_shape)} must hold {indices.shape[0]} x {w2.n} values")
    return stack, moe_dtype, tuple(moe_shape)


def _down_finish(finish, shared, slots: int, n: int, guard: int, y_shape) -> tuple:
    """down_args' (out_dtype, add, counters, y's shape) of the finishing part (stand-ins without)."""
    if finish is None:  # stand-ins, never read
        if shared is not None:
            raise ValueError("exl3 expert down: the shared expert's slots need the finishing launch")
        return mx.float32, None, no_counters(), (1,)
    out_dtype, add, counters = finish
    _check_counters(counters, slots, n, "expert down")
    if y_shape is None or guard:
        y_shape = (slots + guard, n)
    elif math.prod(y_shape) != slots * n:
        raise ValueError(f"exl3 expert down: y_shape {tuple(y_shape)} must hold {slots} x {n} values")
    return out_dtype, add, counters, tuple(y_shape)


def _down(
    xh, indices, w2, lo: int, out_dtype, add, finish: bool, shared=None, y_shape=None, moe_shape=None
) -> mx.array:
    """exl3_expert_down per (K, codebook) group of w2 (xh: as down_args takes it), the last finishing
    itself where ``finish``, else exl3_expert_down_finish after them: y [slots, w2.n] in out_dtype
    (see down_finish_args). With ``shared`` = (the shared expert's w2 as a single expert, the MoE's
    dtype), the last launch also serves its slots and returns the MoE's output instead. ``y_shape``:
    the finishing launch's y in that shape, ``moe_shape`` the MoE's output (down_args)."""
    T = indices.shape[0]
    slots = indices.size + (0 if shared is None else T)
    partial = y = moe = None
    for i, group in enumerate(w2.groups):
        last = finish and i == len(w2.groups) - 1
        fin = (out_dtype, add, finish_counters(w2, slots)) if last else None
        per_token = (*shared, held_counters(shared[0], T * (w2.n // BLOCK))) if last and shared else None
        partial, y, moe = EXPERT_DOWN(
            **down_args(
                xh,
                indices,
                w2,
                group,
                lo,
                prev=partial,
                finish=fin,
                shared=per_token,
                y_shape=y_shape,
                moe_shape=moe_shape,
            )
        )
    if shared is not None:
        return moe
    if finish:
        return y
    return EXPERT_DOWN_FINISH(**down_finish_args(partial, indices, w2, lo, out_dtype=out_dtype, add=add))[0]


@graph_constants.constant
def _group_indices(T: int, G: int) -> np.ndarray:
    """int32 [T, G]: group g of every token runs as expert g (contiguous: a kernel input, not copied)."""
    return np.tile(np.arange(G, dtype=np.int32), (T, 1))


def run_grouped(x, proj, lead: tuple | None = None) -> mx.array:
    """exl3_expert_down (one launch per (K, codebook) group, each transforming its slots' inputs)
    and exl3_expert_down_finish (or the last launch finishing itself) for x [..., G, in] (T tokens)
    with group g as expert g of ``proj``: [..., G, out] in x.dtype. With ``lead`` (the tokens' dims):
    x is any [*lead, ...] holding each token's G rows of `in` in order (e.g. the attention output
    [B, S, H, D]) and the output is [*lead, G · out]: where the last launch finishes itself and out
    is whole tiles, neither way takes a reshape (each a graph node of a decode step)."""
    flat = lead is not None
    G, width = proj.n_local, proj.in_features
    if not flat:
        *lead, G, width = x.shape
    T = math.prod(lead)
    indices = _group_indices(T, G)
    # bf16 values: stored in x's dtype by the kernel when that is bf16 (no cast launch after it)
    out_dtype = x.dtype if x.dtype in (mx.bfloat16, mx.float32) else mx.float32
    if flat and expert_finish() and proj.n == proj.out_features and out_dtype == x.dtype:
        return _down(x, indices, proj, 0, out_dtype, None, True, y_shape=(*lead, G * proj.n))
    y = _down(x.reshape(T * G, width), indices, proj, 0, out_dtype, None, expert_finish())
    y = y[:, : proj.out_features].astype(x.dtype)
    return y.reshape(*lead, -1) if flat else y.reshape(*lead, G, proj.out_features)


# ------------------------------------------------------------------------------ CI examples


def _example_linear(k, n, bits, codebook, seed):
    from mlx_dsv41.exl3.synthetic import random_linear_tensors

    t = random_linear_tensors(k, n, bits, codebook, seed=seed, bias=True)
    return mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"]), mx.array(t["bias"])


def _example_reconstruct():
    calls = []
    for bits, codebook in ((2, "mul1"), (2.5, "mul1"), (5, "mcg"), (8, "3inst")):
        trellis, *_ = _example_linear(128, 256, bits, codebook, 1)
        calls.append(reconstruct_args(trellis, codebook))
    return calls


def _example_gemv():
    # Every backend-visible variant: M, split or fused, each launch shape, the largest
    # threadgroup memory (K = 8 with M = 8 and 8 k groups).
    calls = []
    for m, bits, codebook, dtype, splits, tuning in (
        (1, 3, "mul1", mx.bfloat16, 1, None),
        (8, 8, "mcg", mx.float16, 2, Tuning(nc=8)),
        (3, 1.5, "mul1", mx.float32, None, Tuning(warps=16, nc=2)),
        (2, 7, "3inst", mx.bfloat16, 1, Tuning(warps=16, nc=4)),
    ):
        trellis, suh, svh, bias = _example_linear(256, 256, bits, codebook, 2)
        x = mx.random.normal((m, 250), key=mx.random.key(3)).astype(dtype)
        calls.append(gemv_args(x, trellis, suh, svh, codebook, bias, splits=splits, tuning=tuning)[0])
    # ROPE: the rows turned as stored (2 heads of 128 dims, the last 64 turned)
    x = mx.random.normal((1, 2, 256), key=mx.random.key(4)).astype(mx.bfloat16)
    periods = mx.array([float("inf")] * 32 + [10000.0 ** (k / 32) for k in range(32)])
    calls.append(
        gemv_args(x, *_example_linear(256, 256, 3, "mul1", 2)[:3], "mul1", splits=1, rope=Turn(mx.array(5), periods))[0]
    )
    return calls


def _example_gemv_out():
    trellis, suh, svh, bias = _example_linear(256, 256, 4, "mul1", 4)
    x = mx.random.normal((2, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    finish = gemv_args(x, trellis, suh, svh, "mul1", bias, splits=2)[1]
    finish["inputs"][0] = mx.zeros((2, 2, 256), mx.float32)
    return [finish]


def _example_experts():
    from mlx_dsv41.exl3.experts import EXL3Experts
    from mlx_dsv41.exl3.synthetic import random_experts_tensors

    tensors = random_experts_tensors(4, 256, 384, bits={"w1": 3, "w3": 3, "w2": (2, 4)}, seed=6)
    ex = EXL3Experts.from_tensors(tensors, "experts", 4, (1, 4))
    x = mx.random.normal((2, 256), key=mx.random.key(8)).astype(mx.bfloat16)
    indices = mx.array([[1, 3], [0, 2]], mx.int32)
    weights = mx.array([[0.5, 0.25], [1.0, 0.125]], mx.float32)
    return ex, x, indices, weights


def _example_shared():
    """A shared expert fitting _example_experts' (256 -> 384 -> 256) at K 4, mcg: single experts."""
    from mlx_dsv41.exl3.linear import EXL3Linear
    from mlx_dsv41.exl3.synthetic import random_linear_tensors

    dims = ((256, 384, 11), (256, 384, 12), (384, 256, 13))
    return tuple(
        EXL3Linear.from_stored(random_linear_tensors(i, o, 4, "mcg", seed=s, prefix="p"), "p").as_single_expert()
        for i, o, s in dims
    )


def _example_gate_up():
    ex, x, indices, weights = _example_experts()
    key = (ex.w1.groups[0].k2, ex.w1.groups[0].codebook)
    first = gate_up_args(x, indices, ex.w1, ex.w3, key, 1)
    splits = first["output_shapes"][0][2]
    prev = mx.zeros((indices.size, 2, splits, ex.w1.n), mx.float32)
    return [
        first,
        gate_up_args(x, indices, ex.w1, ex.w3, key, 1, prev=prev),
        gate_up_args(x, indices, ex.w1, ex.w3, key, 1, tuning=Tuning(gate_up_warps=4, nc=8)),
        # the last launch finishing itself (FINISH: the SwiGLU's work into xh)
        gate_up_args(
            x,
            indices,
            ex.w1,
            ex.w3,
            key,
            1,
            finish=(weights, ex.w2, 10.0, split_counters(indices.size * ex.w1.n // BLOCK)),
        ),
        # the MoE's last launch: the shared expert's slots beside the routed ones (SHARED)
        gate_up_args(
            x,
            indices,
            ex.w1,
            ex.w3,
            key,
            1,
            finish=(weights, ex.w2, 10.0, split_counters((indices.size + x.shape[0]) * ex.w1.n // BLOCK)),
            shared=_example_shared(),
        ),
    ]


def _example_swiglu():
    ex, x, indices, weights = _example_experts()
    splits = expert_plan(ex.w1)[0]
    gu = mx.zeros((indices.size, 2, splits, ex.w1.n), mx.float32)
    return [
        swiglu_args(gu, weights, indices, ex.w1, ex.w3, ex.w2, 1, 10.0),
        swiglu_args(gu, weights, indices, ex.w1, ex.w3, ex.w2, 1, 0.0),
    ]


def _example_down():
    ex, x, indices, weights = _example_experts()
    xh = mx.zeros((indices.size, ex.w1.n // 2), mx.uint32)
    calls = [down_args(xh, indices, ex.w2, g, 1) for g in ex.w2.groups]
    calls.append(
        down_args(
            xh,
            indices,
            ex.w2,
            ex.w2.groups[0],
            1,
            prev=mx.zeros((indices.size, down_plan(ex.w2)[0], ex.w2.n), mx.float32),
        )
    )
    calls.append(down_args(xh, indices, ex.w2, ex.w2.groups[0], 1, tuning=Tuning(nc=2, down_warps=16)))
    x = mx.zeros((indices.size, ex.w2.in_features), mx.bfloat16)  # a grouped linear's rows (STAGE_X)
    calls.append(down_args(x, indices, ex.w2, ex.w2.groups[0], 1))

    # the last launch finishing itself (FINISH): the routed slots' fp32 y; a grouped linear's bf16
    # y from its rows; the shared expert (one slot per token) with the routed slots added (ADD)
    def counters(slots):
        return split_counters(slots * ex.w2.n // BLOCK)

    calls.append(down_args(xh, indices, ex.w2, ex.w2.groups[-1], 1, finish=(mx.float32, None, counters(indices.size))))
    calls.append(down_args(x, indices, ex.w2, ex.w2.groups[-1], 1, finish=(mx.bfloat16, None, counters(indices.size))))
    one = indices[:, :1]
    routed = mx.zeros((one.shape[0], indices.shape[1], ex.w2.n), mx.float32)
    calls.append(
        down_args(xh[: one.size], one, ex.w2, ex.w2.groups[-1], 1, finish=(mx.bfloat16, routed, counters(one.size)))
    )
    # the MoE's last launch: the shared expert's slots beside the routed ones, the MoE's output (SHARED)
    slots = indices.size + one.size
    xh_moe = mx.zeros((slots, ex.w1.n // 2), mx.uint32)
    per_token = (_example_shared()[2], mx.bfloat16, counters(one.size))
    calls.append(
        down_args(
            xh_moe, indices, ex.w2, ex.w2.groups[-1], 1, finish=(mx.float32, None, counters(slots)), shared=per_token
        )
    )
    return calls


def _example_rows(out: bool = False):
    rng = np.random.default_rng(5)
    e, rows = mx.array([1, 0, 1], mx.int32), mx.array([2, 0, 1], mx.int32)
    table = mx.array(rng.choice([-1.0, 1.0], (2, 256)).astype(np.float16))
    if not out:
        return [rows_in_args(mx.zeros((3, 200), mx.bfloat16), rows, e, table)]
    acc = mx.zeros((3, 256), mx.float32)
    return [
        rows_out_args(acc, e, rows, table, None, 4, mx.float32, round_bf16=True, init_value=0),
        rows_out_args(acc, e, rows, table, mx.zeros((256,), mx.float16), 3, mx.bfloat16),
    ]


def _example_down_finish():
    ex, x, indices, weights = _example_experts()
    partial = mx.zeros((indices.size, down_plan(ex.w2)[0], ex.w2.n), mx.float32)
    T = indices.shape[0]
    one_slot = mx.full((T, 1), 1, mx.int32)  # the shared expert's call: one slot per token, with the routed slots
    routed = mx.zeros((T, indices.shape[1], ex.w2.n), mx.float32)
    return [
        down_finish_args(partial, indices, ex.w2, 1),
        down_finish_args(partial[:T], one_slot, ex.w2, 1, out_dtype=mx.bfloat16, add=routed),
    ]
