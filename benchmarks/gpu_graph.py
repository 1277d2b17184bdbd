"""The graph a GPU decode step builds, counted on a machine without a GPU (issue 16: fewer launches).

Every op module is told the backend is "cuda" and every custom kernel call (mlx_dsv41.kernels.Kernel)
returns stand-in outputs (zeros that depend on the kernel's inputs: no compute primitive), as do
`mx.fast.rope` and `mx.fast.rms_norm` (one launch each on a GPU, a decomposition on the CPU), so the
model builds the graph it builds on the H200, kernel for kernel, on the CPU. Counted for one decode
step of the Flash-shaped model (flash_model.py, --layers, Engram off) after a short prompt:
- custom kernel launches by kernel name;
- the other compute primitives (MLX's own kernels: casts, copies, aranges, matmuls, ...) by name, in
  the eager graph and in the graph the compiled step replays (`mx.compile`'s fusion applied: its
  fused elementwise chains count once, as `Compiled`);
- for casts and aranges, the Python lines that create them (`--sites`);
- custom-kernel inputs that are views MLX will copy before the launch (a kernel takes row-contiguous
  inputs: transposes, strided slices and broadcasts become `copy_gg` launches on CUDA);
- views (no launch, but a graph node each) by name, and for the compiled step the replayed nodes
  that no step input reaches (docs/design.md#constant-views).
Nothing is evaluated but the prompt's prefill (stand-in zeros). The H200's own count (CUPTI) is in
bench_model.py; this is the tool for changing the graph between device sessions.

    .venv/bin/python benchmarks/gpu_graph.py --layers 4 [--sites] [--draft | --prefill N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import traceback
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_model  # noqa: E402
from count_ops import VIEWS  # noqa: E402

from mlx_dsv41 import graph_constants, kernels  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_COPIED_VIEWS = {"Transpose", "Broadcast", "AsStrided", "Slice"}
_FAST = ("rope", "rms_norm")


class Recorder:
    def __init__(self):
        self.launches = Counter()
        self.copied_inputs = Counter()
        self.sites = Counter()
        self.check_inputs = False  # look for custom-kernel inputs MLX copies (set for the counted step)
        self.route_experts = 0  # > 0: moe_route's stand-in spreads slots over this many experts


_PRIMITIVE = re.compile(r'(\d+) \[label ="([^"]+)", shape=rectangle\]')


def _dot(*arrays, **named) -> str:
    """mx.export_to_dot's text: primitives are `ID [label ="Name", shape=rectangle]` nodes."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays, **named)
    return buf.getvalue()


def _producer(a: mx.array) -> str | None:
    names = [name for _, name in _PRIMITIVE.findall(_dot(a))]
    return names[-1] if names else None


@contextlib.contextmanager
def gpu_graph_on_cpu(rec: Recorder):
    """Ops take their GPU paths; kernels return stand-ins and are counted."""
    saved_backend, saved_call = kernels.backend, kernels.Kernel.__call__
    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_dsv41") and getattr(mod, "backend", None) is saved_backend:
            patched.append(mod)
            mod.backend = lambda: "cuda"

    def stand_in(self, *, inputs, output_shapes, output_dtypes, **kw):
        rec.launches[self.name] += 1
        if rec.check_inputs:
            for a in inputs:
                p = _producer(a)
                if p in _COPIED_VIEWS:
                    rec.copied_inputs[f"{self.name}: {p}"] += 1
        outs = [graph_constants.full(tuple(s), 0, d) for s, d in zip(output_shapes, output_dtypes)]
        if self.name == "moe_route" and rec.route_experts:  # slot s of token t -> expert (t·k + s) mod E
            outs[0] = mx.array(np.arange(math.prod(output_shapes[0])).reshape(output_shapes[0]) % rec.route_experts)
            outs[0] = outs[0].astype(output_dtypes[0])
        return [mx.depends(o, list(inputs)) for o in outs]

    def fast(name):  # MLX's own fused kernels: one launch on a GPU, a decomposition on the CPU
        def launch(x, *args, **kw):
            rec.launches[f"mx.fast.{name}"] += 1
            out = graph_constants.full(tuple(x.shape), 0, x.dtype)
            return mx.depends(out, [x, *(a for a in args if isinstance(a, mx.array))])

        return launch

    saved_fast = {name: getattr(mx.fast, name) for name in _FAST}
    kernels.Kernel.__call__ = stand_in
    for name in _FAST:
        setattr(mx.fast, name, fast(name))
    try:
        yield
    finally:
        kernels.Kernel.__call__ = saved_call
        for name, fn in saved_fast.items():
            setattr(mx.fast, name, fn)
        for mod in patched:
            mod.backend = saved_backend


