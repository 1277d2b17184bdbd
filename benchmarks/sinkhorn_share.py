"""Sinkhorn's share of a decode step on the CPU (issue 16: the demo's 2x target), in one process.

    .venv/bin/python benchmarks/sinkhorn_share.py [--runs 3] [--steps 12]

1. Our demo checkpoint (compiled step) and mlx-lm's deepseek_v41 at the demo's dimensions
   (affine 4-bit, Engram dropped), each with the real Sinkhorn loop and with the loop replaced by
   the identity (a timing probe: those tokens mean nothing): ms per token, synchronous, median of
   --runs runs of --steps steps (bench_model.decode).
2. One mHC site's Sinkhorn ([1, 1, 4, 4], 20 iterations) compiled, as the model writes it (a
   reduction per normalisation) and with every row / column sum written elementwise over 16
   scalar arrays (the same additions in the same order): whether the bytes agree, MLX primitives
   after `mx.compile`'s fusion, and ms per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_model  # noqa: E402

from mlx_dsv41.kernels import hyper_connections  # noqa: E402


def _ms_per_token(build, runs: int, steps: int) -> float:
    model, args = build()
    prompt = mx.array(np.random.default_rng(7).integers(3, args.vocab_size - 200, (1, 32)), mx.int32)
    return statistics.median(
        bench_model.decode(lambda t, c: model(t, c), model.make_cache, prompt, steps, 2)["ms_per_token"]
        for _ in range(runs)
    )


def models(runs: int, steps: int) -> None:
    from mlx_lm.models import deepseek_v41 as mlx_lm_ds

    ours = lambda: bench_model.ours_demo(None)  # noqa: E731
    dims = ours()[1]
    theirs = lambda: (bench_model.mlx_lm_model(dims, 4, 0), dims)  # noqa: E731
    loops = [
        (hyper_connections, "sinkhorn", ours, "mlx_dsv41 demo, compiled"),
        (mlx_lm_ds, "_sinkhorn", theirs, "mlx-lm"),
    ]
    for module, name, build, label in loops:
        real = getattr(module, name)
        with_loop = _ms_per_token(build, runs, steps)
        setattr(module, name, lambda comb, *a, **k: comb)
        try:
            without = _ms_per_token(build, runs, steps)
        finally:
            setattr(module, name, real)
        print(f"{label}: {with_loop:.1f} ms/token, {without:.1f} without Sinkhorn ({with_loop - without:.1f} ms)")


def sinkhorn_scalars(comb: mx.array, iters: int, eps: float) -> mx.array:
    """hyper_connections.sinkhorn with each sum written out over 16 scalar arrays, in the
    reduction's order ((a + b) + c) + d."""
    hc = comb.shape[-1]
    c = [[comb[..., i, j] for j in range(hc)] for i in range(hc)]

    def normalise(lines):  # each line: the (i, j) cells of one row or one column
        for line in lines:
            total = c[line[0][0]][line[0][1]]
            for i, j in line[1:]:
                total = total + c[i][j]
            total = total + eps
            for i, j in line:
                c[i][j] = c[i][j] / total

    columns = [[(i, j) for i in range(hc)] for j in range(hc)]
    rows = [[(i, j) for j in range(hc)] for i in range(hc)]
    normalise(columns)
    for _ in range(iters - 1):
        normalise(rows)
        normalise(columns)
    return mx.stack([mx.stack(r, axis=-1) for r in c], axis=-2)


def one_site(iters: int = 20, eps: float = 1e-6) -> None:
    rng = np.random.default_rng(0)
    x = mx.softmax(mx.array(rng.standard_normal((1, 1, 4, 4)).astype(np.float32) * 3), axis=-1) + eps
    same = np.array_equal(
        np.array(hyper_connections.sinkhorn(x, iters, eps)), np.array(sinkhorn_scalars(x, iters, eps))
    )
    for label, fn in (("reductions", hyper_connections.sinkhorn), ("16 scalars", sinkhorn_scalars)):
        step = mx.compile(lambda v, fn=fn: fn(v, iters, eps))
        mx.eval(step(x))
        nodes = sum(bench_model.graph_primitives(step(x)).values())
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            mx.eval(step(x + 0))
            times.append(time.perf_counter() - t0)
        print(f"one site, {label}: {nodes} primitives compiled, {1e3 * statistics.median(times):.3f} ms")
    print(f"the two forms give the same bytes: {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    if a.runs < 1 or a.steps < 1:
        ap.error("--runs and --steps must be >= 1")
    mx.set_default_device(mx.cpu)
    os.environ["MLX_DSV41_COMPILE"] = "1"
    one_site()
    models(a.runs, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
