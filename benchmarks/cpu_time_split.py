"""Where the demo's CPU decode time goes, thread by thread (Linux, `perf`).

    python3 benchmarks/cpu_time_split.py [--steps 250] [--eager] [--out DIR]

A child process loads the demo checkpoint, decodes a 64-token prompt and a few warm-up steps on the
CPU (compiled by default: MLX_DSV41_COMPILE=1), then decodes --steps tokens as mlx-lm's loop does
(token i+1 queued before token i is read) while `perf record` samples it (1,999 Hz, attached only
once the warm-up is done). Each sample is put in a class by the library it fell in: Python (the
interpreter, numpy), MLX's compiled replay (`compile_replace`), the rest of MLX (the graph walk and
each node's encoding on the main thread; the op bodies on the stream's thread), libc (malloc, free,
memcpy), the kernel (waking and switching threads, page faults), BLAS, the fused kernels MLX
compiled. Reported per thread as CPU ms per token (samples / 1,999 / steps), beside the pace.
docs/benchmarks.md (twenty-eighth session) says what it showed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired_rounds  # noqa: E402 (benchmarks/ is not a package)

HZ = 1999
CLASSES = (  # (class, substrings of the sample's symbol or library), first match wins
    ("Python", ("libpython", "_multiarray", "core.cpython", "numpy")),
    ("MLX compiled replay", ("compile_replace", "Compiled::Compiled")),
    ("libc (malloc, free, memcpy)", ("libc.so",)),
    ("kernel (thread wake / switch, faults)", ("kernel.kallsyms",)),
    ("BLAS", ("libblas", "openblas")),
    ("MLX (graph walk, node encoding, op bodies)", ("libmlx", "libstdc++")),
)


def classify(sample: str) -> str:
    for name, keys in CLASSES:
        if any(k in sample for k in keys):
            return name
    return "fused kernels MLX compiled" if ".so" in sample else "other"


def child(steps: int) -> None:
    import mlx.core as mx
    import numpy as np

    import mlx_dsv41
    from mlx_dsv41.demo import ensure_demo

    mx.set_default_device(mx.cpu)
    model, _ = mlx_dsv41.load(ensure_demo(progress=False))
    demo = paired_rounds.Contender("demo", model, model.make_cache())
    demo.token = demo.next_token(
        mx.array(np.random.default_rng(7).integers(3, model.args.vocab_size - 200, (1, 64)), mx.int32)
    )
    paired_rounds.sync_block(demo, 6)  # warm-up
    print(json.dumps({"ready": threading.get_native_id()}), flush=True)
    sys.stdin.readline()  # the profiler is attached
    pace, _, _ = paired_rounds.pipelined_block(demo, steps)
    print(json.dumps({"ms_per_token": pace}), flush=True)


def profile(a) -> dict:
    env = os.environ | {"MLX_DSV41_COMPILE": "0" if a.eager else "1"}
    cmd = [sys.executable, __file__, "--child", "--steps", str(a.steps)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ready = proc.stdout.readline()
    if not ready:
        raise RuntimeError(f"the decoding child exited ({proc.wait()}) before its warm-up ended")
    main_tid = json.loads(ready)["ready"]
    data = a.out / "cpu_time_split.perf.data"
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-F", str(HZ), "-p", str(proc.pid), "-o", str(data)], stderr=subprocess.DEVNULL
    )
    time.sleep(1.0)  # perf attaches
    proc.stdin.write("go\n")
    proc.stdin.flush()
    done = proc.stdout.readline()
    proc.wait()
    if perf.wait() != 0 or not data.exists():
        raise RuntimeError(f"perf record could not sample the child (exit {perf.returncode}; perf_event_paranoid?)")
    if not done:
        raise RuntimeError(f"the decoding child exited ({proc.returncode}) before its timed loop ended")
    pace = json.loads(done)["ms_per_token"]
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "tid,ip,sym,dso"], capture_output=True, text=True)
    if script.returncode != 0:
        raise RuntimeError(f"perf script failed: {script.stderr.strip().splitlines()[-1:]}")
    per_thread = collections.defaultdict(collections.Counter)
    for line in script.stdout.splitlines():
        tid, _, rest = line.strip().partition(" ")
        if tid.isdigit():
            per_thread[int(tid)][classify(rest)] += 1
    scale = 1e3 / HZ / a.steps  # samples -> CPU ms per token
    threads = {}
    for tid, counts in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values()))[:3]:
        name = "main" if tid == main_tid else f"thread {tid}"
        threads[name] = {k: round(v * scale, 2) for k, v in counts.most_common()}
    return {"mode": "eager" if a.eager else "compiled", "steps": a.steps, "ms_per_token": pace, "threads": threads}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eager", action="store_true", help="the eager step (default: compiled)")
    ap.add_argument("--out", type=Path, default=Path("cpu_out"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.steps)
        return 0
    if shutil.which("perf") is None:
        print("cpu_time_split: needs Linux `perf` on PATH", file=sys.stderr)
        return 2
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        result = profile(a)
    except RuntimeError as e:
        print(f"cpu_time_split: {e}", file=sys.stderr)
        return 1
    (a.out / "cpu_time_split.json").write_text(json.dumps(result, indent=1))
    print(f"{result['mode']} demo on the CPU: {result['ms_per_token']:.2f} ms/token pipelined ({a.steps} tokens)")
    for name, classes in result["threads"].items():
        total = sum(classes.values())
        print(f"  {name}: {total:.2f} CPU ms/token: " + ", ".join(f"{k} {v:.2f}" for k, v in classes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
