"""Index vectors and fills that do not depend on the data, made once and reused.

`mx.arange(n)` or `mx.full(...)` inside a forward is a primitive that runs at every step (an Arange or
a Full launch, plus a copy when a kernel needs a broadcast made contiguous). The functions here
return arrays that already hold their values (built with numpy: no launch, and nothing to evaluate
inside a compiled trace), so a step reads them instead; in a compiled step they are constants of
the trace (docs/design.md#graph-constants).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, wraps

import mlx.core as mx
import numpy as np

_NP = {
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.uint32: np.uint32,
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bool_: np.bool_,
}


def constant(make: Callable[..., np.ndarray]) -> Callable[..., mx.array]:
    """`make(*hashable args) -> numpy array` as a function returning its mx.array, made once per
    arguments."""

    @cache
    @wraps(make)
    def made(*args) -> mx.array:
        return mx.array(make(*args))

    return made


@constant
def arange(n: int, start: int = 0) -> np.ndarray:
    """int32 start .. start + n - 1."""
    return np.arange(start, start + n, dtype=np.int32)


@constant
def row_of(n: int, per_row: int) -> np.ndarray:
    """int32 [n]: item i // per_row, the row of item i when each row holds per_row consecutive items
    (a token's expert slots, a group-major stack's rows)."""
    return np.arange(n, dtype=np.int32) // per_row


@constant
def group_major(T: int, G: int) -> np.ndarray:
    """int32 [G * T]: row r = (g, t) = divmod(r, T) of a group-major stack is row t * G + g of the
    token-major [T, G] layout."""
    r = np.arange(G * T, dtype=np.int32)
    return (r % T) * G + r // T


def held(owner, store: str, key, make: Callable[[], object]):
    """`make()` kept on `owner` under `key` (in the dict attribute `store`: an underscore name, so
    never a module parameter), made once and evaluated where it is made. Evaluated, its arrays hold
    their values: made inside a compiled step's trace (no traced input reaches them) they are
    constants of it, where lazy they would be nodes every replay evaluates again
    (docs/design.md#constant-views)."""
    kept = getattr(owner, store, None)
    if kept is None:
        kept = {}
        setattr(owner, store, kept)
    if key not in kept:
        made = make()
        mx.eval(made)
        kept[key] = made
    return kept[key]


@cache
def full(shape: tuple[int, ...], value: float | int, dtype: mx.Dtype) -> mx.array:
    """`shape` filled with `value`, contiguous (a kernel input needs no copy)."""
    if dtype == mx.bfloat16:  # numpy has no bf16: the upper half of the float32 (a value bf16 holds)
        bits = np.full(shape, value, np.float32).view(np.uint32)
        if np.any(bits & 0xFFFF):
            raise ValueError(f"graph_constants.full: {value!r} is not a bfloat16 value")
        made = mx.array((bits >> 16).astype(np.uint16)).view(mx.bfloat16)
        mx.eval(made)  # the view evaluated once: left lazy, a compiled step would replay it
        return made
    return mx.array(np.full(shape, value, _NP[dtype]))


@cache
def array(values: tuple, dtype: mx.Dtype) -> mx.array:
    """A small constant array of `values` (e.g. a kernel's slot table)."""
    return mx.array(values, dtype)
