"""Where a merged launch's device time goes (issue 16): the launch beside the launches it replaces,
and beside ablated copies of itself, at Flash's shapes, on the GPU (CUDA).

An ablated copy is the kernel's source with one part edited out (the Sinkhorn's iterations, the
grid finish, the output's rotation): its outputs are wrong, its time says what that part costs.
Nothing here is a correctness check (tests/gpu/ holds those).

Times: each case launched `--repeats` times, one eval each, under CUPTI (torch.profiler, as
bench_model.py counts kernels); the median device µs per launch of every kernel the case ran.
Usage (GPU machine): python benchmarks/kernel_parts.py [--repeats 40] [--cold] [--sites-only] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import kernel_events  # noqa: E402

from mlx_dsv41 import metal_ext  # noqa: E402
from mlx_dsv41.kernels import backend, grid_finish  # noqa: E402
from mlx_dsv41.kernels import fp32_linear as fl  # noqa: E402
from mlx_dsv41.kernels import hyper_connections as hc  # noqa: E402
from mlx_dsv41.kernels import rope as rope_kernel  # noqa: E402
from mlx_dsv41.kernels import sparse_attention as sa  # noqa: E402
from mlx_dsv41.model.rope import RoPE  # noqa: E402

HC, D, ITERS, HC_EPS, NORM_EPS, EPS = 4, 5120, 20, 1e-6, 1e-20, 1e-6  # Flash's mHC site (hidden size 5,120)
H, HEAD, W, POOL, PICKS = 64, 512, 128, 300, 640  # Flash's attention

_EDITS: dict[str, tuple[str, list[tuple[str, str]]]] = {}  # ablated file -> (its source file, edits)
_read = metal_ext.read


def _edited_read(name: str) -> str:
    if name in _EDITS:
        base, edits = _EDITS[name]
        text = _read(base)
        for old, new in edits:
            if old not in text:
                raise SystemExit(f"ablation {name}: {old!r} is not in {base}")
            text = text.replace(old, new)
        return text
    return _read(name)


metal_ext.read = _edited_read


def ablated(kernel, suffix: str, edits: list[tuple[str, str]], header: str | None = None):
    """A copy of `kernel` named <name>_<suffix> with `edits` (old, new) applied to its body, or to
    its include `header` (the copy includes an edited copy of that header)."""
    name = f"{kernel.name}_{suffix}"
    includes = kernel.includes
    if header is None:
        _EDITS[f"{name}.metal"] = (f"{kernel.name}.metal", edits)
    else:
        _EDITS[f"{name}.metal"] = (f"{kernel.name}.metal", [])
        _EDITS[f"{suffix}_{header}"] = (header, edits)
        includes = tuple(f"{suffix}_{h}" if h == header else h for h in includes)
    return dataclasses.replace(kernel, name=name, includes=includes, _built={})


def _site_inputs(seed=0):
    rng = np.random.default_rng(seed)
    mix = (2 + HC) * HC
    streams = mx.array(rng.standard_normal((1, HC, D)).astype(np.float32)).astype(mx.bfloat16)
    fn = mx.array((rng.standard_normal((mix, HC * D)) * 4 / np.sqrt(HC * D)).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 1.5, 3).astype(np.float32))
    prev = mx.array(rng.uniform(0.2, 1.0, (1, mix)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(mx.bfloat16)
    y = mx.array(rng.standard_normal((1, D)).astype(np.float32)).astype(mx.bfloat16)
    m = mx.array(rng.uniform(0.2, 1.0, (1, mix)).astype(np.float32))
    mx.eval(streams, fn, base, scale, prev, weight, y, m)
    return streams, fn, base, scale, prev, weight, y, m


def _not_called(function: str) -> list[tuple[str, str]]:
    """The edit that skips every call of a template `function` in a kernel body."""
    return [(f"{function}<", f"if (false) {function}<")]


_NO_FINISH = _not_called("hc_mix_token")
_NO_EXPAND_FINISH = _not_called("hc_expand_site_token")
# the site's sums of squares not spread over the launch (its chains not run: the finish sums garbage)
_NO_CHAINS = _not_called("hc_expanded_chain")
# fn's fp32 rows not read (each lane's values made from its chunk index): what the weights' reads cost
_NO_FN_READ = [
    (
        "KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8, wf[u][j]);",
        "for (int e = 0; e < 4; e++) wf[u][j][e] = (float)(c + e + n);",
    ),
    (
        "KX_LOAD_X4(float4, (const KX_DEVICE float*)w + (u64)n * K + c * 8 + 4, wf[u][j] + 4);",
        "for (int e = 4; e < 8; e++) wf[u][j][e] = (float)(c + e + n);",
    ),
]


def site_cases() -> dict:
    streams, fn, base, scale, prev, weight, y, m = _site_inputs()
    counters = grid_finish.split_counters(1)
    site = (fn, base, scale, prev, weight, counters)
    consts = (HC_EPS, NORM_EPS, EPS)

    def with_iters(args, iters):
        args["template"] = [(k, iters if k == "ITERS" else v) for k, v in args["template"]]
        return args

    def site_call(kernel, iters=ITERS):
        return lambda: kernel(**with_iters(hc.site_args(streams, *site, ITERS, *consts), iters))

    def expand_site_call(kernel, iters=ITERS):
        return lambda: kernel(**with_iters(hc.expand_site_args(y, streams, m, *site, ITERS, *consts), iters))

    mm = fl.GEMV(**fl.gemv_args(streams.reshape(1, HC * D), fn))[0]
    mx.eval(mm)
    return {
        "fp32_gemv (the site's mm)": lambda: fl.GEMV(**fl.gemv_args(streams.reshape(1, HC * D), fn)),
        "hc_mix (1,024 threads)": lambda: hc.MIX(**hc.mix_args(mm, streams, base, scale, prev, weight, ITERS, *consts)),
        "hc_mix, 1 Sinkhorn iteration": lambda: hc.MIX(
            **with_iters(hc.mix_args(mm, streams, base, scale, prev, weight, ITERS, *consts), 1)
        ),
        "hc_expand": lambda: hc.EXPAND(**hc.expand_args(y, streams, m)),
        "hc_site": site_call(hc.SITE),
        "hc_site, 1 Sinkhorn iteration": site_call(hc.SITE, 1),
        "hc_site, no finish": site_call(ablated(hc.SITE, "nofinish", _NO_FINISH)),
        "hc_expand_site": expand_site_call(hc.EXPAND_SITE),
        "hc_expand_site, 1 Sinkhorn iteration": expand_site_call(hc.EXPAND_SITE, 1),
        "hc_expand_site, no finish": expand_site_call(ablated(hc.EXPAND_SITE, "nofinish", _NO_EXPAND_FINISH)),
        "hc_expand_site, no chains": expand_site_call(ablated(hc.EXPAND_SITE, "nochains", _NO_CHAINS)),
        "hc_expand_site, fn not read": expand_site_call(ablated(hc.EXPAND_SITE, "nofn", _NO_FN_READ, "fp32_gemv.h")),
    }


_TURN = "const RopeTurn t = rope_turn(L, KX_TO_F32(o.period[(d >> 1) + p]));"
_UNROTATED_ABLATIONS = {
    # the pair's cosine and sine not computed (t = (1, L)): the store's other work kept
    "no cos / sin": ablated(
        sa.UNROTATED, "nocossin", [(_TURN, "RopeTurn t; t.c = 1.0f; t.sn = L;")], "sparse_attention_unrotated.h"
    ),
    # the period not read and not inverted in double: theta = L (cos / sin kept)
    "no period": ablated(
        sa.UNROTATED,
        "noperiod",
        [(_TURN, "RopeTurn t; t.c = KX_ROPE_COS(L); t.sn = KX_ROPE_SIN(L);")],
        "sparse_attention_unrotated.h",
    ),
}


def attention_cases() -> dict:
    rng = np.random.default_rng(1)
    bf = lambda a: mx.array(a.astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    q = bf(rng.standard_normal((1, 1, H, HEAD)))
    window, pool = bf(rng.standard_normal((1, W, HEAD))), bf(rng.standard_normal((1, POOL, HEAD)))
    indices = mx.array(rng.integers(0, W + POOL, (1, 1, PICKS)).astype(np.int32))
    sinks = mx.array(rng.standard_normal(H).astype(np.float32))
    period, offset = RoPE(64, 160000.0).whole_width(HEAD), mx.array(40961, mx.int32)
    mx.eval(q, window, pool, indices, sinks, period)
    scale = HEAD**-0.5
    o = sa._run("parallel", q, window, pool, indices, sinks, scale)
    mx.eval(o)
    cases = {
        "rope (inverse, the attention output)": lambda: rope_kernel.run(o, offset, period, mx.bfloat16, 1, True, None)
    }
    for variant in ("serial", "parallel"):

        def args(v=variant):
            return sa.unrotated_args(q, window, pool, indices, sinks, scale, period, offset, mx.bfloat16, v)

        cases[f"sparse_attention {variant}"] = lambda v=variant: sa._run(v, q, window, pool, indices, sinks, scale)
        cases[f"sparse_attention_unrotated {variant}"] = lambda a=args: sa.UNROTATED(**a())
        for suffix, kernel in _UNROTATED_ABLATIONS.items():
            cases[f"sparse_attention_unrotated {variant}, {suffix}"] = lambda a=args, k=kernel: k(**a())
    return cases


def device_times(cases: dict, repeats: int, cold: bool = False) -> dict:
    """{case: {kernel: median µs}} under CUPTI, each case's launches `repeats` times; `cold`: after
    a read of 512 MiB before each (L2 and TLBs hold other data, as in a decode step, where a
    layer's weights pass between one launch of a kind and the next), that read's kernels left out."""
    from torch.profiler import ProfilerActivity, profile

    flush = mx.ones((128 << 20,), mx.float32) if cold else None
    out, skip = {}, set()
    if cold:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mx.eval(mx.sum(flush))
            mx.synchronize()
        skip = {name for name, _, _ in kernel_events(prof)}
    for label, call in cases.items():
        for _ in range(3):  # JIT, allocator
            mx.eval(call())
        mx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                if cold:
                    mx.eval(mx.sum(flush))
                mx.eval(call())
            mx.synchronize()
        times = defaultdict(list)
        for name, us, _ in kernel_events(prof):
            if name not in skip:
                times[name].append(us)
        out[label] = {k: round(statistics.median(v), 2) for k, v in times.items() if len(v) >= repeats // 2}
        print(f"{label:45s} " + ", ".join(f"{k} {v:.2f} µs" for k, v in out[label].items()), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cold", action="store_true", help="each launch after a 512 MiB read (see device_times)")
    p.add_argument("--sites-only", action="store_true", help="the mHC site launches only")
    args = p.parse_args()
    if backend() != "cuda":
        print("kernel_parts.py: needs MLX's CUDA backend (CUPTI times)", file=sys.stderr)
        return 2
    cases = site_cases() if args.sites_only else site_cases() | attention_cases()
    result = device_times(cases, args.repeats, args.cold)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_parts.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
