"""A ratio > 1 compressor's step front in one launch (docs/design.md#compressor-raw):

    open_group(position, pending, raw_kv, raw_gate, x=, wkv=, wgate=)   # dense weights: projected here
    open_group(position, pending, raw_kv, raw_gate, kv=, gate=)         # rows projected by their format
      -> (kv_rows, gate_rows, kv_ring, gate_ring), or None where the kernel does not apply

What `LayerCache.group_inputs` (docs/cache.md#open-groups) returns and writes for the fp32 rows
a = fp32(x) · wkvᵀ, g = fp32(x) · wgateᵀ of S new tokens at `position` (a 0-d int32) with `pending`
= position mod ratio rows of the open group held in the raw rings [B, Q, N]: the open group's rows
[B, pending + S, N] (the held rows, then the new ones) and the rings with the new rows written at
slots (position + s) mod Q. On a GPU, for up to fp32_linear.MAX_ROWS rows, that was a cast of x, two
GEMVs, two dynamic slice updates (an offset kernel and a copy each) and, with a group open, a
gather and a concatenation per ring and the slots' arithmetic. Dense weights (fp32, bf16, fp16; K
a multiple of 8) are projected in the launch with fp32_gemv's threadgroups and sums, so each row
has fp32_gemv's bytes; rows of another format (EXL3) come in as they are. The CPU, and what the
kernel does not take, returns None: the caller runs group_inputs, the reference.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_dsv41.kernels import Kernel, backend, fp32_linear, register, scalar_int32

KERNEL = register(
    Kernel(
        "compressor_raw",
        ("offset", "raw_kv", "raw_gate", "x", "wkv", "wgate", "kv", "gate"),
        ("kv_rows", "gate_rows", "kv_ring", "gate_ring"),
        includes=("fp32_gemv.h", "compressor_raw.h"),
        max_threads=fp32_linear.THREADS,
        examples=lambda: _examples(),
    )
)
# Whether the launch runs where it applies; False: the plain-MLX ring writes and rows, as before
# (benchmarks/bench_model.py --separate-compressor: the A/B).
ENABLED = True
_GIVEN_TEMPLATE = [("COLS", 1), ("SPLIT", 8), ("W", 0)]  # a launch without projections: one variant


def _check(pending: int, raw_kv, raw_gate, x, wkv, wgate, kv, gate) -> None:
    """One-line ValueErrors for inputs that do not fit together."""
    if raw_kv.ndim != 3 or raw_gate.shape != raw_kv.shape or {raw_kv.dtype, raw_gate.dtype} != {mx.float32}:
        raise ValueError(f"compressor_raw: raw rings must be fp32 [B, Q, N] alike, got {raw_kv.shape} {raw_gate.shape}")
    B, Q, N = raw_kv.shape
    if not 0 <= pending <= Q:
        raise ValueError(f"compressor_raw: {pending} pending rows do not fit a raw ring of {Q}")
    if (x is None) == (kv is None) or (x is None) != (wkv is None or wgate is None) or (kv is None) != (gate is None):
        raise ValueError("compressor_raw: give x, wkv and wgate, or kv and gate")
    if x is not None:
        K = x.shape[-1]
        if x.ndim != 3 or x.shape[0] != B or wkv.shape != (N, K) or wgate.shape != (N, K):
            raise ValueError(
                f"compressor_raw: x [{B}, S, K] and weights [{N}, K], got {x.shape}, {wkv.shape}, {wgate.shape}"
            )
    elif kv.ndim != 3 or kv.shape[::2] != (B, N) or gate.shape != kv.shape or {kv.dtype, gate.dtype} != {mx.float32}:
        raise ValueError(f"compressor_raw: rows must be fp32 [{B}, S, {N}] alike, got {kv.shape} {gate.shape}")


def takes(x, wkv, wgate, kv) -> bool:
    """Whether the kernel takes these rows here (ENABLED, a GPU, at most MAX_ROWS rows, fp32_gemv's weights)."""
    rows = math.prod((x if x is not None else kv).shape[:2])
    if not ENABLED or backend() == "cpu" or not 1 <= rows <= fp32_linear.MAX_ROWS:
        return False
    return x is None or (wkv.dtype == wgate.dtype and fp32_linear.takes_kernel(rows, wkv))


def args(
    position, pending: int, raw_kv, raw_gate, x=None, wkv=None, wgate=None, kv=None, gate=None, init_value=None, guard=0
) -> dict:
    """Launch kwargs (module docstring; `guard` rows past each output, flattened to rows, and
    `init_value`: tests)."""
    _check(pending, raw_kv, raw_gate, x, wkv, wgate, kv, gate)
    return _launch(position, pending, raw_kv, raw_gate, x, wkv, wgate, kv, gate, init_value, guard)


def _launch(position, pending: int, raw_kv, raw_gate, x, wkv, wgate, kv, gate, init_value=None, guard=0) -> dict:
    """`args` for inputs `_check` has passed."""
    B, Q, N = raw_kv.shape
    project = x is not None
    S = (x if project else kv).shape[1]
    rows_out = project or pending > 0  # given rows with no group open are the result as they are
    gemv = fp32_linear.gemv_launch(B * S, wkv) if project else None
    groups = gemv["grid"][0] // fp32_linear.THREADS if project else 0
    tasks = B * (Q + (pending + (0 if project else S) if rows_out else 0))
    template = gemv["template"] if project else [("M", B * S), *_GIVEN_TEMPLATE]
    shapes = [(B, pending + S, N)] * 2 + [raw_kv.shape] * 2
    return dict(
        inputs=[
            scalar_int32(position),
            raw_kv,
            raw_gate,
            *((x, wkv, wgate, raw_kv, raw_kv) if project else (raw_kv,) * 3 + (kv, gate)),
        ],
        output_shapes=[s if not guard else (math.prod(s[:2]) + guard, N) for s in shapes],
        output_dtypes=[mx.float32] * 4,
        grid=(fp32_linear.THREADS * 2 * (groups + tasks), 1, 1),
        threadgroup=(fp32_linear.THREADS, 1, 1),
        init_value=init_value,
        template=[*template, ("S", S), ("P", pending), ("PROJECT", int(project)), ("ROWS", int(rows_out))],
        absent=(("kv", "gate") if project else ("x", "wkv", "wgate")) + (() if rows_out else ("kv_rows", "gate_rows")),
    )


def open_group(position, pending: int, raw_kv, raw_gate, *, x=None, wkv=None, wgate=None, kv=None, gate=None):
    """See the module docstring. Without rows to write (given rows, no group open) the rows returned
    are kv and gate themselves."""
    _check(pending, raw_kv, raw_gate, x, wkv, wgate, kv, gate)
    if not takes(x, wkv, wgate, kv):
        return None
    outs = KERNEL(**_launch(position, pending, raw_kv, raw_gate, x, wkv, wgate, kv, gate))
    # without rows to write the launch leaves them out (Metal: unwritten stand-ins)
    return tuple(outs) if x is not None or pending else (kv, gate, *outs[2:])


def _examples():
    key = mx.random.key(12)
    rings = [mx.random.normal((2, 5, 64), key=k) for k in mx.random.split(key, 2)]
    x = mx.random.normal((2, 2, 256), key=mx.random.key(13))
    w = mx.random.normal((64, 256), key=mx.random.key(14))
    rows = mx.random.normal((2, 1, 64), key=mx.random.key(15))
    return [
        args(
            mx.array(7, mx.int32),
            1,
            *rings,
            x=x.astype(mx.bfloat16),
            wkv=w.astype(mx.bfloat16),
            wgate=w.astype(mx.bfloat16),
        ),
        args(mx.array(6, mx.int32), 0, *(r[:1] for r in rings), x=x[:1], wkv=w, wgate=w),
        args(mx.array(6, mx.int32), 0, *rings, x=x[:, :1], wkv=w.astype(mx.float16), wgate=w.astype(mx.float16)),
        args(mx.array(9, mx.int32), 1, *rings, kv=rows, gate=rows),
        args(mx.array(8, mx.int32), 0, *rings, kv=rows, gate=rows),
    ]
