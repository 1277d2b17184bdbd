"""End-to-end speed of the model, measured side by side with mlx-lm's `deepseek_v41` in one process.

    python3 benchmarks/bench_model.py --out DIR [--quick]       # GPU: the Flash-shaped model
    python3 benchmarks/bench_model.py --out DIR --cpu           # CPU: the demo checkpoint
    python3 benchmarks/bench_model.py --out DIR --demo          # the demo checkpoint on this device
    ... --compiled                                              # ours also with the compiled step
    ... --no-dspark                                             # without the DSpark costs (on by default)
    ... --dspark-only [--verify-k 2,4,5]                        # only the DSpark costs
    ... --flash [--cpu]                                         # the Flash-shaped model even on the CPU
    ... --prefill 512 2048 8192 32768 [--prefill-chunk C ...] [--prefill-parts 2048]   # prefill only

--compiled adds a run of our model with the compiled decode step (MLX_DSV41_COMPILE=1; the
default is eager): its first traces JIT-compile fused kernels (minutes for the Flash shape under
CUDA; set MLX_PTX_CACHE_DIR to keep them), which the warm-up steps absorb.

GPU mode: the Flash-shaped model of benchmarks/flash_model.py (40 layers with Flash's roles,
16 routed experts held per layer, every linear the real 2.9 bpw EXL3 pack quantizes as EXL3 MUL1
at the pack's K per tensor class, the rest native; Engram off), then mlx-lm 0.32's
`deepseek_v41` at the same dimensions and roles, affine 4-bit (group 64), random weights.
CPU mode (and --demo on a GPU): the embedded demo checkpoint against mlx-lm's model at the demo's
dimensions (Engram dropped: mlx-lm has none), affine 4-bit random weights (mlx-lm's bf16 experts
cannot run on the CPU: `gather_mm` is fp32-only there).

For each model (same prompt ids, greedy):
- decode: a --prompt-token prefill, then ms/token synchronous (`mx.eval` of each token) and
  pipelined (mlx-lm's loop: token i+1's graph is built and queued before token i is read; the
  pace from the first token read to the last, `--steps` intervals), and the Python graph-build
  ms per token (time to return from the forward, nothing evaluated);
- kernels per token (GPU): CUDA kernels one decode step launches, counted by CUPTI through
  torch.profiler (kernel activity records of the whole process, graph-launched kernels
  included), and their summed device time, with the GPU's busy time (the union of the kernels'
  intervals: MLX's CUDA graphs run launches that do not depend on each other at once, which the
  sum counts twice) and the span (first start to last end of the synchronous step, the GPU's
  waits for the host included); MLX primitives per token: the non-view nodes of the
  step's graph (`mx.export_to_dot`, as benchmarks/count_ops.py counts them);
- memory: MLX active memory after loading, peak during decode, process max RSS. Loading itself
  (`--load DIR` or `--load-synthetic`, load_memory.py): the parameters by dtype, the peak while
  loading over them (target <= 1.05), the head's dtype and bytes.

DSpark (on by default; --no-dspark: off; --dspark-only: only these, no decode loop above): the
Flash-shaped model is built with Flash's DSpark head (flash_model.py: 3 stages, block 5, 16 of
the stages' 128 experts held, EXL3 K = 4 as the pack's mtp_bits); the demo has its own. After
the same prompt (`SpeculativeDecoder.prefill`), through the decoder's own methods, every repeat at
the same position p (the caches taken back between repeats, so each sees the same context):
- step: one decode step, the plain forward of x_{p+1} (`model(token, cache)`, as generate runs
  it), then `rewind(0)`; timed at p + 1 and (one token kept, then taken back) at p + 2, since
  ratio-2 compressors complete a group at every other position: "one step" is the mean of both;
- verify k, k = 0 .. block size (--verify-k: a list): `verify(d_1..d_k)`, one forward of 1 + k
  tokens with the hidden rows captured, then `rewind(k)`; ms, ratio to the step (target: k = 4
  <= 1.3x);
- draft: `draft()`, one draft block (block-size tokens whatever k), evaluated as `round` does
  (tokens and confidence); "1 ring row": the rings already hold p - 1, so it writes one entry,
  as a repeat does; "B + 1 ring rows" (reported, and the one the target and the estimate use):
  the draft cache in the state a round that accepted all B drafts leaves (its last B + 1 rows
  taken back and appended again with the cache's own trim / append, so the rings lag B + 1
  positions), the most ring entries a round's draft writes; % of the step (target <= 15 %).
Each: median ms over --steps repeats after --warmup, synchronous (`mx.eval` of each), CUDA kernels
of one call counted as above. On paper, at per-position acceptance a (default 0.8): draft j is
accepted only if drafts 1..j are (chain rule), so a round of k drafts emits
E = sum_{j=0..k} a^j = (1 - a^(k+1)) / (1 - a) tokens (the accepted drafts plus the main model's
own next token) in verify(k) + draft ms: tokens/s = 1000 E / (verify_k + draft), against
1000 / step for plain decoding; the accept / trim host work of a round is not in it.

Prefill (--prefill N ...; issue 17): only prefill is measured (no decode loop, no DSpark costs;
the Flash-shaped model is built without its draft head). Our model and mlx-lm's are both loaded and
each size is run on both in turn, so a run cut short keeps whole comparisons. For each prompt size N
(random ids, the same for both) and each --prefill-chunk C (default: generate's prefill step,
2048), a pass is what mlx-lm's generate_step does, and so our generate when it does not draft
(drafting adds the DSpark capture): the first N - 1 tokens C at a time through `model(ids, cache=)`
with the model's own caches (ours `make_cache`, mlx-lm `make_prompt_cache`), each chunk's cache
state evaluated and MLX's buffer cache cleared, then the last token alone and its greedy token
evaluated. Each size's first pass is a warm-up, reported as the first-run cost and left out of the
medians: the model's first one is cold (CUDA JIT, the attention variant's choice), and a later
size's compiles its new shapes (on the H200 a 2,048-token pass after a 512-token one spent 16 s of its 20 s on
them, in the last token's step); then --repeats (3, --quick 1)
passes from fresh caches: median prefill s (the N - 1 tokens), median and min time to first token
(TTFT: the whole pass), prompt tokens/s = N / TTFT (mlx-lm's prompt_tps), ours / mlx-lm per size,
and the pass's memory (`mx.get_peak_memory` after `mx.reset_peak_memory`: the peak and the peak
less what was active before, the prefill's own caches and temporaries). A size beyond
max_position_embeddings, or whose allocation fails (MemoryError, an MLX allocation error), is a
"did not fit" row with the reason, and the run goes on.
--prefill-parts N (our model, the first chunk size): where the time of an N-token prefill goes. An
unprofiled pass, on CUDA the kernels and device time of one more (CUPTI, as above), then one pass
with the calls of each part wrapped (class `__call__`s and the functions under the names the model
looks them up by, put back afterwards): a wrapped call evaluates its array inputs before its clock
starts and its outputs before it stops (`mx.eval`, `mx.synchronize`), and a wrapped call inside
another is taken out of the outer one's time, so each part's ms are exclusive and they add up to at
most the pass: the sparse-attention kernel, the indexer (scores, top-k, keys), the compressor's
pooling, the rest of attention, every linear (EXL3 / dense GEMMs: attention, indexer, compressor,
shared expert, head), the MoE router, the routed experts, the rest of the MoE, mHC, Engram, and
"other" (the pass less the parts). All three passes run eagerly (a compiled step cannot
synchronise inside), and the synchronisation itself makes the profiled pass slower (reported).

Alternating rounds (CPU and --demo, after the runs above; --rounds R, default 6, 0: none): the demo
(as the backend runs it by default; with --compiled eagerly and compiled) and mlx-lm decode
--round-steps tokens each in turn, R times, in one process (benchmarks/paired_rounds.py): median
ms/token synchronous and pipelined, each thread's CPU ms per token (the main thread apart from
MLX's stream and BLAS threads), and the median of the rounds' ratios to mlx-lm. The host's drift
falls on both alike, as it does not on runs one after the other (a shared 2-core machine's pace
moves by 1.5x within a minute).

Results: a markdown table on stdout and bench_model.json in --out (prefill: each row printed and
saved as it is measured, bench_model_prefill.md and bench_model_prefill.json).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
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
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_model  # noqa: E402 (benchmarks/ is not a package)
import paired_rounds  # noqa: E402
from count_ops import VIEWS  # noqa: E402

from mlx_dsv41 import kernels  # noqa: E402
from mlx_dsv41.kernels import backend, compressor_raw, grid_finish, index_select, sparse_attention  # noqa: E402
from mlx_dsv41.model import compiled_step  # noqa: E402
from mlx_dsv41.synthetic import hf_config  # noqa: E402

# ------------------------------------------------------------------------------- models


def ours_flash(a) -> tuple[object, object]:
    args = flash_model.flash_args(a.layers, dspark=a.dspark)
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


def kernel_timeline(intervals: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(busy, span) in ms of kernel intervals (start, end) in µs: the length of their union (MLX's
    CUDA graphs run launches that do not depend on each other at the same time, so the sum of
    the kernels' times overstates the GPU's) and first start to last end. (None, None) if empty."""
    if not intervals:
        return None, None
    busy, (cur_start, cur_end) = 0.0, sorted(intervals)[0]
    for start, end in sorted(intervals)[1:]:
        if start > cur_end:
            busy, cur_start, cur_end = busy + cur_end - cur_start, start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy / 1e3, (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e3


def kernel_events(prof):
    """(name, device µs, event) of each kernel a torch.profiler session recorded (copies and fills
    left out; the name cut at its template arguments, 60 characters)."""
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA") or e.name.startswith(("Memcpy", "Memset")):
            continue
        yield e.name.split("<")[0][:60], float(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) or 0.0), e


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
    names, times, spans, order = Counter(), Counter(), [], []
    for name, us, e in kernel_events(prof):
        names[name] += 1
        times[name] += us / 1e3
        if getattr(e, "time_range", None) is not None:
            spans.append((e.time_range.start, e.time_range.end))
            order.append((e.time_range.start, e.time_range.end, name))
    busy, span = kernel_timeline(spans)
    order.sort()
    return {
        "kernels": sum(names.values()),
        "device_ms": sum(times.values()),
        "busy_ms": busy,  # the union of the kernels' intervals: launches that ran at once count once
        "span_ms": span,  # the first kernel's start to the last one's end (gaps included)
        "top": names.most_common(12),
        "top_ms": [(n, round(ms, 3)) for n, ms in times.most_common(12)],
        "all": [(n, names[n], round(ms, 4)) for n, ms in times.most_common()],
        # the step's kernels in the order they started: (name, start µs from the first, µs); the
        # launches of one layer position side by side, and the gaps between them
        "timeline": [(n, round(s - order[0][0], 1), round(e - s, 1)) for s, e, n in order],
    }


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

    # Pipelined as mlx-lm: build and queue token i+1 before reading token i. Timed before the
    # kernel count: the profiler's first use in a process leaves work behind that slowed the
    # timed loop after it (a 17.7 ms step measured 30.6 ms right after CUPTI, fourteenth session).
    # Each step's host time is split three ways: building it (Python, a compiled replay), queueing
    # it (mx.async_eval: MLX encodes every node and commits its CUDA graphs on this thread) and
    # waiting for the token before it. A wait near zero means the host, not the GPU, sets the pace.
    # The pace is timed between tokens' arrivals (the first token read to the last: `steps`
    # intervals, the pipeline full throughout); until the twenty-seventh session the clock started
    # when the first token was queued, so a run the GPU paces counted steps + 1 tokens' device work
    # over `steps` (kept as ms_per_token_pipelined_from_queue).
    nxt = mx.argmax(forward(tok, cache)[:, -1:], axis=-1).astype(mx.int32)
    mx.async_eval(nxt)
    parts, arrivals = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        cur = nxt
        t1 = time.perf_counter()
        nxt = mx.argmax(forward(cur, cache)[:, -1:], axis=-1).astype(mx.int32)
        t2 = time.perf_counter()
        mx.async_eval(nxt)
        t3 = time.perf_counter()
        int(cur.item())
        arrivals.append(time.perf_counter())
        parts.append((t2 - t1, t3 - t2, arrivals[-1] - t3))
    int(nxt.item())
    arrivals.append(time.perf_counter())
    out["ms_per_token_pipelined"] = 1e3 * (arrivals[-1] - arrivals[0]) / steps
    out["ms_per_token_pipelined_from_queue"] = 1e3 * (arrivals[-1] - t0) / steps
    for i, name in enumerate(("build", "queue", "wait")):
        out[f"pipelined_{name}_ms"] = 1e3 * statistics.median(p[i] for p in parts)
    # Each step's whole time (build + queue + wait), so that a slow step shows apart from the pace:
    # the mean above holds every step, the parts' medians none of the slow ones.
    out["pipelined_steps_ms"] = [round(1e3 * sum(p), 3) for p in parts]
    out["peak_GB"] = mx.get_peak_memory() / 1e9

    def one_step():
        mx.eval(mx.argmax(forward(nxt, cache)[:, -1:], axis=-1))

    out["cuda"] = cuda_kernels(one_step)
    return out


