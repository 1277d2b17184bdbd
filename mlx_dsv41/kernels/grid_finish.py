"""Launches whose last threadgroup finishes the others' work (docs/design.md#grid-finish).

Where the backend has a device-scope fence and atomics (KX_HAS_GRID_FINISH: CUDA), a launch can do
what needed a second launch: each threadgroup stores its part, then counts its arrival on a uint32
counter (metal_ext/grid_finish.h); the last to arrive sets the counter back to 0 and finishes (a
k-split EXL3 GEMV's sum, an mHC site's mixes, the router's choice) from every part, read through L2.
The finish is the same function as the second launch's body, so both give the same bytes. A
launch's counters are scratch state it leaves at 0; a module keeps its own (`held_counters`), so
two launches that may run at once never share one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants

# Backends on which a launch's last threadgroup may finish the others' work (KX_HAS_GRID_FINISH).
GRID_FINISH = {"cuda": True, "metal": False}


# Whether an mHC site (with the expand before it) and the router run as one launch each where they
# can (hc_site, hc_expand_site, moe_gate); False: apart, as before (benchmarks/bench_model.py
# --separate-launches: the A/B).
MERGES = True


def available(backend_name: str) -> bool:
    """Whether launches may finish themselves on backend `backend_name` (the caller's `backend()`)."""
    return GRID_FINISH.get(backend_name, False)


def merges(backend_name: str) -> bool:
    """Whether the launches that finish in their last threadgroup (`MERGES`: hc_site,
    hc_expand_site, moe_gate) run on `backend_name`."""
    return MERGES and available(backend_name)


# Where counters are made (benchmarks/bench_model.py --host-counters: the A/B).
COUNTERS_ON_DEVICE = True


def split_counters(size: int) -> mx.array:
    """FINISH counters: uint32 zeros, one per output block a launch finishes (a linear's 128-column
    blocks; an expert launch's (slot, block) pairs; a site's or a router's one), at least 4 (16
    bytes), evaluated where they are made, so a compiled step holds them as a constant; each launch
    leaves them at 0. Never under 16 bytes: MLX's CUDA backend serves arrays of at most 8 bytes
    from a pool of managed memory, and with one-word counters there a router's launch ran 3.6x
    slower on the H200 (docs/design.md#grid-finish); made on the device, where MLX keeps its outputs."""
    if COUNTERS_ON_DEVICE:
        counters = mx.zeros((max(size, 4),), mx.uint32)
    else:
        counters = mx.array(np.zeros(max(size, 4), np.uint32))
    mx.eval(counters)
    return counters


def held_counters(owner, size: int, name: str = "") -> mx.array:
    """FINISH counters of ``size`` (`split_counters`) kept on ``owner``, the module whose launches
    use them (an EXL3 linear; an expert projection, one per slot count; a Block's mHC sites, one per
    ``name``), made once per (name, size) (graph_constants.held: never a parameter)."""
    return graph_constants.held(owner, "_finish_counters", (name, size), lambda: split_counters(size))


def check_counters(counters: mx.array, size: int, what: str) -> None:
    """A launch's counters are uint32 and hold at least `size` words, or a one-line error."""
    if counters.dtype != mx.uint32 or counters.size < size:
        raise ValueError(f"{what}: counters must be uint32 [>= {size}], got {counters.dtype} {counters.shape}")


@graph_constants.constant
def no_counters() -> np.ndarray:
    """The counters input of a launch that finishes nothing (never read)."""
    return np.zeros(1, np.uint32)
