"""End-to-end speed of the model, measured side by side with mlx-lm's `deepseek_v41` in one process.

    python3 benchmarks/bench_model.py --out DIR [--quick]       # GPU: the Flash-shaped model
    python3 benchmarks/bench_model.py --out DIR --cpu           # CPU: the demo checkpoint
    ... --compiled                                              # ours also with the compiled step

--compiled adds a run of our model with the compiled decode step (MLX_DSV41_COMPILE=1; the
default is eager): its first traces JIT-compile fused kernels (minutes for the Flash shape under
CUDA; set MLX_PTX_CACHE_DIR to keep them), which the warm-up steps absorb.

GPU mode: the Flash-shaped model of benchmarks/flash_model.py (40 layers with Flash's roles,
16 routed experts held per layer, every linear the real 2.9 bpw EXL3 pack quantizes as EXL3 MUL1
at the pack's K per tensor class, the rest native; Engram off), then mlx-lm 0.32's
`deepseek_v41` at the same dimensions and roles, affine 4-bit (group 64), random weights.
CPU mode: the embedded demo checkpoint (`--demo`) against mlx-lm's model at the demo's
dimensions (Engram dropped: mlx-lm has none), affine 4-bit random weights (mlx-lm's bf16 experts
cannot run on the CPU: `gather_mm` is fp32-only there).

For each model (same prompt ids, greedy):
- decode: a --prompt-token prefill, then ms/token synchronous (`mx.eval` of each token) and
  pipelined (mlx-lm's loop: token i+1's graph is built and queued before token i is read), and
  the Python graph-build ms per token (time to return from the forward, nothing evaluated);
- kernels per token (GPU): CUDA kernels one decode step launches, counted by CUPTI through
  torch.profiler (kernel activity records of the whole process, graph-launched kernels
  included), and their summed device time; MLX primitives per token: the non-view nodes of the
  step's graph (`mx.export_to_dot`, as benchmarks/count_ops.py counts them);
- memory: MLX active memory after loading, peak during decode, process max RSS.
Results: a markdown table on stdout and bench_model.json in --out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_model  # noqa: E402 (benchmarks/ is not a package)

from mlx_dsv41.kernels import backend  # noqa: E402
from mlx_dsv41.model import compiled_step  # noqa: E402
from mlx_dsv41.testing import hf_config  # noqa: E402

VIEWS = {"Reshape", "Broadcast", "Slice", "Squeeze", "ExpandDims", "Transpose", "AsStrided",
         "Depends", "StopGradient", "Split", "Flatten", "Unflatten", "View"}


# ------------------------------------------------------------------------------- models


def ours_flash(a) -> tuple[object, object]:
    args = flash_model.flash_args(a.layers)
    return flash_model.build(args, a.seed), args


def ours_demo(a):
    import mlx_dsv41
    from mlx_dsv41.demo import ensure_demo

    model, _ = mlx_dsv41.load(ensure_demo(progress=False))
    return model, model.args


def mlx_lm_model(args, quantize_bits: int, seed: int):
    """mlx-lm's deepseek_v41 at `args`' dimensions and roles (no Engram), random weights, affine
    `quantize_bits` (group 64). Evaluated a few tensors at a time: the fp32 random initialisation
    of a Flash-sized layer is never held for more than one group."""
    from mlx_lm.models import deepseek_v41 as ref

    config = hf_config(args)
    config["text_config"].update(engram_layer_ids=[], engram_num_embeddings=[])
    mx.random.seed(seed)
    model = ref.Model(ref.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=64, bits=quantize_bits)
    params = [v for _, v in tree_flatten(model.parameters())]
    for i in range(0, len(params), 16):
        mx.eval(params[i : i + 16])
    return model


# ------------------------------------------------------------------------------- measurements


def graph_primitives(*arrays) -> Counter:
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', buf.getvalue()))


def cuda_kernels(step) -> dict | None:
    """Kernels launched by `step()` (CUPTI via torch.profiler), or None where unavailable."""
    if backend() != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        mx.synchronize()
    names, device_us = Counter(), 0.0
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA") or e.name.startswith(("Memcpy", "Memset")):
            continue
        names[e.name.split("<")[0][:60]] += 1
        device_us += float(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) or 0.0)
    return {"kernels": sum(names.values()), "device_ms": device_us / 1e3, "top": names.most_common(12)}


def decode(forward, make_cache, prompt: mx.array, steps: int, warmup: int) -> dict:
    """Greedy decode after a prefill: synchronous and pipelined timings, build time, kernels."""
    cache = make_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    logits = forward(prompt, cache)
    tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
    mx.eval(tok)
    out = {"prefill_s": time.perf_counter() - t0, "tokens": [int(tok.item())]}
    build, total = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = forward(tok, cache)
        nxt = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        if i >= warmup:
            build.append(t1 - t0)
            total.append(t2 - t0)
        tok = nxt
        out["tokens"].append(int(tok.item()))
    out["ms_per_token"] = 1e3 * statistics.median(total)
    out["build_ms_per_token"] = 1e3 * statistics.median(build)

    logits = forward(tok, cache)
    counted = graph_primitives(logits)
    out["primitives"] = sum(counted.values())
    out["primitives_compute"] = sum(v for k, v in counted.items() if k not in VIEWS)
    mx.eval(logits)
    tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
    mx.eval(tok)
    holder = {}

    def one_step():
        holder["tok"] = mx.argmax(forward(tok, cache)[:, -1:], axis=-1).astype(mx.int32)
        mx.eval(holder["tok"])

    out["cuda"] = cuda_kernels(one_step)
    tok = holder.get("tok", tok)
    if "tok" not in holder:
        one_step()
        tok = holder["tok"]

    # Pipelined as mlx-lm: build and queue token i+1 before reading token i.
    nxt = mx.argmax(forward(tok, cache)[:, -1:], axis=-1).astype(mx.int32)
    mx.async_eval(nxt)
    t0 = time.perf_counter()
    for _ in range(steps):
        cur = nxt
        nxt = mx.argmax(forward(cur, cache)[:, -1:], axis=-1).astype(mx.int32)
        mx.async_eval(nxt)
        int(cur.item())
    int(nxt.item())
    out["ms_per_token_pipelined"] = 1e3 * (time.perf_counter() - t0) / steps
    out["peak_GB"] = mx.get_peak_memory() / 1e9
    return out


def memory() -> dict:
    return {"active_GB": mx.get_active_memory() / 1e9,
            "rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def measure(label: str, build, a, prompt_len: int) -> dict:
    result = {"label": label}
    t0 = time.perf_counter()
    mx.reset_peak_memory()
    model, args = build()
    result["load_s"] = time.perf_counter() - t0
    result["load_peak_GB"] = mx.get_peak_memory() / 1e9
    result.update(memory())
    prompt = mx.array(np.random.default_rng(7).integers(3, args.vocab_size - 200, (1, prompt_len)), mx.int32)
    result["decode"] = decode(lambda ids, c: model(ids, c), model.make_cache, prompt, a.steps, a.warmup)
    print(f"{label}: {json.dumps(result['decode'])}", flush=True)  # each run as it ends
    del model
    mx.clear_cache()
    return result


# ------------------------------------------------------------------------------- report


def _f(v, fmt=".2f"):
    return "—" if v is None else format(v, fmt)


def table(runs: list[dict]) -> str:
    lines = ["| model | ms/token | ms/token pipelined | tokens/s (pipelined) | build ms/token | kernels/token "
             "| device ms/token | primitives/token (compute) | GPU GB active / peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        d = r.get("decode", {})
        cu = d.get("cuda") or {}
        tps = 1e3 / d["ms_per_token_pipelined"] if d.get("ms_per_token_pipelined") else None
        lines.append(" | ".join([
            f"| {r['label']}", _f(d.get("ms_per_token")), _f(d.get("ms_per_token_pipelined")), _f(tps, ".1f"),
            _f(d.get("build_ms_per_token")), str(cu.get("kernels", "—")), _f(cu.get("device_ms")),
            f"{d.get('primitives', '—')} ({d.get('primitives_compute', '—')})",
            f"{_f(r.get('active_GB'), '.1f')} / {_f(d.get('peak_GB'), '.1f')} |"]))
    theirs = [r for r in runs if r["label"].startswith("mlx-lm")]
    for r in runs:
        if theirs and r is not theirs[0]:
            a, b = r["decode"]["ms_per_token_pipelined"], theirs[0]["decode"]["ms_per_token_pipelined"]
            lines.append(f"\n{r['label']} / {theirs[0]['label']} tokens/s (pipelined): {b / a:.2f}x")
    return "\n".join(lines)


def ours_runs(label: str, build, a, prompt_len: int) -> list[dict]:
    """Our model eagerly, then (--compiled) with the compiled decode step."""
    runs = []
    for compiled in (False, True) if a.compiled else (False,):
        os.environ[compiled_step.ENV_VAR] = "1" if compiled else "0"
        runs.append(measure(label + (" compiled" if compiled else " eager"), build, a, prompt_len))
    os.environ.pop(compiled_step.ENV_VAR)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--cpu", action="store_true", help="the demo model on the CPU")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--compiled", action="store_true", help="also time our compiled decode step")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup = min(a.steps, 12), min(a.warmup, 2)
    if a.steps < 1 or a.warmup < 0 or a.prompt < 1:
        ap.error("--steps and --prompt must be >= 1, --warmup >= 0")
    if a.cpu:
        mx.set_default_device(mx.cpu)
    elif backend() == "cpu":
        print("bench_model: no MLX GPU here; timing the demo model on the CPU (--cpu)")
        a.cpu = True
    a.out.mkdir(parents=True, exist_ok=True)
    info = {"mlx": mx.__version__, "device": str(mx.default_device()), "host": platform.node(),
            "backend": backend(), "args": {k: str(v) for k, v in vars(a).items()}}
    try:
        import mlx_lm
        info["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        a.skip_mlx_lm = True
    runs = []
    if a.cpu:
        runs += ours_runs("mlx_dsv41 demo", lambda: ours_demo(a), a, min(a.prompt, 32))
        demo_args = ours_demo(a)[1]
        if not a.skip_mlx_lm:
            runs.append(measure("mlx-lm deepseek_v41 affine 4-bit (demo dims)",
                                lambda: (mlx_lm_model(demo_args, 4, a.seed), demo_args), a, min(a.prompt, 32)))
    else:
        runs += ours_runs("mlx_dsv41 Flash-shaped EXL3", lambda: ours_flash(a), a, a.prompt)
        if not a.skip_mlx_lm:
            args = flash_model.flash_args(a.layers)
            runs.append(measure("mlx-lm deepseek_v41 affine 4-bit",
                                lambda: (mlx_lm_model(args, 4, a.seed), args), a, a.prompt))
    text = table(runs)
    print(text)
    (a.out / "bench_model.json").write_text(json.dumps({"info": info, "runs": runs, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
