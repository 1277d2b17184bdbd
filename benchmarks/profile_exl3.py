"""Where an EXL3 call's time goes on the GPU: device time per kernel vs MLX's host cost per launch.

Two parts (CUDA):
- ``--part host``: wall µs per launch (building the graph and evaluating it) of a trivial custom
  kernel (one thread copies one float), of the same kernel behind a 33 KB source, of chains of
  either under `mx.compile`, and of MLX's own ops, chained (each call consumes the previous
  output) and independent. A kernel faster than this is bound by the host.
- ``--part inputs``: the same host cost split into the compiled graph's replay and its evaluation,
  against the inputs and outputs a launch carries (`inputs_part`).
Device time per call without a profiler (kernels plus the device's gaps, the anchor's method):
bench_exl3.py's "device" column.
- ``--part kernels``: each EXL3 case (m = 1 linears on the Flash shapes, the one-token MoE block)
  launched --launches times, one evaluation each, weights rotated over > --rotate-mib; meant to run
  under Nsight Compute, which reports each kernel's device time:

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --csv python3 benchmarks/profile_exl3.py --part kernels > ncu.csv
    python3 benchmarks/profile_exl3.py --part summary --csv ncu.csv

``--part summary`` prints the median device µs per kernel and case from that CSV (the case of each
launch is known from the order: the script prints it on stderr). For one kernel's hot spots:

    ncu --clock-control none --set full -k regex:expert_down --launch-skip 1 --launch-count 1 \
        -o down python3 benchmarks/profile_exl3.py --part kernels --rotate-mib 1 --launches 2 --only MoE
    ncu -i down.ncu-rep --page source --print-source sass --csv > down.sass.csv
    python3 benchmarks/profile_exl3.py --part hotspots --csv down.sass.csv

``--part hotspots`` prints the stall reasons summed over the kernel, the instructions where warps
were sampled most (with their reasons) and the executed instructions by opcode.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
import bench_exl3 as bench  # noqa: E402

from mlx_dsv41.exl3 import ops  # noqa: E402
from mlx_dsv41.kernels import backend  # noqa: E402

CASES = (
    ("wq_a", 3),
    ("wkv", 3),
    ("wo_a group", 3),
    ("wo_b", 3),
    ("expert w1/w3", 3),
    ("expert w2", 3),
    ("wq_b", 3),
    ("head", 4),
)
SHAPE = {name: (k, n) for name, k, n in bench.SHAPES}

TRIVIAL_SOURCE = "if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = x[0] + 1.0f;"


def _trivial_kernel(name: str, header: str = ""):
    k = mx.fast.cuda_kernel(name=name, input_names=["x"], output_names=["y"], source=TRIVIAL_SOURCE, header=header)

    def call(x):
        return k(inputs=[x], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))[
            0
        ]

    return call


def _compiled_chain(fn, links: int):
    """`links` dependent applications of fn as one mx.compile'd function (traced once)."""

    def chain(x):
        for _ in range(links):
            x = fn(x)
        return x

    return mx.compile(chain)


