"""The indexer's scores and top-k of one decode row on the GPU: index_scores (one launch on CUDA,
docs/design.md#index-select) against the plain-MLX path the model runs otherwise (model/indexer.py:
~11 launches), at Flash's indexer shape (32 heads of 128, top-512, blocks of 8, 2,048 kept) and
growing entry counts T (a ratio-1 layer at context T; T > 512 makes the top-k select for real).

For each T and role (a plain Full layer; the candidate source, which also ranks blocks), the median
over --repeats of the wall time of --calls independent calls evaluated together, divided by the
calls (host launch cost included, as a decode step pays it), and whether the two paths pick the
same entries (FP4 queries and keys; the kernel's head sums are in its own order:
docs/numerics.md#index-scores). Results: a markdown table on stdout, bench_index_select.json in --out.

    python3 benchmarks/bench_index_select.py --out /tmp/bench_out   (on the GPU machine)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dsv41.kernels import backend
from mlx_dsv41.kernels import index_select as ix
from mlx_dsv41.model import indexer as ref
from mlx_dsv41.model.fake_quant import INDEXER

HI, DI, TOPK, BLOCK, KEEP, SCALE = 32, 128, 512, 8, 2048, 1 / 64


class _Owner:
    """Holds the kernel's FINISH counters, as an Indexer does."""


def _inputs(T: int, seed: int):
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    q = INDEXER(mx.random.normal((1, 1, HI, DI), key=k1).astype(mx.bfloat16))
    w = mx.random.normal((1, 1, HI), key=k2).astype(mx.bfloat16)
    keys = INDEXER(mx.random.normal((1, T, DI), key=k3).astype(mx.bfloat16))
    position = mx.array(T - 1, mx.int32)  # every entry visible (ratio 1)
    mx.eval(q, w, keys, position)
    return q, w, keys, position


def _reference(q, w, keys, position, k, build):
    visible = ref.visible_counts(position, 1, 1)
    scores = ref.index_scores(q, w.astype(mx.float32) * SCALE, keys, visible)
    blocks = ref.select_candidate_blocks(scores, visible, BLOCK, KEEP) if build else None
    return ref.select_topk(scores, k, visible), blocks


def _kernel(q, w, keys, position, k, build, owner):
    return ix.select(
        q, w, keys, position, ratio=1, k=k, scale=SCALE, block=BLOCK, keep=KEEP, build_candidates=build, owner=owner
    )


def _time(fn, calls: int, repeats: int) -> float:
    outs = [fn() for _ in range(2)]
    mx.eval(outs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[64, 512, 1024, 4096, 16384])
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if backend() == "cpu":
        raise SystemExit("error: bench_index_select.py times GPU kernels; run it on the GPU machine")
    owner, rows = _Owner(), []
    for T in a.entries:
        q, w, keys, position = _inputs(T, T)
        k = min(TOPK, T)
        for build in (False, True):
            got = _kernel(q, w, keys, position, k, build, owner)
            want = _reference(q, w, keys, position, k, build)
            # picks one path makes and the other does not (sets: both lists are ascending)
            picks = np.setdiff1d(np.array(got[0]), np.array(want[0])).size
            blocks = int(np.sum(np.array(got[1]) != np.array(want[1]))) if build else 0
            same = "yes" if picks == blocks == 0 else f"{picks} picks, {blocks} blocks differ"
            kernel_us = _time(lambda: _kernel(q, w, keys, position, k, build, owner), a.calls, a.repeats)
            reference_us = _time(lambda: _reference(q, w, keys, position, k, build), a.calls, a.repeats)
            rows.append(
                dict(
                    entries=T,
                    role="candidate source" if build else "full",
                    kernel_us=kernel_us,
                    reference_us=reference_us,
                    same_picks=same,
                )
            )
    print("| entries T | role | index_scores µs/call | plain MLX µs/call | speed-up | same picks |")
    print("|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['entries']} | {r['role']} | {r['kernel_us']:.1f} | {r['reference_us']:.1f} | "
            f"{r['reference_us'] / r['kernel_us']:.2f}x | {r['same_picks']} |"
        )
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_index_select.json").write_text(json.dumps(dict(calls=a.calls, repeats=a.repeats, rows=rows)))


if __name__ == "__main__":
    main()