def accepted_per_round(k: int, acceptance: float) -> float:
    """Expected tokens a round of k drafts emits at per-position acceptance a: draft j is kept
    only if drafts 1..j all are (a^j), plus the main model's own token after them:
    sum_{j=0..k} a^j = (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def dspark_costs(
    model, prompt: mx.array, steps: int, warmup: int, acceptance: float = 0.8, ks: list[int] | None = None
) -> dict:
    """One decode step, a verify of 1 + k tokens (k in `ks`, default 0 .. block) and one draft block,
    each timed at the same position through SpeculativeDecoder's own methods (module docstring)."""
    from mlx_dsv41.speculative import SpeculativeDecoder

    block = model.args.dspark_block_size
    if ks is not None and not all(0 <= k <= block for k in ks):
        raise SystemExit(f"error: --verify-k {ks}: a verify checks 0 .. {block} drafts (the block size)")
    ks = list(range(block + 1)) if ks is None else ks
    dec = SpeculativeDecoder(model, draft=block)
    t0 = time.perf_counter()
    dec.prefill(np.array(prompt).reshape(-1).tolist())
    out = {
        "block_size": block,
        "position": dec.cache[0].offset,
        "prefill_s": time.perf_counter() - t0,
        "repeats": steps,
        "warmup": warmup,
        "acceptance": acceptance,
    }
    first = dec.draft()
    mx.eval(first.tokens, first.confidence)
    drafted = first.tokens[:, 1:]  # d_1 .. d_B: what a verify of k checks is d_1 .. d_k

    def timed(call, undo, setup=lambda: None) -> dict:
        """Median ms of call() (evaluating what it returns) over `steps` repeats after `warmup`;
        setup() before and undo() after each, untimed; the kernels of one more call."""
        samples = []
        for i in range(warmup + steps):
            setup()
            t0 = time.perf_counter()
            mx.eval(call())
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
            undo()
        ran = []

        def counted():
            ran.append(mx.eval(call()))

        setup()
        cu = cuda_kernels(counted)
        if ran:  # (cuda_kernels runs nothing where it cannot count)
            undo()
        return {"ms": 1e3 * statistics.median(samples), "ms_min": 1e3 * min(samples), "cuda": cu}

    def step():  # the plain decode forward of x_{p+1} and its greedy choice
        return mx.argmax(model(mx.array([[dec.token]], mx.int32), dec.cache)[:, -1], axis=-1)

    def verify(k):  # logits and captured rows of [x_{p+1}, d_1 .. d_k]
        return lambda: dec.verify(drafted[:, :k])

    def lag(rows):  # the draft cache as a round that emitted `rows` tokens leaves it: rings behind
        def setup():
            held = dec.draft_cache.hidden[:, -rows:]
            dec.draft_cache.trim(rows)
            dec.draft_cache.append(held)

        return setup

    def draft():
        d = dec.draft()
        return d.tokens, d.confidence

    position = dec.cache[0].offset
    # The step at p + 1 and, one kept token later, at p + 2 (ratio-2 compressors complete a group
    # at every other position, and plain decoding pays both): the step is their mean.
    out["steps"] = [timed(step, lambda: dec.rewind(0))]
    mx.eval(step())
    out["steps"].append(timed(step, lambda: dec.rewind(0)))
    dec.rewind(0)
    for i, r in enumerate(out["steps"]):
        r["position"] = position + i
    step_ms = statistics.mean(r["ms"] for r in out["steps"])
    out["step"] = {"ms": step_ms, "ms_min": min(r["ms_min"] for r in out["steps"])}
    out["verify"] = []
    for k in ks:
        r = timed(verify(k), lambda k=k: dec.rewind(k))
        r.update(k=k, ratio=r["ms"] / step_ms)
        out["verify"].append(r)
    out["draft"] = []
    for rows in (1, block + 1):
        r = timed(draft, lambda: None, lag(rows))
        r.update(ring_rows=rows, pct_of_step=100 * r["ms"] / step_ms)
        out["draft"].append(r)
    if dec.cache[0].offset != position or dec.draft_cache.offset != position:
        raise RuntimeError("dspark_costs: a repeat did not return to its position")
    draft_ms = out["draft"][-1]["ms"]
    out["paper"] = []
    for v in [v for v in out["verify"] if v["k"] > 0]:
        e = accepted_per_round(v["k"], acceptance)
        tps = 1e3 * e / (v["ms"] + draft_ms)
        out["paper"].append(
            {
                "k": v["k"],
                "tokens_per_round": e,
                "round_ms": v["ms"] + draft_ms,
                "tokens_per_s": tps,
                "speedup": tps * step_ms / 1e3,
            }
        )
    by_k = {v["k"]: v for v in out["verify"]}
    out["targets"] = {
        "verify_k4_ratio": by_k[4]["ratio"] if 4 in by_k else None,
        "verify_k4_ok": by_k[4]["ratio"] <= 1.3 if 4 in by_k else None,
        "draft_pct_of_step": out["draft"][-1]["pct_of_step"],
        "draft_ok": out["draft"][-1]["pct_of_step"] <= 15,
    }
    return out