@contextlib.contextmanager
def call_sites(rec: Recorder):
    """Count the repository lines that create casts and aranges."""
    saved_astype, saved_arange = mx.array.astype, mx.arange

    def site() -> str:
        for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
            if str(REPO) in frame.filename and "benchmarks" not in frame.filename:
                return f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno}"
        return "?"

    def astype(self, dtype, *a, **k):
        if self.dtype != dtype:
            rec.sites[f"astype {site()}"] += 1
        return saved_astype(self, dtype, *a, **k)

    def arange(*a, **k):
        rec.sites[f"arange {site()}"] += 1
        return saved_arange(*a, **k)

    mx.array.astype, mx.arange = astype, arange
    try:
        yield
    finally:
        mx.array.astype, mx.arange = saved_astype, saved_arange


def constant_nodes(outputs, inputs) -> Counter:
    """The primitives of the graph of `outputs` that none of `inputs` reaches, by name: in a
    compiled replay, work every step repeats though its result never changes (a lazy array made
    from weights or fixed values: docs/design.md#constant-views)."""
    text = _dot(*outputs, **{f"input{i}": a for i, a in enumerate(inputs)})
    label = dict(_PRIMITIVE.findall(text))
    after: dict[str, list[str]] = {}
    for a, b in re.findall(r'^"?(\w+)"? -> "?(\w+)"?$', text, re.M):
        after.setdefault(a, []).append(b)
    reached, todo = set(), [f"input{i}" for i in range(len(inputs))]
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo += after.get(node, [])
    return Counter(name for node, name in label.items() if node not in reached)


@contextlib.contextmanager
def recorded_steps(record: dict):
    """Each compiled step's call: its arrays in (`record["inputs"]`) and out (`record["outputs"]`)."""
    from mlx_dsv41.model import compiled_step

    saved = compiled_step.CompiledStep.__init__

    def init(self, forward):
        saved(self, forward)
        fn = self._fn

        def recording(key, *flat):
            record["inputs"], record["outputs"] = flat, fn(key, *flat)
            return record["outputs"]

        self._fn = recording

    compiled_step.CompiledStep.__init__ = init
    try:
        yield record
    finally:
        compiled_step.CompiledStep.__init__ = saved


def primitives(*arrays) -> Counter:
    return Counter(name for _, name in _PRIMITIVE.findall(_dot(*arrays)))


def report(rec: Recorder, compiled: bool, layers: int, *arrays, step: dict | None = None) -> dict:
    """What a counted graph launches: custom kernels by name, other compute primitives by name, the
    kernel inputs MLX copies and the creating lines (empty where not recorded); for a compiled
    step (`step`: recorded_steps' record), the replayed primitives no step input reaches."""
    counted = primitives(*arrays)
    compute = Counter({k: v for k, v in counted.items() if k not in VIEWS and k != "CustomKernel"})
    return {
        "compiled": compiled,
        "layers": layers,
        "kernels": sum(rec.launches.values()),
        "kernel_launches": dict(rec.launches.most_common()),
        "mlx_compute": sum(compute.values()),
        "mlx_compute_by_name": dict(compute.most_common()),
        # views launch nothing, but MLX still evaluates each as a graph node (host time per step)
        "mlx_views_by_name": {k: v for k, v in counted.most_common() if k in VIEWS},
        "copied_kernel_inputs": dict(rec.copied_inputs.most_common()),
        "constant_nodes": dict(constant_nodes(step["outputs"], step["inputs"]).most_common()) if step else {},
        "sites": dict(rec.sites.most_common(40)),
    }


def _demo_model():
    import mlx_dsv41
    from mlx_dsv41.demo import ensure_demo

    return mlx_dsv41.load(ensure_demo(progress=False))[0]


