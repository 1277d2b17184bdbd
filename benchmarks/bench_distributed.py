"""Expert parallelism on two GPUs (issue 7): exchange cost, and decode time one GPU vs two per mode.

Run through `bash benchmarks/gpu_run_x2.sh` on a two-GPU machine (NCCL). It runs this script as
  --role single                 one process on one GPU: the baseline, every expert held
  --role rank --partition P     each of the ranks mlx.launch starts (P = experts | slots)
  --role report                 reads the runs' JSON in --out: markdown table + bench_distributed.json
Plain `--out DIR` (how gpu_run.sh calls every benchmark) prints a note and measures nothing.

What a run measures:
- Exchange cost (ranks only): a decode-sized exchange (k x hidden bf16; `all_sum` of [6, 5120] as in
  "experts" mode, `all_gather` of [3, 5120] per rank as in "slots" mode) evaluated alone
  (`mx.eval` per call: the ~109 µs reading of docs/mlx.md#cuda-offline) and as a chain of --chain
  exchanges in one graph (each consumes the previous, as the MoE layers of a forward do), per
  exchange; the same chain without collectives gives the launch cost they ride on. Medians over
  --repeats.
- Decode of a --layers-layer model with Flash dimensions (hidden 5120, 64 heads x 512, 384
  experts of 2304, top-6, vocab 129280, the Flash layer roles at that depth, no Engram): routed
  experts are EXL3 (K = --bits, --codebook) with random trellises generated on the GPU, one key per
  expert so every run holds the same experts; the rest is random bf16/fp32 (seeded, replicated).
  Prefill of --prompt tokens, then --steps greedy tokens evaluated one at a time (ms/token, median)
  and --steps more pipelined as mlx-lm does (next forward built before the last token is read).
  Per-step logits hashes and tokens are compared with the one-GPU run in the report.
- Exchanges and exchange bytes per decoded token (counted while building the graph), GPU memory
  (active after loading, peak) and process RSS.
A phase that fails (e.g. an EXL3 kernel) is recorded with its error; the others still run.

    python3 benchmarks/bench_distributed.py --out DIR --role report
    # on the CPU, a functional smoke test of the whole script (ring backend, tiny dims):
    mlx.launch --backend ring -n 2 python benchmarks/bench_distributed.py --out /tmp/b --role rank --smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_model  # noqa: E402 (benchmarks/ is not a package)

from mlx_dsv41 import distributed  # noqa: E402
from mlx_dsv41.config import ModelArgs  # noqa: E402
from mlx_dsv41.model.deepseek_v41 import Model  # noqa: E402

# Small dimensions for --smoke (CPU): the same code path at a size the reference BLAS can run.
SMOKE = dict(
    vocab_size=512,
    hidden_size=256,
    num_attention_heads=4,
    head_dim=128,
    q_lora_rank=64,
    o_lora_rank=64,
    o_groups=2,
    moe_intermediate_size=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    index_n_heads=2,
    index_head_dim=64,
    index_topk=8,
    sliding_window=16,
    candidate_topk_blocks=2,
    candidate_block_size=4,
)
FLASH_LAYERS = 40  # MoE layers of the real model, for the per-token extrapolation


def flash_args(layers: int, smoke: bool) -> ModelArgs:
    """Flash dimensions (all 384 experts) at `layers` depth with Flash's roles in miniature
    (flash_model.flash_args); no Engram (replicated host work, not part of the exchange)."""
    return flash_model.flash_args(
        layers,
        experts=SMOKE["n_routed_experts"] if smoke else 384,
        **({k: v for k, v in SMOKE.items() if k != "n_routed_experts"} if smoke else {}),
    )


# ------------------------------------------------------------------------------- timing helpers


def median_us(fn, calls: int, repeats: int, warmup: int = 2) -> float:
    """Median over `repeats` of (time to run fn() `calls` times) / calls, in µs."""
    for _ in range(warmup):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def exchange_costs(cluster, k: int, dim: int, chain: int, repeats: int) -> dict:
    """Decode-sized exchanges alone and inside one graph (see the module docstring)."""
    group, n = cluster.group, cluster.size
    x = mx.random.normal((k, dim), key=mx.random.key(cluster.rank)).astype(mx.bfloat16)
    mx.eval(x)
    part = -(-k // n)
    ops = {
        "all_sum": lambda h: mx.distributed.all_sum(h, group=group),
        "all_gather": lambda h: mx.distributed.all_gather(h[:part], group=group)[:k],
        "none": lambda h: h,
    }

    def chained(op):
        h = x
        for _ in range(chain):
            h = op(h) * 0.5  # bounded values; the scale is the "layer" work between exchanges
        mx.eval(h)

    out = {"k": k, "dim": dim, "chain": chain}
    for name, op in ops.items():
        if name != "none":
            out[f"{name}_eval_each_us"] = median_us(lambda: mx.eval(op(x)), 50, repeats)
        out[f"{name}_in_graph_us"] = median_us(lambda: chained(op), 1, repeats) / chain
    out["all_sum_in_graph_net_us"] = out["all_sum_in_graph_us"] - out["none_in_graph_us"]
    out["all_gather_in_graph_net_us"] = out["all_gather_in_graph_us"] - out["none_in_graph_us"]
    return out


# ------------------------------------------------------------------------------- the model


def build_model(args: ModelArgs, held: tuple[int, int], bits: int, codebook: str, seed: int) -> Model:
    """Dense weights random bf16 / fp32 (seeded: the same draws in every run), the routed experts
    EXL3 (K = bits) with expert e's tensors from its own key, so a rank's share equals the same
    experts of the one-GPU run."""
    mx.random.seed(seed)
    model = Model(args, held)
    for i, layer in enumerate(model.layers):
        layer.ffn.experts = flash_model.exl3_experts(f"layers.{i}.ffn.experts", args, bits, seed, held, codebook)
    keep = model.cast_predicate  # False for the tensors the model holds in fp32
    dense = [
        (k, v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in tree_flatten(model.parameters())
        if ".ffn.experts." not in k
    ]
    model.load_weights(dense, strict=False)
    for part in (model.embed, *model.layers, model.norm, model.head):
        mx.eval(part.parameters())
    return model


def digest(a: mx.array) -> str:
    return hashlib.sha256(np.array(a.astype(mx.float32)).tobytes()).hexdigest()[:16]


def decode(model: Model, cluster, prompt: int, steps: int, warmup: int, logits_path: Path) -> dict:
    args = model.args
    cache = model.make_cache()
    ids = mx.random.randint(0, args.vocab_size, (1, prompt), key=mx.random.key(7)).astype(mx.int32)

    def step(tok):
        logits = model(tok, cache)
        return logits, mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)

    t0 = time.perf_counter()
    logits, tok = step(ids)
    mx.eval(logits, tok)
    out = {"prefill_s": time.perf_counter() - t0, "hashes": [digest(logits[:, -1])], "tokens": [int(tok.item())]}
    times, counts = [], []
    for i in range(warmup + steps):
        before = (cluster.exchanges, cluster.exchange_bytes) if cluster else (0, 0)
        t0 = time.perf_counter()
        logits, tok = step(tok)
        mx.eval(logits, tok)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        out["hashes"].append(digest(logits[:, -1]))
        out["tokens"].append(int(tok.item()))
        if cluster:
            counts.append((cluster.exchanges - before[0], cluster.exchange_bytes - before[1]))
    out["ms_per_token"] = 1e3 * statistics.median(times)
    out["ms_per_token_min"] = 1e3 * min(times)
    if counts:
        out["exchanges_per_token"], out["exchange_bytes_per_token"] = counts[-1]
    # Pipelined as mlx-lm: build and queue token i+1 before reading token i.
    _, nxt = step(tok)
    mx.async_eval(nxt)
    t0 = time.perf_counter()
    pipelined = []
    for _ in range(steps):
        cur = nxt
        _, nxt = step(cur)
        mx.async_eval(nxt)
        pipelined.append(int(cur.item()))
    int(nxt.item())
    out["ms_per_token_pipelined"] = 1e3 * (time.perf_counter() - t0) / steps
    out["tokens_pipelined"] = pipelined
    np.save(logits_path, np.array(logits[0, -1]))  # the last timed step's logits, for diffs
    return out


def memory() -> dict:
    return {
        "active_GB": mx.get_active_memory() / 1e9,
        "peak_GB": mx.get_peak_memory() / 1e9,
        "rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }


# ------------------------------------------------------------------------------- roles


def measure(a, cluster) -> dict:
    label = "single" if cluster is None else f"{cluster.partition}_n{cluster.size}"
    rank = cluster.rank if cluster else 0
    path = a.out / f"bench_distributed_{label}_rank{rank}.json"
    args = flash_args(a.layers, a.smoke)
    result = {
        "label": label,
        "rank": rank,
        "size": cluster.size if cluster else 1,
        "partition": cluster.partition if cluster else None,
        "layers": a.layers,
        "smoke": a.smoke,
        "bits": a.bits,
        "codebook": a.codebook,
        "prompt": a.prompt,
        "steps": a.steps,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "host": platform.node(),
        "errors": {},
    }

    def phase(name, fn):
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # record and go on: the report says what ran and why not
            result["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        result.setdefault("seconds", {})[name] = time.perf_counter() - t0
        path.write_text(json.dumps(result, indent=1))

    if cluster is not None:
        phase(
            "exchange", lambda: exchange_costs(cluster, args.num_experts_per_tok, args.hidden_size, a.chain, a.repeats)
        )
    held = distributed.held_experts(rank, result["size"], result["partition"] or "slots", args.n_routed_experts)
    model = None

    def load():
        nonlocal model
        mx.reset_peak_memory()
        model = build_model(args, held, a.bits, a.codebook, a.seed)
        distributed.apply(model, cluster)
        experts = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if ".ffn.experts." in k)
        return {"held_experts": list(held), "expert_GB": experts / 1e9, **memory()}

    phase("load", load)
    if model is not None:
        phase(
            "decode",
            lambda: {
                **decode(model, cluster, a.prompt, a.steps, a.warmup, path.with_suffix(".last_logits.npy")),
                **memory(),
            },
        )
    print(
        f"bench_distributed: {label} rank {rank}: wrote {path}"
        + (f" (errors: {sorted(result['errors'])})" if result["errors"] else "")
    )
    return result


def _num(value, fmt: str = ".2f") -> str:
    return "—" if value is None else format(value, fmt)


def _same(run: dict, base: dict | None) -> tuple[str, str]:
    """(same tokens, same logits) of a run against the one-GPU run."""
    d, b = run.get("decode"), (base or {}).get("decode")
    if not d or not b or run is base:
        return "—", "—"
    tokens = d["tokens"] == b["tokens"] and d["tokens_pipelined"] == b["tokens_pipelined"]
    diff = [i for i, (x, y) in enumerate(zip(d["hashes"], b["hashes"])) if x != y]
    return ("yes" if tokens else "NO"), ("yes" if not diff else f"NO (from step {diff[0]})")


def report(out: Path) -> int:
    runs = [json.loads(p.read_text()) for p in out.glob("bench_distributed_*_rank*.json")]
    runs.sort(key=lambda r: (r["label"] != "single", r["label"], r["rank"]))
    if not runs:
        print(f"bench_distributed: no runs in {out}")
        return 1
    base = next((r for r in runs if r["label"] == "single"), None)
    lines = [
        "| run | rank | experts held | ms/token | ms/token pipelined | first forward s (prefill + JIT) "
        "| exchanges/token | exchange B/token (this rank) | GPU GB active / peak | RSS GB | same tokens "
        "| same logits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        d, ld = r.get("decode", {}), r.get("load", {})
        held = ld.get("held_experts")
        same_tokens, same_logits = _same(r, base)
        lines.append(
            " | ".join(
                [
                    f"| {r['label']}",
                    str(r["rank"]),
                    f"{held[0]}..{held[1] - 1}" if held else "—",
                    _num(d.get("ms_per_token")),
                    _num(d.get("ms_per_token_pipelined")),
                    _num(d.get("prefill_s")),
                    str(d.get("exchanges_per_token", 0)),
                    f"{d.get('exchange_bytes_per_token', 0):,}",
                    f"{_num(ld.get('active_GB'), '.1f')} / {_num(d.get('peak_GB', ld.get('peak_GB')), '.1f')}",
                    _num(d.get("rss_GB", ld.get("rss_GB")), ".1f"),
                    same_tokens,
                    f"{same_logits} |",
                ]
            )
        )
    exchange = [r for r in runs if "exchange" in r]
    if exchange:
        lines += [
            "",
            "| run | rank | all_sum [k, D] + eval, µs | all_sum in one graph, µs/exchange (net) "
            "| all_gather + eval, µs | all_gather in one graph, µs/exchange (net) "
            "| same chain without collectives, µs/step |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in exchange:
            e = r["exchange"]
            lines.append(
                f"| {r['label']} | {r['rank']} | {e['all_sum_eval_each_us']:.1f} | "
                f"{e['all_sum_in_graph_us']:.1f} ({e['all_sum_in_graph_net_us']:.1f}) | "
                f"{e['all_gather_eval_each_us']:.1f} | {e['all_gather_in_graph_us']:.1f} "
                f"({e['all_gather_in_graph_net_us']:.1f}) | {e['none_in_graph_us']:.1f} |"
            )
    notes = []
    for r in runs:
        d = r.get("decode", {})
        if r["rank"] == 0 and d.get("exchanges_per_token"):
            per_layer = d["exchanges_per_token"] / r["layers"]
            per_exchange = d["exchange_bytes_per_token"] // d["exchanges_per_token"]
            notes.append(
                f"- {r['label']}: {per_layer:g} exchange per MoE layer, {per_exchange:,} B into "
                f"each from every rank; at Flash depth ({FLASH_LAYERS} MoE layers): "
                f"{FLASH_LAYERS * per_layer:g} exchanges, {int(FLASH_LAYERS * per_layer) * per_exchange:,} "
                "B per token per rank"
            )
    errors = [f"- {r['label']} rank {r['rank']}: {k}: {v}" for r in runs for k, v in r.get("errors", {}).items()]
    text = "\n".join(lines + ([""] + notes if notes else []) + (["", "Errors:"] + errors if errors else []))
    print(text)
    (out / "bench_distributed.json").write_text(json.dumps({"runs": runs, "table": text}, indent=1))
    (out / "bench_distributed.md").write_text(text + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--role", choices=("single", "rank", "report"), default=None)
    ap.add_argument("--partition", choices=distributed.PARTITIONS, default="experts")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--codebook", default="mul1")  # the real 2.9 bpw packs are mul1
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chain", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--watchdog", type=float, default=300.0, help="peer watchdog bound, s (cold JIT)")
    ap.add_argument("--smoke", action="store_true", help="tiny dimensions (CPU functional check)")
    a = ap.parse_args()
    if a.role is None:
        print("bench_distributed: needs two GPUs; run `bash benchmarks/gpu_run_x2.sh` (nothing measured)")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.role == "report":
        return report(a.out)
    cluster = distributed.init(a.partition, timeout_s=a.watchdog) if a.role == "rank" else None
    if a.role == "rank" and cluster is None:
        print("bench_distributed: --role rank needs mlx.launch with two or more processes")
        return 2
    measure(a, cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