def memory() -> dict:
    return {
        "active_GB": mx.get_active_memory() / 1e9,
        "rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }


def measure(label: str, build, a, prompt_len: int) -> dict:
    result = {"label": label}
    t0 = time.perf_counter()
    mx.reset_peak_memory()
    model, args = build()
    result["load_s"] = time.perf_counter() - t0
    result["load_peak_GB"] = mx.get_peak_memory() / 1e9
    result.update(memory())
    prompt = mx.array(np.random.default_rng(7).integers(3, args.vocab_size - 200, (1, prompt_len)), mx.int32)
    if not getattr(a, "dspark_only", False):
        sparse_attention.reset_variant_counts()
        result["decode"] = decode(lambda ids, c: model(ids, c), model.make_cache, prompt, a.steps, a.warmup)
        # which attention kernels ran, and auto's timed choices: serial and parallel give the same
        # bytes (tests/gpu/test_sparse_attention.py), so greedy tokens must not depend on them
        result["decode"]["attention"] = {
            "counts": sparse_attention.variant_counts(),
            "auto": {str(k): v for k, v in sparse_attention.auto_choices().items()},
        }
        print(f"{label}: {json.dumps(result['decode'])}", flush=True)  # each run as it ends
    if getattr(a, "dspark", False) and getattr(model, "mtp", None):
        result["dspark"] = dspark_costs(model, prompt, a.steps, a.warmup, a.acceptance, a.verify_k)
        print(f"{label} DSpark: {json.dumps(result['dspark'])}", flush=True)
    elif getattr(a, "dspark", False) and hasattr(model, "mtp"):
        result["dspark"] = {"unavailable": model.dspark_unavailable}
    model = None  # frees the model (the decode closure reads it: rebound, not deleted)
    mx.clear_cache()
    return result


# ------------------------------------------------------------------------------- report


def _f(v, fmt=".2f"):
    return "—" if v is None else format(v, fmt)


def table(runs: list[dict]) -> str:
    lines = [
        "| model | ms/token | ms/token pipelined | tokens/s (pipelined) | build ms/token "
        "| pipelined host ms: build / queue / wait | kernels/token "
        "| device ms/token: sum (busy, span) | primitives/token (compute) | GPU GB active / peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    decoded = [r for r in runs if "decode" in r]  # (--dspark-only: none)
    if not decoded:
        lines = []
    for r in decoded:
        d = r["decode"]
        cu = d.get("cuda") or {}
        tps = 1e3 / d["ms_per_token_pipelined"] if d.get("ms_per_token_pipelined") else None
        lines.append(
            " | ".join(
                [
                    f"| {r['label']}",
                    _f(d.get("ms_per_token")),
                    _f(d.get("ms_per_token_pipelined")),
                    _f(tps, ".1f"),
                    _f(d.get("build_ms_per_token")),
                    " / ".join(_f(d.get(f"pipelined_{n}_ms")) for n in ("build", "queue", "wait")),
                    str(cu.get("kernels", "—")),
                    f"{_f(cu.get('device_ms'))} ({_f(cu.get('busy_ms'))}, {_f(cu.get('span_ms'))})",
                    f"{d.get('primitives', '—')} ({d.get('primitives_compute', '—')})",
                    f"{_f(r.get('active_GB'), '.1f')} / {_f(d.get('peak_GB'), '.1f')} |",
                ]
            )
        )
    theirs = [r for r in runs if r["label"].startswith("mlx-lm") and "decode" in r]
    for r in runs:
        if theirs and r is not theirs[0] and "decode" in r:
            a, b = r["decode"]["ms_per_token_pipelined"], theirs[0]["decode"]["ms_per_token_pipelined"]
            lines.append(f"\n{r['label']} / {theirs[0]['label']} tokens/s (pipelined): {b / a:.2f}x")
    for r in runs:
        steps = r.get("decode", {}).get("pipelined_steps_ms")
        if steps:
            median = statistics.median(steps)
            lines.append(
                f"\n{r['label']}: pipelined steps median {median:.2f} ms ({1e3 / median:.1f} tokens/s), "
                f"max {max(steps):.2f}, each: {', '.join(f'{t:.1f}' for t in steps)}"
            )
    for r in runs:
        if r.get("dspark"):
            lines += ["", dspark_table(r["label"], r["dspark"], r.get("active_GB"))]
    return "\n".join(lines).strip("\n")


def dspark_table(label: str, d: dict, active_GB: float | None = None) -> str:
    if "unavailable" in d:
        return f"{label}: no DSpark costs ({d['unavailable']})"
    kernels = lambda r: str((r.get("cuda") or {}).get("kernels", "—"))  # noqa: E731
    device = lambda r: _f((r.get("cuda") or {}).get("device_ms"))  # noqa: E731
    lines = [
        f"DSpark costs, {label} (position {d['position']}, median of {d['repeats']} after "
        f"{d['warmup']} warm-up, synchronous; {_f(active_GB, '.1f')} GB active after loading)",
        "",
        "| forward | ms (median) | ms (min) | x one step | kernels | device ms |",
        "|---|---|---|---|---|---|",
    ]
    s = d["step"]
    for r in d["steps"]:
        lines.append(
            f"| decode step at position {r['position']} | {r['ms']:.2f} | {r['ms_min']:.2f} "
            f"| {r['ms'] / s['ms']:.2f} | {kernels(r)} | {device(r)} |"
        )
    lines.append(f"| **one step** (their mean) | {s['ms']:.2f} | {s['ms_min']:.2f} | 1.00 | | |")
    for v in d["verify"]:
        lines.append(
            f"| verify 1 + {v['k']} | {v['ms']:.2f} | {v['ms_min']:.2f} | {v['ratio']:.2f} "
            f"| {kernels(v)} | {device(v)} |"
        )
    for r in d["draft"]:
        rows = f"{r['ring_rows']} ring row{'s' if r['ring_rows'] > 1 else ''}"
        lines.append(
            f"| draft block of {d['block_size']} ({rows}) | {r['ms']:.2f} | {r['ms_min']:.2f} "
            f"| {r['pct_of_step'] / 100:.2f} ({r['pct_of_step']:.0f} %) | {kernels(r)} | {device(r)} |"
        )
    t = d["targets"]
    ok = lambda v: "—" if v is None else ("met" if v else "NOT met")  # noqa: E731
    lines += [
        "",
        f"verify 1 + 4 / step: {_f(t['verify_k4_ratio'])}x (target <= 1.3: {ok(t['verify_k4_ok'])}); "
        f"draft / step: {t['draft_pct_of_step']:.1f} % (target <= 15 %: {ok(t['draft_ok'])})",
        "",
        f"On paper at {100 * d['acceptance']:.0f} % per-position acceptance: tokens/round = "
        f"(1 - a^(k+1)) / (1 - a), tokens/s = 1000 * tokens/round / (verify_k ms + draft ms); "
        f"plain decoding {1e3 / s['ms']:.2f} tokens/s",
        "",
        "| k | tokens/round | round ms | tokens/s | x plain |",
        "|---|---|---|---|---|",
    ]
    for p in d["paper"]:
        lines.append(
            f"| {p['k']} | {p['tokens_per_round']:.2f} | {p['round_ms']:.2f} | {p['tokens_per_s']:.2f} "
            f"| {p['speedup']:.2f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- prefill


def default_chunk() -> int:
    """Prompt tokens per forward that our generate prefills with by default."""
    from mlx_dsv41.speculative import stream_generate

    return inspect.signature(stream_generate).parameters["prefill_step_size"].default


def _sync() -> None:
    if hasattr(mx, "synchronize"):
        mx.synchronize()


def random_prompt(vocab_size: int, n: int) -> mx.array:
    return mx.array(np.random.default_rng(7).integers(3, vocab_size - 200, (1, n)), mx.int32)


def prefill_pass(model, make_cache, ids: mx.array, chunk: int) -> tuple[dict, mx.array]:
    """One prefill from fresh caches as mlx-lm's generate_step runs it (and so our generate when it
    does not draft): all but the last token `chunk` at a time, each chunk's caches evaluated and
    MLX's buffer cache cleared; then the last token alone and its greedy choice evaluated.
    Returns (timings, the last position's logits)."""
    cache = make_cache()
    n = ids.shape[1]
    _sync()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for lo in range(0, n - 1, chunk):
        model(ids[:, lo : min(lo + chunk, n - 1)], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
    t1 = time.perf_counter()
    logits = model(ids[:, n - 1 :], cache=cache)[:, -1, :]
    token = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
    mx.eval(token)
    t2 = time.perf_counter()
    peak = mx.get_peak_memory()
    timings = {"prefill_s": t1 - t0, "ttft_s": t2 - t0, "peak_GB": peak / 1e9}
    return timings | {"prefill_GB": max(0, peak - before) / 1e9}, logits


_NO_FIT = re.compile(r"alloc|memory|buffer size|\bOOM\b", re.IGNORECASE)


def prefill_row(model, make_cache, ids: mx.array, chunk: int, repeats: int, max_positions=None) -> dict:
    """Medians of `repeats` prefills of `ids` from fresh caches after a first pass (its time is the
    first-run cost, not in the medians), or why the size did not fit."""
    n = ids.shape[1]
    row = {"tokens": n, "chunk": chunk, "repeats": repeats}
    if max_positions is not None and n > max_positions:
        return row | {"did_not_fit": f"{n} tokens > max_position_embeddings {max_positions}"}
    try:
        row["first_run_s"] = prefill_pass(model, make_cache, ids, chunk)[0]["ttft_s"]
        runs = [prefill_pass(model, make_cache, ids, chunk)[0] for _ in range(repeats)]
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not _NO_FIT.search(str(e)):
            raise  # a failure, not a size that does not fit
        mx.clear_cache()
        return row | {"did_not_fit": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    mx.clear_cache()
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return row | {
        "prefill_s": statistics.median(r["prefill_s"] for r in runs),
        "ttft_s": ttft,
        "ttft_min_s": min(r["ttft_s"] for r in runs),
        "tokens_per_s": n / ttft,
        "prefill_GB": max(r["prefill_GB"] for r in runs),
        "peak_GB": max(r["peak_GB"] for r in runs),
    }


def measure_prefill(models: list[tuple], a):
    """Yields a row per (size, chunk, model), sizes in order, every model at a size before the next
    (so a run cut short still holds whole comparisons); each size's first pass is its warm-up. The
    mlx-lm row carries ours / mlx-lm prompt tokens/s."""
    for n in a.prefill:
        ids = random_prompt(models[0][3].vocab_size, n)
        for chunk in a.prefill_chunk:
            tps = {}
            for label, model, make_cache, args in models:
                row = {"label": label} | prefill_row(
                    model, make_cache, ids, chunk, a.repeats, args.max_position_embeddings
                )
                if "tokens_per_s" in row:
                    tps[label] = row["tokens_per_s"]
                ours = models[0][0]
                if label.startswith("mlx-lm") and ours in tps and label in tps:
                    row["ours_over_mlx_lm"] = tps[ours] / tps[label]
                yield row


class PartTimer:
    """Exclusive wall ms per part. A wrapped call evaluates its array inputs before its clock starts
    (their work belongs to the caller) and its outputs before it stops; the time of a wrapped call
    inside another is taken out of the outer one's, so nothing counts twice. A call that returns
    None (an op that declined: sparse_attention_unrotated off the GPU) is not counted as a call."""

    def __init__(self):
        self.ms, self.calls, self.stack = Counter(), Counter(), []

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            _settle(args, kwargs)
            self.stack.append(0.0)  # time of the calls nested in this one
            t0 = time.perf_counter()
            out = None
            try:
                out = fn(*args, **kwargs)
                _settle(out)
                return out
            finally:
                spent = time.perf_counter() - t0
                self.ms[part] += 1e3 * (spent - self.stack.pop())
                self.calls[part] += out is not None  # None: the op declined (its caller runs another)
                if self.stack:
                    self.stack[-1] += spent

        return timed


def _arrays(tree) -> list:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, nn.Module):  # the call's own module: its weights are not inputs to wait for
        return []
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [a for t in tree for a in _arrays(t)] if isinstance(tree, (list, tuple)) else []


def _settle(*trees) -> None:
    mx.eval(_arrays(trees))
    _sync()


GEMM = "linear GEMMs, EXL3 / dense (attention, indexer, compressor, shared expert, head)"


def part_targets() -> list[tuple[str, object, str]]:
    """(part, owner, name) of every call the profile times: module methods, and functions under the
    names the model's code looks them up by at call time."""
    from mlx_dsv41.exl3 import EXL3Linear
    from mlx_dsv41.exl3.experts import EXL3Experts, EXL3GroupedLinear
    from mlx_dsv41.model import attention, deepseek_v41
    from mlx_dsv41.model.compressor import Compressor
    from mlx_dsv41.model.engram import Engram
    from mlx_dsv41.model.indexer import Indexer
    from mlx_dsv41.model.moe import Gate, MoE
    from mlx_dsv41.quant import DenseExperts, DenseLinear, GroupedLinear, GroupSlices
    from mlx_dsv41.quant.mx_experts import MXExperts
    from mlx_dsv41.quant.official import MXLinear

    linears = (nn.Linear, nn.QuantizedLinear, DenseLinear, MXLinear, GroupedLinear, GroupSlices, EXL3Linear)
    mhc, engram = "mHC: site (collapse + norm, mixes), expand", "Engram: host hash, row reads, gate"
    targets = [
        ("sparse attention kernel", attention, "sparse_attention"),
        ("sparse attention kernel", attention, "sparse_attention_unrotated"),
        ("indexer: scores, top-k, keys (its GEMMs apart)", Indexer, "__call__"),
        ("indexer: scores, top-k, keys (its GEMMs apart)", Indexer, "keys"),
        ("compressor: pooling (its GEMMs apart)", Compressor, "__call__"),
        ("attention, the rest: RoPE, norms, FP8/FP4 fake quant, cache writes", attention.Attention, "__call__"),
        *[(GEMM, cls, "__call__") for cls in (*linears, EXL3GroupedLinear)],
        ("MoE router", Gate, "__call__"),
        *[("MoE routed experts", cls, "__call__") for cls in (EXL3Experts, DenseExperts, MXExperts)],
        ("MoE, the rest: slot sum, shared-expert SwiGLU", MoE, "__call__"),
        *[(mhc, deepseek_v41, name) for name in ("hc_site", "expand_site", "formed", "collapse_norm")],
        (engram, Engram, "__call__"),
        (engram, deepseek_v41.Model, "_engram_inputs"),
    ]
    return [t for t in targets if t[2] in vars(t[1])]  # an inherited method is timed where it is defined


@contextlib.contextmanager
def timed_parts(timer: PartTimer):
    saved = []
    try:
        for part, owner, name in part_targets():
            saved.append((owner, name, vars(owner)[name]))
            setattr(owner, name, timer.wrap(part, vars(owner)[name]))
        yield timer
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def prefill_parts(model, make_cache, ids: mx.array, chunk: int) -> dict:
    """Where one prefill's time goes: a warm-up pass (the JIT's compiles), an unprofiled pass (the
    reference), on CUDA its kernels and device time (CUPTI), then a pass with every part timed
    (PartTimer); all eager (a compiled step cannot synchronise inside)."""
    with paired_rounds.environment({compiled_step.ENV_VAR: "0"}):
        prefill_pass(model, make_cache, ids, chunk)
        reference = prefill_pass(model, make_cache, ids, chunk)[0]
        cuda = cuda_kernels(lambda: prefill_pass(model, make_cache, ids, chunk))
        with timed_parts(PartTimer()) as timer:
            profiled = prefill_pass(model, make_cache, ids, chunk)[0]
    total = 1e3 * profiled["ttft_s"]
    names = list(dict.fromkeys(p for p, _, _ in part_targets()))
    parts = [{"part": p, "ms": timer.ms[p], "calls": timer.calls[p], "share": timer.ms[p] / total} for p in names]
    other = total - sum(p["ms"] for p in parts)
    return {
        "tokens": ids.shape[1],
        "chunk": chunk,
        "total_ms": total,
        "unprofiled_ms": 1e3 * reference["ttft_s"],
        "parts": parts,
        "other_ms": other,
        "other_share": other / total,
        "cuda": cuda,
    }


PREFILL_HEADER = [
    "| model | prompt tokens | chunk | prefill s (all but the last token) | TTFT s (median) | TTFT s (min) "
    "| prompt tokens/s | ours / mlx-lm | first run s (cold) | prefill GB (peak - before) | peak GB |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def prefill_line(r: dict) -> str:
    head = f"| {r['label']} | {r['tokens']} | {r['chunk']} |"
    if "did_not_fit" in r:
        return f"{head} did not fit: {r['did_not_fit']} | | | | | | | |"
    cells = [
        _f(r["prefill_s"], ".3f"),
        _f(r["ttft_s"], ".3f"),
        _f(r["ttft_min_s"], ".3f"),
        _f(r["tokens_per_s"], ".1f"),
        _f(r.get("ours_over_mlx_lm"), ".2f") + ("x" if r.get("ours_over_mlx_lm") else ""),
        _f(r.get("first_run_s"), ".3f"),
        _f(r["prefill_GB"], ".3f"),
        _f(r["peak_GB"], ".3f"),
    ]
    return f"{head} {' | '.join(cells)} |"


def parts_table(label: str, d: dict) -> str:
    lines = [
        f"Where the time goes: {label}, {d['tokens']} tokens, chunk {d['chunk']} (one eager pass, inputs "
        "and outputs of each part evaluated and synchronised; exclusive times)",
        "",
        "| part | ms | share | calls |",
        "|---|---:|---:|---:|",
    ]
    for p in d["parts"]:
        lines.append(f"| {p['part']} | {p['ms']:.1f} | {100 * p['share']:.1f} % | {p['calls']} |")
    lines += [
        f"| other: embedding, final norm's cast, sampling, Python between parts | {d['other_ms']:.1f} "
        f"| {100 * d['other_share']:.1f} % | |",
        f"| **total (profiled pass)** | {d['total_ms']:.1f} | 100 % | |",
        "",
        f"The same prefill unprofiled: {d['unprofiled_ms']:.1f} ms (the profile's synchronisation adds "
        f"{100 * (d['total_ms'] / d['unprofiled_ms'] - 1):.0f} %)",
    ]
    cu = d.get("cuda")
    if cu:
        lines.append(f"Device time of one unprofiled pass (CUPTI): {cu['device_ms']:.1f} ms in {cu['kernels']} kernels")
    return "\n".join(lines)


def prefill_models(a) -> list[tuple]:
    """(label, model, cache factory, args): ours, then mlx-lm's unless skipped."""
    if (a.cpu or a.demo) and not a.flash:
        (model, args), label = ours_demo(a), "mlx_dsv41 demo"
    else:
        (model, args), label = ours_flash(a), "mlx_dsv41 Flash-shaped EXL3"
    models = [(label, model, model.make_cache, args)]
    if a.prefill and not a.skip_mlx_lm:  # (--prefill-parts alone profiles ours only)
        from mlx_lm.models.cache import make_prompt_cache

        theirs = mlx_lm_model(args, 4, a.seed)
        dims = " (demo dims)" if a.cpu and not a.flash else ""
        models.append((f"mlx-lm deepseek_v41 affine 4-bit{dims}", theirs, lambda: make_prompt_cache(theirs), args))
    return models


def prefill_main(a, info: dict) -> int:
    """--prefill / --prefill-parts: the rows as they are measured, printed and saved after each one."""
    report = {"info": info, "rows": [], "parts": None}
    lines: list[str] = []

    def emit(text: str) -> None:
        print(text, flush=True)
        lines.append(text)
        (a.out / "bench_model_prefill.md").write_text("\n".join(lines) + "\n")
        (a.out / "bench_model_prefill.json").write_text(json.dumps(report | {"table": "\n".join(lines)}, indent=1))

    models = prefill_models(a)
    if a.prefill:
        emit("\n".join(PREFILL_HEADER))
    for row in measure_prefill(models, a):
        report["rows"].append(row)
        emit(prefill_line(row))
    if a.prefill_parts:
        label, model, make_cache, args = models[0]
        ids = random_prompt(args.vocab_size, a.prefill_parts)
        report["parts"] = prefill_parts(model, make_cache, ids, a.prefill_chunk[0]) | {"label": label}
        emit("\n" + parts_table(label, report["parts"]))
    return 0


def ours_runs(label: str, build, a, prompt_len: int) -> list[dict]:
    """Our model as the backend runs it by default (GPUs: the compiled step; the CPU: eagerly), or
    with --compiled both ways, eager first; then each A/B run asked for (with --ab-first, the A/B
    runs first: the second run of a process has measured slower in every A/B, docs/benchmarks.md)."""
    runs = []

    def named() -> str:  # the label with the mode the environment sets now
        return f"{label} {'compiled' if compiled_step.compiles(1) else 'eager'}"

    default = named()

    def base():
        for setting in ({compiled_step.ENV_VAR: "0"}, {compiled_step.ENV_VAR: "1"}) if a.compiled else ({},):
            with paired_rounds.environment(setting):
                runs.append(measure(named(), build, a, prompt_len))

    def ab():
        for what, context in ab_contexts(a):
            with context() as changed:
                runs.append(measure(f"{default}, {what}".format(changed=changed), build, a, prompt_len))

    for part in (ab, base) if a.ab_first else (base, ab):
        part()
    return runs


def ab_contexts(a) -> list[tuple[str, Callable]]:
    """(what the run changes, a context manager factory doing it) of each A/B run asked for."""
    from mlx_dsv41.model import rope as rope_module

    contexts = []
    if a.whole_kernel_sources:
        contexts.append(("whole kernel sources", whole_kernel_sources))
    if a.inline_kernel_headers:
        contexts.append(("kernel headers inline", inline_kernel_headers))
    if a.exl3_tuning:
        contexts.append(("EXL3 {changed}", functools.partial(exl3_tuning, a.exl3_tuning)))
    switches = [  # (flag, what the run turns off, the switches it sets)
        (a.separate_ring_writes, "ring writes apart from the rope", [(rope_module, "WRITES_RING")]),
        (
            a.separate_launches,
            "sites, expands, router, ropes and attention output in separate launches",
            [(grid_finish, "MERGES"), (rope_module, "PAIRS"), (sparse_attention, "UNROTATES")],
        ),
        (a.host_counters, "FINISH counters made on the host", [(grid_finish, "COUNTERS_ON_DEVICE")]),
        (a.host_position, "position made on the host", [(compiled_step.CompiledStep, "carries_position")]),
        (a.indexer_reference, "the indexer's plain-MLX scores and top-k", [(index_select, "ENABLED")]),
        (a.attention_builds_index_list, "the attention's index list built by MLX", [(index_select, "LISTS")]),
        (a.kernel_stand_ins, "unused kernel arguments passed as stand-ins", [(kernels, "LEAVES_OUT_ABSENT")]),
        (a.separate_compressor, "the compressor's ring writes and rows by MLX", [(compressor_raw, "ENABLED")]),
    ]
    contexts += [(what, functools.partial(switched_off, off)) for flag, what, off in switches if flag]
    return contexts


@contextlib.contextmanager
def exl3_tuning(settings: list[str]):
    """kernels.exl3.TUNING with the given `field=value` changes (the launch plan of the EXL3 product
    kernels: e.g. dense_single_blocks=1 runs every dense linear as one exl3_gemv launch, k unsplit)."""
    from mlx_dsv41.kernels import exl3 as exl3_kernels

    saved = exl3_kernels.TUNING
    changes = {}
    for item in settings:
        name, _, value = item.partition("=")
        if name not in {f.name for f in dataclasses.fields(saved)} or not value.lstrip("-").isdigit():
            raise SystemExit(f"error: --exl3-tuning wants FIELD=INT with a field of kernels.exl3.Tuning, got {item!r}")
        changes[name] = int(value)
    exl3_kernels.TUNING = dataclasses.replace(saved, **changes)
    try:
        yield ", ".join(settings)
    finally:
        exl3_kernels.TUNING = saved


@contextlib.contextmanager
def switched_off(switches: list[tuple[object, str]]):
    """Each (owner, name) switch set to False inside (an A/B run: docs/benchmarks.md), restored after."""
    saved = [getattr(owner, name) for owner, name in switches]
    for owner, name in switches:
        setattr(owner, name, False)
    try:
        yield
    finally:
        for (owner, name), value in zip(switches, saved):
            setattr(owner, name, value)


@contextlib.contextmanager
def whole_kernel_sources():
    """Every kernel compiled from its whole headers (Kernel.whole_source, what Kernel.source prunes):
    the same launches and the same code, more text for MLX to hash per launch
    (docs/design.md#kernel-source-size)."""
    pruned = kernels.Kernel.source
    kernels.Kernel.source = kernels.Kernel.whole_source
    try:
        with rebuilt_kernels():
            yield
    finally:
        kernels.Kernel.source = pruned


@contextlib.contextmanager
def inline_kernel_headers():
    """Every CUDA kernel compiled with its header text in the source MLX hashes at each launch,
    instead of an #include of the file holding it (docs/design.md#kernel-header-files)."""
    from mlx_dsv41.kernels import header_files

    with paired_rounds.environment({header_files.ENV_VAR: header_files.INLINE}), rebuilt_kernels():
        yield


@contextlib.contextmanager
def rebuilt_kernels():
    """Every kernel built afresh inside (what MLX built from before is dropped) and after."""
    registry = kernels.load_all().values()
    for k in registry:
        k._built.clear()
    try:
        yield
    finally:
        for k in registry:
            k._built.clear()


def add_prefill_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prefill", type=int, nargs="+", default=[], metavar="N", help="prompt sizes to prefill")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        nargs="+",
        default=None,
        metavar="C",
        help=f"prompt tokens per forward (default {default_chunk()}, as generate; several: each timed)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed prefills per size (default 3, --quick 1)")
    ap.add_argument("--prefill-parts", type=int, default=None, metavar="N", help="where an N-token prefill's time goes")


def check_prefill_args(ap: argparse.ArgumentParser, a) -> None:
    """Prefill mode measures only prefill: the decode / DSpark options would be silently unused."""
    a.repeats = a.repeats if a.repeats is not None else 1 if a.quick else 3
    a.prefill_chunk = a.prefill_chunk or [default_chunk()]
    if not (a.prefill or a.prefill_parts):
        return
    if min(a.prefill + a.prefill_chunk + [a.repeats, a.prefill_parts or 1]) < 1:
        ap.error("--prefill sizes, --prefill-chunk, --repeats and --prefill-parts must be >= 1")
    if a.compiled or a.dspark_only:
        ap.error("--compiled / --dspark-only time decoding; --prefill measures prefill only")
    a.dspark = False  # the plain prefill never runs the draft head: not built (flash_model)


def load_main(a, info: dict) -> int:
    """Loading's memory (issue 16 item 5): parameters, peak, the head's dtype."""
    import load_memory

    path = a.load or load_memory.synthetic_checkpoint(a.out)
    result = load_memory.measure(path)
    text = load_memory.table(result)
    print(text, flush=True)
    (a.out / "bench_model_load.json").write_text(json.dumps({"info": info, "load": result, "table": text}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--cpu", action="store_true", help="the demo model on the CPU")
    ap.add_argument("--demo", action="store_true", help="the demo model on this device (a GPU where there is one)")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument(
        "--whole-kernel-sources",
        action="store_true",
        help="also time our decode with every kernel compiled from its whole headers (the A/B of pruning)",
    )
    ap.add_argument(
        "--separate-launches",
        action="store_true",
        help="also time our decode with mHC sites (and the expands before them), the router, the q / window-key ropes "
        "and the attention output's rope in separate launches (A/B)",
    )
    ap.add_argument(
        "--host-counters",
        action="store_true",
        help="also time our decode with the FINISH counters made from host data (managed memory): the A/B",
    )
    ap.add_argument(
        "--inline-kernel-headers",
        action="store_true",
        help="also time our decode with CUDA kernel headers inline in the source MLX hashes (A/B of header files)",
    )
    ap.add_argument(
        "--exl3-tuning",
        nargs="+",
        default=[],
        metavar="FIELD=INT",
        help="also time our decode with these kernels.exl3.Tuning fields changed (e.g. dense_single_blocks=1)",
    )
    ap.add_argument(
        "--indexer-reference",
        action="store_true",
        help="also time our decode with the indexer's scores and top-k in plain MLX, not index_scores (the A/B)",
    )
    ap.add_argument(
        "--ab-first",
        action="store_true",
        help="run the A/B runs asked for before our default run (the other order; one process)",
    )
    ap.add_argument(
        "--kernel-stand-ins",
        action="store_true",
        help="also time our decode with the kernel arguments a launch does not use passed as stand-ins, not "
        "left out of CUDA launches (the A/B; docs/design.md#absent-arguments)",
    )
    ap.add_argument(
        "--separate-compressor",
        action="store_true",
        help="also time our decode with the compressor's raw-ring writes and open-group rows made by MLX, not "
        "by compressor_raw (the A/B; docs/design.md#compressor-raw)",
    )
    ap.add_argument(
        "--attention-builds-index-list",
        action="store_true",
        help="also time our decode with the attention's index list concatenated by MLX, not written by the "
        "indexer's kernel (the A/B; docs/design.md#index-list)",
    )
    ap.add_argument(
        "--host-position",
        action="store_true",
        help="also time our decode with each compiled step's position made on the host (the A/B of carrying it)",
    )
    ap.add_argument(
        "--separate-ring-writes",
        action="store_true",
        help="also time our decode with the window KV's ring writes as their own launches (A/B of RING)",
    )
    ap.add_argument("--compiled", action="store_true", help="time our step both eagerly and compiled")
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="CPU / --demo: then ours and mlx-lm in this many alternating rounds (paired_rounds.py; 0: none)",
    )
    ap.add_argument("--round-steps", type=int, default=8, help="tokens per model per round (--rounds)")
    ap.add_argument(
        "--dspark",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the DSpark verify and draft costs (default on; the Flash-shaped model gets Flash's DSpark head)",
    )
    ap.add_argument("--dspark-only", action="store_true", help="only the DSpark costs: no decode loop, no mlx-lm")
    ap.add_argument("--acceptance", type=float, default=0.8, help="per-position acceptance for the on-paper tokens/s")
    ap.add_argument(
        "--verify-k",
        type=lambda v: [int(k) for k in v.split(",")],
        default=None,
        help="drafts per verify to time, e.g. 2,4,5 (default 0 .. the block size)",
    )
    ap.add_argument(
        "--flash",
        action="store_true",
        help="the Flash-shaped model even on the CPU (slow: a check; use a small --layers)",
    )
    add_prefill_args(ap)
    ap.add_argument(
        "--load",
        type=Path,
        default=None,
        help="only loading: a converted checkpoint read with lazy=False (load_memory.py)",
    )
    ap.add_argument(
        "--load-synthetic",
        action="store_true",
        help="--load on a synthetic ~5.3 GB official checkpoint converted in --out",
    )
    a = ap.parse_args()
    check_prefill_args(ap, a)
    if a.quick:
        a.steps, a.warmup = min(a.steps, 12), min(a.warmup, 2)
    if a.steps < 1 or a.warmup < 0 or a.prompt < 1:
        ap.error("--steps and --prompt must be >= 1, --warmup >= 0")
    if a.rounds < 0 or a.round_steps < 1:
        ap.error("--rounds must be >= 0 and --round-steps >= 1")
    if not 0 <= a.acceptance <= 1:
        ap.error("--acceptance must be in 0..1")
    if a.dspark_only:
        a.dspark, a.skip_mlx_lm = True, True
    if a.cpu:
        mx.set_default_device(mx.cpu)
    elif backend() == "cpu":
        print(f"bench_model: no MLX GPU here; timing the {'Flash-shaped' if a.flash else 'demo'} model on the CPU")
        a.cpu = True
        mx.set_default_device(mx.cpu)
    a.out.mkdir(parents=True, exist_ok=True)
    info = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "host": platform.node(),
        "backend": backend(),
        "args": {k: str(v) for k, v in vars(a).items()},
        # MLX's CUDA graph size (mlx_dsv41 sets 1,000 where unset: docs/design.md#graph-size)
        "graph_env": {k: os.environ.get(k) for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")},
    }
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        a.skip_mlx_lm = True
    if a.load or a.load_synthetic:
        return load_main(a, info)
    if a.prefill or a.prefill_parts:
        return prefill_main(a, info | {"prefill_chunk_default": default_chunk()})
    runs = []
    if (a.cpu or a.demo) and not a.flash:
        runs += ours_runs("mlx_dsv41 demo", lambda: ours_demo(a), a, min(a.prompt, 32))
        if not a.skip_mlx_lm:
            demo_args = ours_demo(a)[1]
            runs.append(
                measure(
                    "mlx-lm deepseek_v41 affine 4-bit (demo dims)",
                    lambda: (mlx_lm_model(demo_args, 4, a.seed), demo_args),
                    a,
                    min(a.prompt, 32),
                )
            )
    else:
        runs += ours_runs("mlx_dsv41 Flash-shaped EXL3", lambda: ours_flash(a), a, a.prompt)
        if not a.skip_mlx_lm:
            args = flash_model.flash_args(a.layers)
            runs.append(
                measure("mlx-lm deepseek_v41 affine 4-bit", lambda: (mlx_lm_model(args, 4, a.seed), args), a, a.prompt)
            )
    text = table(runs)
    result = {"info": info, "runs": runs, "table": text}
    if (a.cpu or a.demo) and not a.flash and not a.skip_mlx_lm and a.rounds:
        result["rounds"] = demo_rounds(a)
        text += "\n\n" + paired_rounds.table(result["rounds"])
    print(text)
    (a.out / "bench_model.json").write_text(json.dumps(result | {"table": text}, indent=1))
    return 0


def demo_rounds(a) -> dict:
    """The demo as the backend runs it by default (with --compiled eagerly and compiled, a second
    instance) and mlx-lm at its dims in alternating rounds (paired_rounds.py)."""
    contenders = []
    for setting in ("0", "1") if a.compiled else (os.environ.get(compiled_step.ENV_VAR, ""),):
        model, args = ours_demo(a)
        env = {compiled_step.ENV_VAR: setting}
        with paired_rounds.environment(env):  # the backend's default where not set (GPUs compile)
            mode = "compiled" if compiled_step.compiles(1) else "eager"
        contenders.append(paired_rounds.Contender(f"mlx_dsv41 demo {mode}", model, model.make_cache(), env))
    ref = mlx_lm_model(args, 4, a.seed)
    contenders.append(paired_rounds.Contender("mlx-lm deepseek_v41 affine 4-bit (demo dims)", ref, ref.make_cache()))
    prompt = mx.array(np.random.default_rng(7).integers(3, args.vocab_size - 200, (1, min(a.prompt, 32))), mx.int32)
    return paired_rounds.run(contenders, prompt, a.rounds, a.round_steps)


if __name__ == "__main__":
    sys.exit(main())