def count(layers: int, prompt: int, compiled: bool, sites: bool, demo: bool = False) -> dict:
    os.environ["MLX_DSV41_COMPILE"] = "1" if compiled else "0"
    rec, step = Recorder(), {}
    with gpu_graph_on_cpu(rec), recorded_steps(step):
        model = _demo_model() if demo else flash_model.build(flash_model.flash_args(layers))
        layers = model.args.num_hidden_layers
        cache = model.make_cache()
        ids = mx.array(np.random.default_rng(0).integers(3, 500, (1, prompt)), mx.int32)
        mx.eval(model(ids, cache))
        token = mx.array([[7]], mx.int32)
        mx.eval(model(token, cache))  # a first step (a compiled run traces here)
        rec.launches.clear()
        rec.check_inputs = True
        with call_sites(rec) if sites else contextlib.nullcontext():
            logits = model(token, cache)
    return report(rec, compiled, layers, logits, step=step if compiled else None)


def count_draft(layers: int, prompt: int, compiled: bool) -> dict:
    """The same for one DSpark draft block (the Flash-shaped model with Flash's draft head) after a
    prefill: what `SpeculativeDecoder.draft` builds (the block's tokens and confidences)."""
    from mlx_dsv41.speculative import SpeculativeDecoder

    os.environ["MLX_DSV41_COMPILE"] = "1" if compiled else "0"
    rec = Recorder()
    with gpu_graph_on_cpu(rec):
        model = flash_model.build(flash_model.flash_args(layers, dspark=True))
        dec = SpeculativeDecoder(model, draft=model.args.dspark_block_size)
        dec.prefill(np.random.default_rng(0).integers(3, 1000, prompt).tolist())
        mx.eval(dec.draft().tokens)  # a first block (a compiled draft traces here)
        rec.launches.clear()
        d = dec.draft()
    return report(rec, compiled, layers, d.tokens, d.confidence)


def count_prefill(layers: int, prompt: int) -> dict:
    """The same for one prefill forward of `prompt` tokens from fresh caches (eager, as generate
    runs a prompt), with the router's stand-in spreading the slots over every held expert."""
    os.environ["MLX_DSV41_COMPILE"] = "0"
    rec = Recorder()
    with gpu_graph_on_cpu(rec):
        args = flash_model.flash_args(layers)
        model = flash_model.build(args)
        rec.route_experts = args.n_routed_experts
        ids = mx.array(np.random.default_rng(0).integers(3, 1000, (1, prompt)), mx.int32)
        rec.check_inputs = True
        logits = model(ids, model.make_cache())
    return report(rec, False, layers, logits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--sites", action="store_true", help="the lines creating casts and aranges (eager)")
    ap.add_argument("--draft", action="store_true", help="count a DSpark draft block instead of a decode step")
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="count an N-token prefill instead")
    ap.add_argument("--demo", action="store_true", help="count the demo checkpoint's decode step instead")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.prefill < 0 or a.layers < 3 or a.prompt < 1:
        print("error: --prefill must be >= 0, --layers >= 3, --prompt >= 1", file=sys.stderr)
        return 2
    mx.set_default_device(mx.cpu)
    if a.prefill:
        results = [count_prefill(a.layers, a.prefill)]
    elif a.draft:
        results = [count_draft(a.layers, a.prompt, False), count_draft(a.layers, a.prompt, True)]
    else:
        results = [count(a.layers, a.prompt, False, a.sites, a.demo), count(a.layers, a.prompt, True, False, a.demo)]
    what = f"{a.prefill}-token prefill" if a.prefill else "draft block" if a.draft else "step"
    for r in results:
        mode = "compiled" if r["compiled"] else "eager"
        counts = f"{r['kernels']} custom kernels, {r['mlx_compute']} MLX compute primitives"
        print(f"\n{mode} {what}, {r['layers']} layers: {counts}")
        print("  kernels:", r["kernel_launches"])
        print("  MLX:", r["mlx_compute_by_name"])
        print("  views (no launch, a node each):", r["mlx_views_by_name"])
        print("  kernel inputs MLX copies first:", r["copied_kernel_inputs"])
        if r["compiled"]:
            print("  replayed nodes no step input reaches:", r["constant_nodes"])
        for k, v in r["sites"].items():
            print(f"  {v:5d}  {k}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gpu_graph.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
