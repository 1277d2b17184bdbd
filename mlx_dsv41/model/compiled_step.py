"""A forward of a few tokens (decode, a speculative verify) compiled with `mx.compile`, traced once
per shape and replayed (docs/design.md, "Compiled decode step").

What makes a step replayable: every cache buffer keeps its shape from one step to the next
(LayerCache: fixed rings, a compressed capacity that doubles), all index arithmetic reads the
offset from an int32 array, and what Python decides per call (the open compression group,
`offset % ratio`; which buffers and inputs exist) is part of the trace key. A trace runs the
model's ordinary forward on the model's own cache objects with traced arrays bound into them;
afterwards the cache objects get the step's output arrays and their Python bookkeeping (offset,
ring bounds) is advanced outside the trace, so a replay, which runs no Python, leaves them exactly
as an eager call would.

Replaying a graph costs no Python per operation and fuses elementwise chains: MLX's host cost per
launch falls from ~5-13 µs to ~3-4 µs for a custom kernel and to ~1 µs for fused elementwise
pairs (benchmarks/profile_exl3.py --part host, H200). By default a GPU compiles steps of up to
MAX_TOKENS tokens and the CPU runs eagerly (its bytes are the project's CPU reference; the compiled
step gives the same bytes there: tests/test_compiled_step.py); MLX_DSV41_COMPILE=1 / 0 forces it
on / off. On the H200 it gives the eager greedy tokens and takes a Flash-shaped token from 135.5
to 60.9 ms (docs/benchmarks.md, eighth session).

The DSpark draft block (model/dspark.py) replays through the same `CompiledStep.run` under the same
setting (`compiles_draft`): it gives the eager bytes on the CPU (tests/test_compiled_draft.py) and
the eager tokens on the H200 (tests/gpu/test_compiled_draft_gpu.py, tenth session;
docs/dspark.md#compiled-draft).
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlx_dsv41.kernels import backend

MAX_TOKENS = 10  # batch x tokens: decode and DSpark verify steps (the EXL3 fused-expert limit)
ENV_VAR = "MLX_DSV41_COMPILE"
POSITION_LANES = 4  # a carried position's int32 copies: 16 bytes, more than MLX's small-array pool takes


def setting() -> str:
    """MLX_DSV41_COMPILE as set: "", "0" or "1" (anything else is refused)."""
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1; got {setting!r}")
    return setting


def compiles(tokens: int) -> bool:
    """Whether a forward over `tokens` (batch x length) tokens is run compiled."""
    forced = setting()
    if forced:
        return forced == "1" and tokens <= MAX_TOKENS
    return backend() != "cpu" and tokens <= MAX_TOKENS


def compiles_draft() -> bool:
    """Whether a DSpark draft block (model/dspark.py) is run compiled: as a decode step (by default on
    a GPU; MLX_DSV41_COMPILE=1 / 0 forces it; docs/design.md, "Compiled decode step")."""
    return compiles(1)


class CompiledStep:
    """`step(caches, inputs, embeddings, rows, live, capture)`: `forward(caches, position, inputs,
    embeddings, rows, live, capture)` run compiled (`forward` reads and updates the caches' arrays
    and advances them; it returns the logits, and with `capture` also the captured rows).

    `run` is the mechanism any replayable forward over LayerCaches uses (the model's step here, the
    DSpark draft block in model/dspark.py): a subclass says in `call_forward` what a trace runs."""

    # The position a step starts at comes from the step before it (an output of 4 equal int32, made
    # on the device) where the caches did not move since; the forward reads a 0-d view of it. MLX's
    # CUDA allocator keeps arrays made on the host, and outputs of at most 8 bytes, in managed
    # memory, which costs each kernel that reads one ~1 µs (docs/design.md#step-position).
    carries_position = True

    def __init__(self, forward):
        self._forward = forward
        self._fn = mx.compile(self._traced)
        self._caches: list | None = None
        self._next: tuple[int, mx.array] | None = None  # (offset, the last step's next position)

    def __call__(self, caches, inputs, embeddings, rows: dict, live, capture: bool = False):
        engram = tuple(sorted(rows))
        static = (engram, embeddings is not None, live is not None, capture)
        arrays = [inputs, *(rows[k] for k in engram), *(a for a in (embeddings, live) if a is not None)]
        result = self.run(caches, static, arrays, inputs.shape[1])
        return tuple(result) if capture else result[0]

    def call_forward(self, caches, position, static, arrays) -> list:
        """What a trace runs: the forward on `arrays` at `position`; its outputs as a list."""
        engram, has_embeddings, has_live, capture = static
        inputs, rest = arrays[0], list(arrays[1:])
        rows = {k: rest.pop(0) for k in engram}
        embeddings = rest.pop(0) if has_embeddings else None
        live = rest.pop(0) if has_live else None
        result = self._forward(caches, position, inputs, embeddings, rows, live, capture)
        return list(result) if capture else [result]

    def run(self, caches, static, arrays: list, advance: int) -> list:
        """`call_forward(caches, position, static, arrays)` compiled, traced once per `static`, the
        caches' step keys and buffer layout (and the arrays' shapes); the caches then hold the
        step's buffers and are advanced by `advance` tokens. Returns the forward's outputs."""
        saved = [c.bookkeeping() for c in caches]
        buffers = [c.step_arrays() for c in caches]
        layout = tuple(tuple(a is not None for a in b) for b in buffers)
        carry = advance if self.carries_position else None
        key = (tuple(c.step_key() for c in caches), layout, static, len(arrays), carry)
        offset = caches[0].offset
        if carry is not None and self._next is not None and self._next[0] == offset:
            position = self._next[1]
        else:
            position = mx.array([offset] * POSITION_LANES if carry is not None else offset, mx.int32)
        flat = [position, *arrays, *(a for b in buffers for a in b if a is not None)]
        self._caches = caches
        try:
            outputs = self._fn(key, *flat)
        except BaseException:
            for c, b in zip(caches, buffers):
                c.set_step_arrays(b)
            raise
        finally:
            self._caches = None
            for c, s in zip(caches, saved):
                c.restore_bookkeeping(s)
        if carry is not None:
            self._next, outputs = (offset + advance, outputs[0]), outputs[1:]
        held = sum(sum(present) for present in layout)
        result, it = outputs[: len(outputs) - held], iter(outputs[len(outputs) - held :])
        for c, present in zip(caches, layout):
            c.set_step_arrays([next(it) if p else None for p in present])
            c.advance(advance)
        return list(result)

    def _traced(self, key, position, *rest):
        _, layout, static, count, carry = key
        it = iter(rest[count:])
        for c, present in zip(self._caches, layout):
            c.set_step_arrays([next(it) if p else None for p in present])
        out = []
        if carry is not None:
            out, position = [position + carry], position[0]
        out += self.call_forward(self._caches, position, static, list(rest[:count]))
        for c, present in zip(self._caches, layout):
            arrays = c.step_arrays()
            if tuple(a is not None for a in arrays) != present:
                raise RuntimeError("a compiled step created a cache buffer; caches must be reserved first")
            out += [a for a in arrays if a is not None]
        return out