def host_part(calls: int, repeats: int):
    trivial = _trivial_kernel("profile_trivial")
    # The same one-line kernel behind a 33 KB header of comments: MLX builds (per call) and hashes
    # (per launch) the whole source, so its size is part of every launch's host cost.
    padded = _trivial_kernel("profile_trivial_padded", "".join(f"// {i:06d} {'x' * 60}\n" for i in range(480)))
    links = 16
    compiled_kernels = _compiled_chain(trivial, links)
    compiled_adds = _compiled_chain(lambda x: x * 1.0001 + 1.0, links)

    w = mx.random.normal((512, 5120)).astype(mx.bfloat16)
    xb = mx.random.normal((1, 5120)).astype(mx.bfloat16)
    cases = {
        "trivial custom kernel": (trivial, mx.zeros((1,)), 1),
        "trivial custom kernel, 33 KB source": (padded, mx.zeros((1,)), 1),
        f"{links} trivial custom kernels in one mx.compile'd function (per kernel)": (
            compiled_kernels,
            mx.zeros((1,)),
            links,
        ),
        "mx add (1 element)": (lambda x: x + 1.0, mx.zeros((1,)), 1),
        f"{links} x (multiply, add) in one mx.compile'd function (per pair)": (compiled_adds, mx.zeros((1,)), links),
        "bf16 GEMV 5120x512 (MLX)": (lambda x: (x @ w.T)[:, :1].astype(mx.bfloat16) * 0 + xb, xb, 1),
    }
    for name, (fn, x0, per_call) in cases.items():
        for chained in (True, False):
            samples = []
            for _ in range(repeats + 1):
                outs, prev = [], x0
                t0 = time.perf_counter()  # graph building (MLX builds a custom kernel's source per call) + eval
                for _ in range(calls // per_call):
                    prev = fn(prev if chained else x0)
                    outs.append(prev)
                mx.eval(outs)
                samples.append((time.perf_counter() - t0) / (calls // per_call * per_call) * 1e6)
            print(
                f"host | {name} | {'chained' if chained else 'independent'} | {statistics.median(samples[1:]):.2f} µs"
            )


def _wide_kernel(inputs: int, outputs: int, name: str):
    """A trivial kernel with `inputs` inputs (x first) and `outputs` outputs: one thread adds x[0] + 1
    into each output (the others' bytes only travel as arguments, as a linear's weights do)."""
    in_names = ["x", *(f"w{i}" for i in range(inputs - 1))]
    out_names = ["y", *(f"z{i}" for i in range(outputs - 1))]
    body = " ".join(f"{o}[0] = x[0] + 1.0f;" for o in out_names)
    return mx.fast.cuda_kernel(
        name=name,
        input_names=in_names,
        output_names=out_names,
        source=f"if (threadIdx.x == 0 && blockIdx.x == 0) {{ {body} }}",
    )


def inputs_part(repeats: int, links: int = 16):
    """MLX's host cost of a compiled chain of `links` custom kernels against the inputs and outputs
    each launch carries: the graph's replay (calling the compiled function) and its evaluation
    (queueing), µs per kernel. The extra inputs are weights the function holds (as the model's
    linears hold theirs); `MiB` cases make each weight that large (MLX commits its CUDA graph every
    MLX_MAX_MB_PER_BUFFER of inputs)."""
    for n_in, n_out, mib in ((1, 1, 0), (4, 1, 0), (8, 1, 0), (16, 1, 0), (24, 1, 0), (8, 4, 0), (8, 1, 64)):
        k = _wide_kernel(n_in, n_out, f"profile_wide_{n_in}_{n_out}")
        size = (mib << 20) // 4 if mib else 64
        weights = [[mx.random.normal((size,)) for _ in range(n_in - 1)] for _ in range(links)]
        mx.eval(weights)

        def chain(x, k=k, weights=weights, n_out=n_out):
            for w in weights:
                outs = k(
                    inputs=[x, *w],
                    output_shapes=[(1,)] * n_out,
                    output_dtypes=[mx.float32] * n_out,
                    grid=(32, 1, 1),
                    threadgroup=(32, 1, 1),
                )
                x = outs[0]  # the other outputs are the launch's siblings: made, never read
            return x

        fn = mx.compile(chain)
        build, queue = [], []
        for _ in range(repeats + 1):
            x = mx.zeros((1,))
            mx.eval(fn(x))
            t0 = time.perf_counter()
            y = fn(x)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            build.append((t1 - t0) / links * 1e6)
            queue.append((t2 - t1) / links * 1e6)
        print(
            f"inputs | {n_in} inputs, {n_out} outputs{f', {mib} MiB weights' if mib else ''} | "
            f"build {statistics.median(build[1:]):.2f} µs | eval {statistics.median(queue[1:]):.2f} µs a kernel"
        )


def kernels_part(launches: int, rotate_mib: int, only: str):
    for name, bits in [c for c in CASES if only in f"{c[0]} K{c[1]}"]:
        k, n = SHAPE[name]
        sets = bench.linear_sets(k, n, bits, rotate_mib)
        x = mx.random.normal((1, k)).astype(mx.bfloat16)
        mx.eval(ops.linear(x, *sets[0], "mul1"))  # compile outside the profiled launches
        for i in range(launches):
            print(f"case {name} K{bits}", file=sys.stderr, flush=True)
            mx.eval(ops.linear(x, *sets[(i + 1) % len(sets)], "mul1"))
        del sets
    if only not in "MoE K3":
        return
    experts = bench.moe_experts(3)
    picks = bench.routing(launches + 1, seed=3)
    x = mx.random.normal((1, bench.HIDDEN))
    mx.eval(experts(x, *picks[0]))
    for i in range(launches):
        print("case MoE K3", file=sys.stderr, flush=True)
        mx.eval(experts(x, *picks[i + 1]))


def summary_part(path: Path):
    rows = [r for r in csv.reader(line for line in path.read_text().splitlines() if line.startswith('"'))]
    header, body = (rows[0], rows[1:]) if rows else ([], [])
    if not {"Kernel Name", "Grid Size", "Block Size", "Metric Name", "Metric Unit", "Metric Value"} <= set(header):
        raise ValueError(f"{path} is not an `ncu --csv` metrics export")
    col = {h: i for i, h in enumerate(header)}
    per = defaultdict(list)
    for r in body:
        if r[col["Metric Name"]] != "gpu__time_duration.sum":
            continue
        value = float(r[col["Metric Value"]].replace(",", ""))
        unit = r[col["Metric Unit"]]
        us = value / 1e3 if unit in ("ns", "nsecond") else value if unit in ("us", "usecond") else value * 1e3
        per[(r[col["Kernel Name"]].split("(")[0][:60], r[col["Grid Size"]], r[col["Block Size"]])].append(us)
    for key, v in sorted(per.items()):
        print(
            f"| {key[0]} | grid {key[1]} | block {key[2]} | n {len(v)} | median {statistics.median(v):.2f} µs "
            f"| min {min(v):.2f} |"
        )


def hotspots_part(path: Path, top: int = 25):
    rows = list(csv.reader(path.read_text().splitlines()))
    header = next((r for r in rows if "Source" in r and "Address" in r), None)
    if header is None or "Warp Stall Sampling (All Samples)" not in header:
        raise ValueError(f"{path} is not an `ncu --page source --print-source sass --csv` export")
    body = [r for r in rows[rows.index(header) + 1 :] if len(r) == len(header)]
    col = {h: i for i, h in enumerate(header)}

    def num(r, name):
        v = r[col[name]].replace(",", "")
        return float(v) if v.replace(".", "", 1).isdigit() else 0.0

    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(num(r, samples) for r in body) or 1.0
    print(
        "stall reasons (share of samples):",
        ", ".join(
            f"{h[6:]} {100 * s / total:.1f}%"
            for h, s in sorted(((h, sum(num(r, h) for r in body)) for h in reasons), key=lambda t: -t[1])[:8]
        ),
    )
    print(f"\ntop {top} sampled instructions (index, share, instruction, main reasons):")
    for i in sorted(sorted(range(len(body)), key=lambda i: -num(body[i], samples))[:top]):
        r = body[i]
        why = sorted(((h[6:], num(r, h)) for h in reasons if num(r, h)), key=lambda t: -t[1])[:2]
        print(f"  {i:5d} {100 * num(r, samples) / total:5.1f}%  {r[col['Source']].strip()[:60]:60s} {why}")
    executed = defaultdict(float)
    for r in body:
        op = r[col["Source"]].split()
        op = op[1] if op and op[0].startswith("@") and len(op) > 1 else (op[0] if op else "?")
        executed[op.split(".")[0]] += num(r, "Instructions Executed")
    all_ops = sum(executed.values()) or 1.0
    print(
        "\nexecuted warp instructions by opcode:",
        ", ".join(f"{op} {100 * n / all_ops:.1f}%" for op, n in sorted(executed.items(), key=lambda t: -t[1])[:14]),
        f"(total {all_ops:.0f})",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("host", "inputs", "kernels", "summary", "hotspots"), required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--only", default="", help="kernels part: only cases whose name contains this")
    args = ap.parse_args()
    if args.part in ("summary", "hotspots"):
        if args.csv is None or not args.csv.is_file():
            ap.error(f"--part {args.part} needs --csv FILE (an existing Nsight Compute CSV export)")
        try:
            (summary_part if args.part == "summary" else hotspots_part)(args.csv)
        except (ValueError, UnicodeDecodeError) as e:
            print(f"profile_exl3: error: {e}", file=sys.stderr)
            return 1
        return 0
    if backend() != "cuda":
        print(
            f"profile_exl3: --part {args.part} needs MLX's CUDA backend (found {backend()}); nothing measured",
            file=sys.stderr,
        )
        return 2
    if args.part == "host":
        host_part(args.calls, args.repeats)
    elif args.part == "inputs":
        inputs_part(max(args.repeats, 20))
    else:
        kernels_part(args.launches, args.rotate_mib, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
