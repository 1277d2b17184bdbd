"""Graph size: MLX primitive operations evaluated per decoded token, per layer kind (tiny config).

One decode step is run on the tiny model (mlx_dsv41.synthetic: every layer role, two Engram layers)
after a 24-token prefill. Every part (embedding, each Engram module, each attention, each MoE, each
block's mHC + norms, the head) evaluates its inputs first, so the graph it builds, including its
cache writes and the state it publishes for later layers, is exactly its own; the primitives in
that graph are counted from `mx.export_to_dot` (rectangles). "views" are primitives that move no
data (reshape, broadcast, slice, ...); "compute" is the rest, a proxy for kernel launches.

    .venv/bin/python benchmarks/count_ops.py [--steps 2] [--out DIR]

Ratio-2 owners complete a group every other token, so two consecutive steps are counted.
"""

from __future__ import annotations

import argparse
import io
import json
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dsv41.synthetic import tiny_args, tiny_model

VIEWS = {
    "Reshape",
    "Broadcast",
    "Slice",
    "Squeeze",
    "ExpandDims",
    "Transpose",
    "AsStrided",
    "Depends",
    "StopGradient",
    "Split",
    "Flatten",
    "Unflatten",
    "View",
}


def primitives(*arrays) -> Counter:
    """Primitive name -> applications in the unevaluated graph of `arrays` (one DOT rectangle
    declaration per application; compiled primitives share an id across applications)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *[a for a in arrays if isinstance(a, mx.array)])
    return Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', buf.getvalue()))


def _arrays(tree) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for t in tree for a in _arrays(t)]
    if isinstance(tree, dict):
        return [a for t in tree.values() for a in _arrays(t)]
    if hasattr(tree, "arrays"):  # a LayerCache
        return tree.arrays()
    return []


class Counted(nn.Module):
    """Records the primitives `inner` adds to the graph: the graph of what it produced (outputs,
    its cache arrays, the shared state it published) minus the graph of its inputs (a sub-multiset
    of it), minus what nested Counted modules recorded meanwhile."""

    def __init__(self, inner, label: str, sink: list):
        super().__init__()
        self.inner, self.label, self.sink = inner, label, sink

    def __call__(self, *args):
        before = primitives(*_arrays(args))
        if not hasattr(self.sink, "inputs"):
            self.sink.inputs = before  # the first block's inputs: the embedding and initial mix
        first = len(self.sink)
        out = self.inner(*args)
        added = primitives(*_arrays(out), *_arrays(args)) - before
        for _, nested in self.sink[first:]:
            added = added - nested
        self.sink.append((self.label, added))
        return out


class _Sink(list):
    pass


def _kind(role) -> str:
    if role.mode == "window":
        return "window-only"
    if role.builds_candidates:
        return f"Full r{role.ratio} + candidate source"
    if role.mode == "full":
        return f"Full r{role.ratio}"
    if role.mode == "reindex":
        return f"Reindex r{role.ratio}"
    return f"Reuse r{role.ratio}"


def count_step(model, cache, token: mx.array) -> tuple[list[tuple[str, Counter]], Counter]:
    """Per-part primitive counts of one decode step, and the whole step's counts (one graph:
    logits + every cache array)."""
    sink = _Sink()
    original = model.layers
    for layer in original:
        role = model.args.role(layer.layer_id)
        layer.attn = Counted(layer.attn, f"attention: {_kind(role)}", sink)
        layer.ffn = Counted(layer.ffn, "MoE", sink)
        if role.engram:
            layer.engram = Counted(layer.engram, "Engram", sink)
    try:
        model.layers = [Counted(layer, "mHC + norms (per block)", sink) for layer in original]
        logits = model(token, cache)
        whole = primitives(logits, *[a for c in cache[: len(original)] for a in c.arrays()])
    finally:
        model.layers = original
        for layer in original:
            layer.attn, layer.ffn = layer.attn.inner, layer.ffn.inner
            if "engram" in layer:
                layer.engram = layer.engram.inner
    mx.eval(logits)
    parts = [("embedding", sink.inputs)] + list(sink)
    parts.append(("head (collapse, norm, fp32 head)", whole - sum((c for _, c in parts), Counter())))
    return parts, whole


def _sizes(c: Counter) -> np.ndarray:
    """[total, compute] primitive counts (compute = total - views)."""
    total = sum(c.values())
    return np.array([total, total - sum(v for k, v in c.items() if k in VIEWS)])


def _fmt(c: Counter) -> str:
    total, compute = _sizes(c)
    return f"{total} ({compute})"


ORDER = [
    "embedding",
    "Engram",
    "attention: window-only",
    "attention: Full r2",
    "attention: Reuse r2",
    "attention: Full r1 + candidate source",
    "attention: Reuse r1",
    "attention: Reindex r1",
    "MoE",
    "mHC + norms (per block)",
    "head (collapse, norm, fp32 head)",
]


def _moe_counts(top_k: int) -> Counter:
    """One token through a tiny MoE with `top_k` slots (the slot sum grows with k)."""
    from mlx_dsv41.model.moe import MoE

    moe = MoE(tiny_args(num_experts_per_tok=top_k))
    x = mx.random.normal((1, 1, moe.dim)).astype(mx.bfloat16)
    mx.eval(moe.parameters(), x)
    return primitives(moe(x))


def flash_estimate(steps) -> tuple[float, float]:
    """Σ over the 40 Flash layers of the per-kind counts measured here (attention kinds by role,
    MoE re-measured at top-6, mHC per block, Engram at 2 layers), plus embedding and head."""
    from mlx_dsv41.config import ModelArgs

    def mean(label):
        return np.mean([_sizes(c) for _, parts, _ in steps for lab, c in parts if lab == label], axis=0)

    moe6 = _sizes(_moe_counts(6))
    est = mean("embedding") + mean("head (collapse, norm, fp32 head)")
    for role in ModelArgs().roles:
        est = est + mean(f"attention: {_kind(role)}") + mean("mHC + norms (per block)")
        est = est + moe6
        if role.engram:
            est = est + mean("Engram")
    return tuple(est)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="consecutive decode steps to count")
    ap.add_argument("--out", type=Path, default=None, help="write count_ops.json here")
    opts = ap.parse_args()

    args = tiny_args()
    model = tiny_model(args, seed=0)
    cache = model.make_cache()
    mx.eval(model(mx.array(np.random.default_rng(0).integers(0, 159, (1, 24))), cache))
    steps = []
    for _ in range(opts.steps):
        pos = cache[0].offset
        parts, whole = count_step(model, cache, mx.array([[11 + pos % 7]]))
        steps.append((pos, parts, whole))

    print(
        f"MLX primitives per decoded token, tiny config ({args.num_hidden_layers} layers, hc_mult "
        f"{args.hc_mult}, {args.n_routed_experts} experts top-{args.num_experts_per_tok}, window "
        f"{args.sliding_window}, after a 24-token prefill). Cells: total (compute = total - views); "
        f"a/b where layers of the same kind differ.\n"
    )
    print("| part | " + " | ".join(f"token at position {pos}" for pos, _, _ in steps) + " |")
    print("|" + "---|" * (len(steps) + 1))
    report = {}
    for label in ORDER:
        cells = []
        for pos, parts, _ in steps:
            counts = [c for lab, c in parts if lab == label]
            cells.append(" / ".join(sorted({_fmt(c) for c in counts}, key=lambda t: int(t.split()[0]))))
            report.setdefault(label, {})[pos] = [dict(c) for c in counts]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| **whole decode step** | " + " | ".join(_fmt(w) for _, _, w in steps) + " |")
    flash = flash_estimate(steps)
    print(
        f"| **Flash layout estimate** (40 layers, top-6; per token, mean of the two steps) | "
        f"{flash[0]:.0f} ({flash[1]:.0f}) |"
    )
    for pos, parts, whole in steps:
        assert sum((c for _, c in parts), Counter()) == whole  # every primitive attributed once
        print(f"\nposition {pos}, most frequent primitives: " + ", ".join(f"{k} {v}" for k, v in whole.most_common(10)))
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "count_ops.json").write_text(
            json.dumps({"parts": report, "whole": {pos: dict(w) for pos, _, w in steps}}, indent=1)
        )


if __name__ == "__main__":
    main()
