"""Sparse attention over a sliding window ∪ selected compressed entries, with a per-head sink.

    out[b, s, h] = Σ_j exp(l_j - m) kv_j / (Σ_j exp(l_j - m) + exp(sink_h - m)),
    l_j = scale · (q[b, s, h] · kv_j),  j over indices[b, s, :] that are >= 0
    (docs/model.md#attention)

Index i < W reads window[b, i]; i >= W reads pool[b, i - W]; -1 is skipped; any other index outside
[0, W + T) is invalid and makes the outputs of its (b, s) NaN (a device kernel cannot raise, and a
host-side check would force a sync). K = V (one shared latent). The sink is an extra logit in the
denominator only. Nonfinite inputs give what the formula gives in float64.

On a GPU two kernels compute this (mlx_dsv41/metal_ext/sparse_attention.h): ``serial`` (one SIMD group per
(b, s, h)) and ``parallel`` (eight SIMD groups). Their output bytes are identical by construction,
so the choice is only about speed: ``variant=`` per call, else :func:`set_default_variant`, else
``MLX_DSV41_ATTENTION``, else ``auto``. A third kernel, ``rows`` (sparse_attention_rows.h: a
query row's heads as MMA tiles, for prefill), sums in another order and is held to float64
within a stated bound instead (docs/model.md#attention-rows); it runs on CUDA with bf16 inputs
(:func:`rows_refusal`), serial otherwise. ``auto`` takes ``rows`` for calls of at least
``ROWS_AUTO_MIN`` query rows where it runs (a rule of shape, so that no output's bytes depend
on timing noise), and otherwise times serial and parallel once per shape class (see
:func:`_auto_variant`) and keeps the faster.
:func:`sparse_attention_unrotated` is the output as the model uses it: rounded to a dtype and
turned back at its query position (RoPE's inverse), in the attention launch where serial or
parallel runs (``sparse_attention_unrotated``: their bytes, then the rope kernel's;
docs/numerics.md#unrotated-output), else None.
Compile-time tuning constants of the kernels (:func:`set_tuning`, ``TUNABLE``) change speed,
never bytes. On the CPU every variant runs :func:`sparse_attention_reference`.
:func:`variant_counts` says which ran (for generation statistics). Under ``mx.compile`` the choice
and the count happen once, when the function is traced.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import Kernel, backend, float_bits, register, rope

VARIANTS = ("serial", "parallel", "rows", "auto")
ENV_VAR = "MLX_DSV41_ATTENTION"

_LANES = 32  # SIMD width the kernels are written for
_GROUPS = {"serial": 1, "parallel": 8}  # SIMD groups per (b, s, h)
_ROWS_HEADS, _ROWS_THREADS = 16, 128  # rows: a threadgroup per (b, s, 16 heads) (sparse_attention_rows.h)
_DIMS = (256, 512, 1024)  # head dims the kernels are written for (sparse_attention.h)
# Compile-time tuning per variant: template constants of sparse_attention.h that change speed,
# never bytes. PREFETCH: request the next tile's key rows while this tile's value sums run.
TUNABLE = {"PREFETCH": (0, 1)}
_TUNING = {"serial": {"PREFETCH": 0}, "parallel": {"PREFETCH": 1}}
# Query rows per gather in the reference path: bounds its [rows, N, D] temporary.
_REFERENCE_ROW_CHUNK = 64
# Messages with which a backend refuses a 256-thread pipeline (Metal raises at evaluation).
_LAUNCH_LIMIT_ERRORS = ("maximum allowed threads per threadgroup", "too many resources requested")
# Auto timing (see _auto_variant): synthetic inputs capped at these sizes (speed depends on rows x
# keys, not on T); chains of dependent launches, each about _AUTO_CHAIN_SECONDS long.
_AUTO_MAX_ROWS = 512
_AUTO_MAX_POOL = 4096
_AUTO_WARMUP_CALLS = 2  # per variant: JIT compile, allocator, caches
_AUTO_PROBE_CALLS = 2  # per variant: a first estimate that sizes the timed chains
_AUTO_MIN_CALLS, _AUTO_MAX_CALLS = 2, 64
_AUTO_CHAIN_SECONDS = 2e-3
_AUTO_ROUNDS = 5  # timed chains per variant, the variants alternating
# serial is chosen only when its median is below parallel's by more than this factor (noise).
_AUTO_MARGIN = 1.05
# auto takes the rows kernel from this many query rows (B·S) per call on: below it the rows
# kernel's few threadgroups walk every key tile alone, and serial or parallel is faster (H200, 64
# heads: rows loses at 16 rows and wins from 24 on, at 128 and at 640 keys;
# docs/benchmarks.md#attention-rows-auto).
ROWS_AUTO_MIN = 24


def _check(q, window, pool, indices, sinks, scale):
    if q.ndim != 4:
        raise ValueError(f"sparse_attention: q must be [B, S, H, D], got shape {q.shape}")
    B, S, H, D = q.shape
    if window.ndim != 3 or window.shape[0] != B or window.shape[2] != D:
        raise ValueError(f"sparse_attention: window must be [B={B}, W, D={D}], got {window.shape}")
    if pool.ndim != 3 or pool.shape[0] != B or pool.shape[2] != D:
        raise ValueError(f"sparse_attention: pool must be [B={B}, T, D={D}], got {pool.shape}")
    if indices.ndim != 3 or indices.shape[:2] != (B, S):
        raise ValueError(f"sparse_attention: indices must be [B={B}, S={S}, N], got {indices.shape}")
    if indices.dtype != mx.int32:
        raise ValueError(f"sparse_attention: indices must be int32, got {indices.dtype}")
    if sinks.shape != (H,):
        raise ValueError(f"sparse_attention: sinks must be [H={H}], got {sinks.shape}")
    if sinks.dtype != mx.float32:
        raise ValueError(f"sparse_attention: sinks must be float32, got {sinks.dtype}")
    if q.dtype not in (mx.float32, mx.bfloat16):
        raise ValueError(f"sparse_attention: q must be float32 or bfloat16, got {q.dtype}")
    if window.dtype not in (mx.float32, mx.bfloat16) or pool.dtype not in (mx.float32, mx.bfloat16):
        raise ValueError(
            f"sparse_attention: window and pool must be float32 or bfloat16, got {window.dtype} and {pool.dtype}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"sparse_attention: scale must be a finite, non-negative Python float, got {scale!r}")


@graph_constants.constant
def _row_bases(batch: int, rows: int) -> np.ndarray:
    """int32 [batch, 1, 1]: the first row of each sequence's keys in the reference's flat kv."""
    return (np.arange(batch, dtype=np.int32) * rows)[:, None, None]


def sparse_attention_reference(q, window, pool, indices, sinks, scale: float) -> mx.array:
    """Plain-MLX path (CPU, and the oracle for the kernels). fp32 throughout."""
    B, S, H, D = q.shape
    W, T, N = window.shape[1], pool.shape[1], indices.shape[2]
    kv = mx.concatenate([window, pool], axis=1).astype(mx.float32).reshape(B * (W + T), D)
    if W + T == 0:
        kv = mx.zeros((1, D), mx.float32)
    base = _row_bases(B, W + T)
    sink = sinks.astype(mx.float32)[:, None]  # [H, 1]
    outs = []
    for s0 in range(0, S, _REFERENCE_ROW_CHUNK):
        idx = indices[:, s0 : s0 + _REFERENCE_ROW_CHUNK]  # [B, s, N]
        valid = (idx >= 0) & (idx < W + T)
        invalid = ((idx < -1) | (idx >= W + T))[:, :, None, :]
        rows = kv[mx.where(valid, idx, 0) + base]  # [B, s, N, D]
        # Skipped keys contribute nothing at all (not 0 · row, which is NaN for an inf row).
        rows = mx.where(valid[..., None], rows, 0.0)
        qc = q[:, s0 : s0 + _REFERENCE_ROW_CHUNK].astype(mx.float32)  # [B, s, H, D]
        logits = (qc @ rows.swapaxes(-1, -2)) * scale  # [B, s, H, N]
        logits = mx.where(valid[:, :, None, :], logits, -mx.inf)
        logits = mx.where(invalid, mx.nan, logits)
        if N:
            m = mx.maximum(mx.max(logits, axis=-1, keepdims=True), sink)
        else:
            m = mx.broadcast_to(sink, logits.shape[:-1] + (1,))
        p = mx.exp(logits - m)
        denom = mx.sum(p, axis=-1, keepdims=True) + mx.exp(sink - m)
        outs.append((p @ rows) / denom)
    return mx.concatenate(outs, axis=1) if outs else mx.zeros((B, 0, H, D), mx.float32)


# ---------------------------------------------------------------------------------------------
# Kernels

_INPUTS = ("q", "window", "pool", "indices", "sinks")


def _launch_args(q, window, pool, indices, sinks, scale: float, variant: str) -> dict:
    """Call kwargs for one kernel launch (also what CI compiles)."""
    B, S, H, D = q.shape
    W, T, N = window.shape[1], pool.shape[1], indices.shape[2]
    if window.dtype != pool.dtype:  # one key type per kernel; bf16 -> fp32 is exact
        window, pool = window.astype(mx.float32), pool.astype(mx.float32)
    # Empty inputs are never read (HAS_* false: the kernel takes 0 for their sizes); stand-ins keep
    # the buffers non-empty, NaN-filled so that a wrong read could not go unnoticed.
    if W == 0:
        window = graph_constants.full((1, 1, D), float("nan"), window.dtype)
    if T == 0:
        pool = graph_constants.full((1, 1, D), float("nan"), pool.dtype)
    if N == 0:
        indices = graph_constants.full((1,), -1, mx.int32)
    if variant == "rows":
        threads, blocks = _ROWS_THREADS, B * S * (H // _ROWS_HEADS)
    else:
        threads, blocks = _GROUPS[variant] * _LANES, B * S * H
    return dict(
        inputs=[q, window, pool, indices, sinks],
        output_shapes=[(B, S, H, D)],
        output_dtypes=[mx.float32],
        grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        # Launch constants are template values, never small arrays (docs/design.md).
        template=[
            ("DIM", D),
            *sorted(_TUNING.get(variant, {}).items()),
            ("HAS_WINDOW", W > 0),
            ("HAS_POOL", T > 0),
            ("HAS_INDICES", N > 0),
            ("SCALE_BITS", float_bits(abs(scale))),
        ],
    )


def _examples(variant: str) -> list[dict]:
    """Small launches for the CI compile checks: both q dtypes, bf16 and fp32 keys, every D."""
    key = mx.random.key(7)
    calls = []
    for q_dtype, kv_dtype, H, D in (
        (mx.float32, mx.bfloat16, 3, 512),
        (mx.bfloat16, mx.bfloat16, 8, 512),
        (mx.float32, mx.float32, 2, 512),
        (mx.bfloat16, mx.bfloat16, 2, 256),
        (mx.bfloat16, mx.bfloat16, 2, 1024),
    ):
        B, S, W, T, N = 1, 2, 4, 5, 6
        q = mx.random.normal((B, S, H, D), key=key).astype(q_dtype)
        window = mx.random.normal((B, W, D), key=key).astype(kv_dtype)
        pool = mx.random.normal((B, T, D), key=key).astype(kv_dtype)
        indices = mx.random.randint(-1, W + T, (B, S, N), key=key).astype(mx.int32)
        sinks = mx.random.normal((H,), key=key)
        calls.append(_launch_args(q, window, pool, indices, sinks, 0.0625, variant))
    return calls


SERIAL = register(
    Kernel(
        "sparse_attention_serial",
        _INPUTS,
        ("out",),
        includes=("float_bits.h", "sparse_attention.h"),
        max_threads=_GROUPS["serial"] * _LANES,
        examples=lambda: _examples("serial"),
    )
)
PARALLEL = register(
    Kernel(
        "sparse_attention_parallel",
        _INPUTS,
        ("out",),
        includes=("float_bits.h", "sparse_attention.h"),
        max_threads=_GROUPS["parallel"] * _LANES,
        examples=lambda: _examples("parallel"),
    )
)
ROWS = register(
    Kernel(
        "sparse_attention_rows",
        _INPUTS,
        ("out",),
        includes=("float_bits.h", "sparse_attention.h", "sparse_attention_rows.h"),
        max_threads=_ROWS_THREADS,
        examples=lambda: _rows_examples(),
    )
)
_KERNELS = {"serial": SERIAL, "parallel": PARALLEL, "rows": ROWS}
UNROTATED = register(
    Kernel(
        "sparse_attention_unrotated",
        (*_INPUTS, "period", "offset"),
        ("out",),
        includes=(
            "fake_quant.h",
            "float_bits.h",
            "hc.h",
            "rope.h",
            "sparse_attention.h",
            "sparse_attention_unrotated.h",
        ),
        max_threads=_GROUPS["parallel"] * _LANES,
        examples=lambda: _unrotated_examples(),
    )
)
# The output's inverse rope in the attention launch (sparse_attention_unrotated); False: the two
# launches (benchmarks/bench_model.py --separate-launches: an A/B switch).
UNROTATES = True


def _rows_examples() -> list[dict]:
    """bf16 launches of the rows kernel at both head dims it takes (16 and 32 heads)."""
    key, calls = mx.random.key(8), []
    for H, D in ((16, 512), (32, 256)):
        B, S, W, T, N = 1, 2, 4, 5, 20
        k = mx.random.split(key, 4)
        q = mx.random.normal((B, S, H, D), key=k[0]).astype(mx.bfloat16)
        window = mx.random.normal((B, W, D), key=k[1]).astype(mx.bfloat16)
        pool = mx.random.normal((B, T, D), key=k[2]).astype(mx.bfloat16)
        indices = mx.random.randint(-1, W + T, (B, S, N), key=k[3]).astype(mx.int32)
        calls.append(_launch_args(q, window, pool, indices, mx.zeros((H,)), 0.0625, "rows"))
    return calls


def rows_refusal(q, window, pool) -> str | None:
    """Why the rows kernel does not take this call, or None: it needs tensor cores (CUDA), bf16
    q and keys, a head dim of 256 or 512 and whole blocks of 16 heads."""
    if backend() != "cuda":
        return f"{backend()}: no tensor-core MMA in the kernel bodies"
    if not q.dtype == window.dtype == pool.dtype == mx.bfloat16:
        return f"q, window, pool must be bf16, got {q.dtype}, {window.dtype}, {pool.dtype}"
    if q.shape[3] not in (256, 512) or q.shape[2] % _ROWS_HEADS:
        return f"heads x dim {q.shape[2]} x {q.shape[3]}: whole blocks of {_ROWS_HEADS} heads, dim 256 or 512"
    return None


def _run(variant: str, q, window, pool, indices, sinks, scale: float) -> mx.array:
    return _KERNELS[variant](**_launch_args(q, window, pool, indices, sinks, scale, variant))[0]


def unrotated_args(q, window, pool, indices, sinks, scale: float, period, offset, dtype, variant: str) -> dict:
    """sparse_attention_unrotated call kwargs: the `variant` kernel's (serial or parallel) with the
    rope's inputs (period [D / 2] float32, offset a 0-d int32) and its output in dtype."""
    args = _launch_args(q, window, pool, indices, sinks, scale, variant)
    args["inputs"] += [period, offset]
    args["output_dtypes"] = [dtype]
    args["template"] += [("GROUPS", _GROUPS[variant]), ("T", dtype)]
    return args


def _unrotated_examples() -> list[dict]:
    calls = []
    for variant in ("serial", "parallel"):
        for call in _examples(variant)[:2]:
            q = call["inputs"][0]
            period = mx.full((q.shape[-1] // 2,), 64.0)
            window, pool, indices, sinks = call["inputs"][1:5]
            calls.append(
                unrotated_args(q, window, pool, indices, sinks, 0.0625, period, mx.array(3, mx.int32), q.dtype, variant)
            )
    return calls


# ---------------------------------------------------------------------------------------------
# Variant selection and statistics (per process)

_default_variant: str | None = None
_counts: Counter = Counter()  # variant that ran -> calls ("reference" on the CPU path)
_reference_reasons: Counter = Counter()
_auto_choices: dict[tuple, str] = {}
_auto_timings: dict[tuple, dict[str, float]] = {}  # shape class -> variant -> median s per call
_parallel_refusals: dict[tuple, str] = {}  # kernel instance -> why the backend refused it


def parse_variant(name: str, source: str = "variant") -> str:
    """'serial' | 'parallel' | 'rows' | 'auto' from user text (case and surrounding blanks ignored)."""
    value = str(name).strip().lower()
    if value not in VARIANTS:
        raise ValueError(f"sparse_attention: {source} must be one of {', '.join(VARIANTS)}; got {name!r}")
    return value


def set_default_variant(name: str | None) -> None:
    """Default for calls without ``variant=`` (the CLI ``--attention``); None: back to the env."""
    global _default_variant
    _default_variant = None if name is None else parse_variant(name)


def set_tuning(variant: str, **constants: int) -> None:
    """Set compile-time tuning constants of one kernel (TUNABLE names and values); they change
    speed, never bytes. Earlier ``auto`` choices are forgotten (they were timed without them)."""
    if variant not in _TUNING:
        raise ValueError(f"sparse_attention: tuning is per kernel, serial or parallel; got {variant!r}")
    for name, value in constants.items():
        if name not in TUNABLE or value not in TUNABLE[name]:
            raise ValueError(
                f"sparse_attention: tuning {name}={value!r} is not one of { {k: list(v) for k, v in TUNABLE.items()} }"
            )
    _TUNING[variant].update(constants)
    _auto_choices.clear()
    _auto_timings.clear()


def tuning() -> dict[str, dict[str, int]]:
    """The compile-time tuning constants of each kernel."""
    return {v: dict(c) for v, c in _TUNING.items()}


def default_variant() -> str:
    """The variant a call without ``variant=`` asks for; the environment is read at each call."""
    if _default_variant is not None:
        return _default_variant
    raw = os.environ.get(ENV_VAR, "")
    return parse_variant(raw, ENV_VAR) if raw.strip() else "auto"


def variant_counts() -> dict[str, int]:
    """Calls per variant that actually ran: {'serial', 'parallel', 'rows', 'reference'} -> n."""
    return {name: _counts[name] for name in ("serial", "parallel", "rows", "reference")}


def reset_variant_counts() -> None:
    _counts.clear()
    _reference_reasons.clear()


def reference_reasons() -> dict[str, int]:
    """Why calls took the plain-MLX path, with counts."""
    return dict(_reference_reasons)


def auto_choices() -> dict[tuple, str]:
    """Shape class -> variant that ``auto`` measured faster."""
    return dict(_auto_choices)


def auto_timings() -> dict[tuple, dict[str, float]]:
    """Shape class -> the medians (seconds per call) that ``auto`` decided on."""
    return {k: dict(v) for k, v in _auto_timings.items()}


def parallel_refusals() -> dict[tuple, str]:
    """Kernel instance (q dtype, kv dtype, D) -> why the backend refused the parallel kernel."""
    return dict(_parallel_refusals)


def _kernel_unavailable(q) -> str | None:
    """Why this call cannot use a kernel, or None."""
    if backend() == "cpu":
        return "cpu backend"
    B, S, H, D = q.shape
    if D not in _DIMS:
        return f"head dim {D}: the kernels take {', '.join(map(str, _DIMS))}"
    if B * S * H == 0:
        return "empty output"
    if B * S * H * _GROUPS["parallel"] * _LANES >= 2**31:
        return f"{B * S * H} (batch, row, head) blocks: over the 2^31-thread grid"
    return None


def _synthetic(B, S, H, D, W, T, N, q_dtype, kv_dtype):
    """Random inputs of one call shape (valid indices), from a fixed key."""
    k = mx.random.split(mx.random.key(0), 5)
    q = mx.random.normal((B, S, H, D), key=k[0]).astype(q_dtype)
    window = mx.random.normal((B, W, D), key=k[1]).astype(kv_dtype)
    pool = mx.random.normal((B, T, D), key=k[2]).astype(kv_dtype)
    if W + T:
        indices = mx.random.randint(0, W + T, (B, S, N), key=k[3]).astype(mx.int32)
    else:
        indices = mx.full((B, S, N), -1, mx.int32)
    sinks = mx.random.normal((H,), key=k[4])
    return q, window, pool, indices, sinks


def _parallel_refusal(q_dtype, kv_dtype, D: int) -> str | None:
    """Why the backend refuses the parallel pipeline for this instance, or None (probed once)."""
    key = (str(q_dtype), str(kv_dtype), D)
    if key not in _parallel_refusals:
        try:
            mx.eval(_run("parallel", *_synthetic(1, 1, 1, D, 1, 1, 1, q_dtype, kv_dtype), 1.0))
            _parallel_refusals[key] = ""
        except (RuntimeError, ValueError) as e:  # MLX maps C++ invalid_argument to ValueError
            if not any(s in str(e) for s in _LAUNCH_LIMIT_ERRORS):
                raise
            _parallel_refusals[key] = f"{backend()} refused the 256-thread parallel kernel: {e}"
    return _parallel_refusals[key] or None


def _bucket(n: int) -> int:
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _chain_seconds(variant: str, args, calls: int) -> float:
    """Seconds per launch of `calls` dependent launches: each call's output is the next call's q
    (cast back to q's dtype if needed), as consecutive layers depend on each other; independent
    launches could overlap on the GPU and measure throughput instead. The graph is built before
    the clock starts."""
    q, rest = args[0], args[1:]
    out = q
    for _ in range(calls):
        out = _run(variant, out if out.dtype == q.dtype else out.astype(q.dtype), *rest)
    t0 = time.perf_counter()
    mx.eval(out)
    return (time.perf_counter() - t0) / calls


def _shape_class(q, window, indices) -> tuple:
    """Calls that ``auto`` treats alike: dtypes, D, H, and rows and key tiles to a power of two."""
    B, S, H, D = q.shape
    key_tiles = -(-indices.shape[2] // 64)
    return (str(q.dtype), str(window.dtype), D, H, _bucket(B * S), _bucket(key_tiles))


def _auto_variant(q, window, pool, indices) -> str:
    """The faster variant for this call's shape class (same bytes either way, so only speed
    decides), measured once per class on synthetic inputs of the class's own shape: its rows and
    key count at the top of their power-of-two buckets (rows capped at _AUTO_MAX_ROWS), this
    call's window and pool sizes (pool capped). Both variants are warmed up (compiled, caches
    filled), then timed as alternating chains of dependent launches, _AUTO_ROUNDS each, sized to
    about _AUTO_CHAIN_SECONDS; the medians decide. parallel is kept unless serial is faster by
    more than _AUTO_MARGIN: when the launch cost of the host dominates, both measure alike while
    the GPU time of the parallel kernel is the shorter one for few rows."""
    H, D = q.shape[2:]
    W, T = window.shape[1], pool.shape[1]
    shape_class = _shape_class(q, window, indices)
    if shape_class in _auto_choices:
        return _auto_choices[shape_class]
    if _parallel_refusal(q.dtype, window.dtype, D) is not None:
        _auto_choices[shape_class] = "serial"
        return "serial"
    *_, rows, key_tiles = shape_class
    args = (
        *_synthetic(
            1, min(rows, _AUTO_MAX_ROWS), H, D, W, min(T, _AUTO_MAX_POOL), 64 * key_tiles, q.dtype, window.dtype
        ),
        D**-0.5,
    )
    variants = ("parallel", "serial")
    for v in variants:
        _chain_seconds(v, args, _AUTO_WARMUP_CALLS)
    probe = min(_chain_seconds(v, args, _AUTO_PROBE_CALLS) for v in variants)
    calls = int(min(max(math.ceil(_AUTO_CHAIN_SECONDS / max(probe, 1e-9)), _AUTO_MIN_CALLS), _AUTO_MAX_CALLS))
    for v in variants:  # the timed chains' own graph shapes, once untimed
        _chain_seconds(v, args, calls)
    samples = {v: [] for v in variants}
    for r in range(_AUTO_ROUNDS):
        for v in variants if r % 2 == 0 else variants[::-1]:
            samples[v].append(_chain_seconds(v, args, calls))
    median = {v: statistics.median(t) for v, t in samples.items()}
    choice = "serial" if median["serial"] * _AUTO_MARGIN < median["parallel"] else "parallel"
    _auto_choices[shape_class] = choice
    _auto_timings[shape_class] = {v: median[v] for v in variants}
    return choice


def sparse_attention(q, window, pool, indices, sinks, scale: float, variant: str | None = None):
    """[B, S, H, D] float32. See the module docstring for the contract and variant selection."""
    _check(q, window, pool, indices, sinks, scale)
    wanted = _variant(q, window, pool, indices, variant)
    if wanted == "reference":
        return sparse_attention_reference(q, window, pool, indices, sinks, scale)
    return _run(wanted, q, window, pool, indices, sinks, float(scale))


def sparse_attention_unrotated(q, window, pool, indices, sinks, scale: float, period, offset, dtype, variant=None):
    """sparse_attention's output rounded to dtype and turned back by the angle of its query
    position (row s at offset + s; period: RoPE's whole-width periods [D / 2], offset a 0-d int32),
    as the rope kernel turns it (kernels/rope.py, inverse): one launch where the serial or the
    parallel kernel runs the call, the bytes of the two. None elsewhere (the CPU, the rows kernel,
    UNROTATES off): the caller runs the two."""
    _check(q, window, pool, indices, sinks, scale)
    if not UNROTATES or backend() == "cpu" or period.shape != (q.shape[-1] // 2,):
        return None
    if not isinstance(offset, mx.array) or offset.ndim or offset.dtype != mx.int32:
        return None
    if rope.refusal(q, None) is not None:  # where the rope kernel would not turn it either
        return None
    wanted = _variant(q, window, pool, indices, variant, count=False)
    if wanted not in ("serial", "parallel"):
        return None
    _counts[wanted] += 1
    call = unrotated_args(q, window, pool, indices, sinks, float(scale), period, offset, dtype, wanted)
    return UNROTATED(**call)[0]


def _variant(q, window, pool, indices, variant: str | None, count: bool = True) -> str:
    """The kernel that runs the call ('serial', 'parallel', 'rows'), or 'reference'; counted (in
    variant_counts) with `count`."""
    wanted = default_variant() if variant is None else parse_variant(variant)
    why_not = _kernel_unavailable(q)
    if why_not is not None:
        if count:
            _counts["reference"] += 1
            _reference_reasons[why_not] += 1
        return "reference"
    rows_runs = wanted in ("rows", "auto") and rows_refusal(q, window, pool) is None
    if wanted == "auto":
        many_rows = q.shape[0] * q.shape[1] >= ROWS_AUTO_MIN
        wanted = "rows" if rows_runs and many_rows else _auto_variant(q, window, pool, indices)
    if wanted == "parallel" and _parallel_refusal(q.dtype, window.dtype, q.shape[3]) is not None:
        wanted = "serial"
    if wanted == "rows" and not rows_runs:
        wanted = "serial"
    if count:
        _counts[wanted] += 1
    return wanted
