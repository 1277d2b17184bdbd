"""Engram store on this machine's disk: cold and warm rows/s and per-token latency, pread vs mmap,
with and without prefetch, and major page faults per token.

A token reads 48 random rows (24 per Engram layer, both layers' worth from one table here) of a
synthetic row file of >= 4 GB, written once under /tmp and reused. "Cold" drops the file from the
page cache (posix_fadvise DONTNEED, store closed first so no mapping pins pages) before each
trial; "warm" reads the whole file before each trial. "Prefetch" issues the token's rows, then sleeps a
simulated compute of --compute-ms (the layers before the Engram layer), then reads: the reported
latency is what the model waits for after its compute. Results: a JSON file and a markdown table
in --out; every number is the median over --trials trials.

This is a storage benchmark for the development machine: it skips itself on the GPU machine
(nvidia-smi present) unless --on-gpu-host is given, so `benchmarks/gpu_run.sh` does not spend
device time on it.

    .venv/bin/python benchmarks/bench_engram_store.py --out /tmp/bench_out
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mlx_dsv41.convert.engram_rows import EngramTable, write_engram_rows
from mlx_dsv41.engram_store import EngramStore, row_file_name

HEAD_DIM = 256
ROW_BYTES = HEAD_DIM + HEAD_DIM // 32
ROWS_PER_TOKEN = 48


def synthetic_table(rows: int, seed: int = 41) -> EngramTable:
    """Deterministic random bytes per chunk (so a rerun sees the same source), never all in RAM."""

    def read(lo: int, hi: int):
        raw = np.frombuffer(np.random.default_rng([seed, lo]).bytes((hi - lo) * ROW_BYTES), np.uint8)
        raw = raw.reshape(hi - lo, ROW_BYTES)
        return raw[:, :HEAD_DIM], raw[:, HEAD_DIM:]

    return EngramTable(rows, HEAD_DIM, read, "synthetic table")


def ensure_table(path: Path, gigabytes: float) -> dict:
    rows = int(gigabytes * 1e9) // ROW_BYTES
    free = shutil.disk_usage(path.parent).free
    if not path.exists() and free < rows * ROW_BYTES + (2 << 30):
        sys.exit(
            f"bench_engram_store: {path.parent} has {free / 1e9:.1f} GB free, needs {rows * ROW_BYTES / 1e9 + 2:.1f} GB"
        )
    t0 = time.perf_counter()
    status = write_engram_rows(synthetic_table(rows), path, 1, rows)
    seconds = time.perf_counter() - t0
    info = {"rows": rows, "bytes": path.stat().st_size, "write_status": status, "write_seconds": seconds}
    if status != "unchanged":
        info["write_MBps"] = rows * ROW_BYTES / seconds / 1e6
    print(f"table {path}: {rows} rows, {info['bytes'] / 1e9:.2f} GB, {status} in {seconds:.1f} s", flush=True)
    return info


def relayout_throughput(directory: Path, gigabytes: float) -> dict:
    """Re-layout speed from an official-format shard (F8_E4M3 + F8_E8M0), source cold: the
    converter's Engram step. The shard is written once with the reference safetensors library."""
    import safetensors
    from safetensors import TensorSpec

    from mlx_dsv41.convert.engram_rows import table_from_checkpoint
    from mlx_dsv41.convert.safetensors_io import SafetensorsCheckpoint

    rows = int(gigabytes * 1e9) // ROW_BYTES
    shard = directory / "model-00047-of-00048.safetensors"
    if not shard.exists():
        rng = np.random.default_rng(47)
        values = np.frombuffer(rng.bytes(rows * HEAD_DIM), np.uint8)
        scales = rng.integers(112, 136, rows * HEAD_DIM // 32, dtype=np.uint8)
        specs = {
            "layers.14.engram.embed.weight": TensorSpec(
                dtype="float8_e4m3fn", shape=[rows, HEAD_DIM], data_ptr=values.ctypes.data, data_len=values.nbytes
            ),
            "layers.14.engram.embed.scale": TensorSpec(
                dtype="float8_e8m0fnu",
                shape=[rows, HEAD_DIM // 32],
                data_ptr=scales.ctypes.data,
                data_len=scales.nbytes,
            ),
        }
        safetensors.serialize_file(specs, str(shard))
        del values, scales
    out = directory / row_file_name(14)
    out.unlink(missing_ok=True)
    drop_cache(shard)
    t0 = time.perf_counter()
    with SafetensorsCheckpoint(shard) as ckpt:
        write_engram_rows(table_from_checkpoint(ckpt, 14), out, 14, rows)
    seconds = time.perf_counter() - t0
    out.unlink()
    nbytes = rows * ROW_BYTES
    return {"rows": rows, "bytes": nbytes, "seconds": seconds, "MBps": nbytes / seconds / 1e6}


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def disk_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes")).split()[1])
    except (OSError, StopIteration):
        return 0


def trial(
    path: Path,
    rows: int,
    mode: str,
    threads: int,
    cold: bool,
    prefetch: bool,
    tokens: int,
    compute_s: float,
    rng: np.random.Generator,
) -> dict:
    """One trial: open the store, warm it up on a few tokens, then time `tokens` tokens."""
    if cold:
        drop_cache(path)
    else:  # re-warm every trial: this VM's DAMON reclaim pages out what sits unused for ~60 s
        warm_cache(path)
    store = EngramStore(path, mode=mode, threads=threads, expected_rows=rows)
    try:
        warmup = 5
        ids = rng.integers(0, rows, (warmup + tokens, ROWS_PER_TOKEN))
        for t in range(warmup):
            store.read(ids[t])
        store.reset_stats()
        faults0, disk0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, disk_read_bytes()
        latencies = []
        t_start = time.perf_counter()
        for t in range(warmup, warmup + tokens):
            if prefetch:
                store.prefetch(ids[t])
                time.sleep(compute_s)
            t0 = time.perf_counter()
            store.read(ids[t])
            latencies.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0
        disk = disk_read_bytes() - disk0
        stats = store.stats
    finally:
        store.close()
    wait = np.array(latencies)
    return {
        "wait_ms_median": float(np.median(wait) * 1e3),  # what the model blocks on in read()
        "wait_ms_p90": float(np.quantile(wait, 0.9) * 1e3),
        "fetch_ms_per_token": stats.fetch_seconds / tokens * 1e3,  # storage work, on any thread
        "rows_per_s": stats.rows / stats.fetch_seconds,
        "major_faults_per_token": faults / tokens,
        "disk_KiB_per_token": disk / tokens / 1024,
        "prefetch_hit_rate": stats.prefetch_hits / max(1, stats.rows),
        "wall_ms_per_token": wall / tokens * 1e3,
    }


def bulk_trial(path: Path, rows: int, mode: str, threads: int, n: int, rng) -> float:
    """Cold rows/s for one large read (queue depth = threads): what a prefill batch sees."""
    drop_cache(path)
    with EngramStore(path, mode=mode, threads=threads, expected_rows=rows) as store:
        ids = rng.integers(0, rows, n)
        t0 = time.perf_counter()
        store.read(ids)
        return n / (time.perf_counter() - t0)


def machine_info(path: Path) -> dict:
    def cmd(*args):
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {
        "platform": platform.platform(),
        "cpu": cpu or platform.processor(),
        "cpus": os.cpu_count(),
        "memory_GB": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "filesystem": cmd("df", "-hT", str(path.parent)).splitlines()[-1:],
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mlx_dsv41_bench"))
    ap.add_argument("--gb", type=float, default=4.3)
    ap.add_argument("--relayout-gb", type=float, default=1.0)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--compute-ms", type=float, default=3.0)
    ap.add_argument("--on-gpu-host", action="store_true")
    args = ap.parse_args()
    if shutil.which("nvidia-smi") and not args.on_gpu_host:
        print(
            "bench_engram_store: storage benchmark for the development machine; skipped on the "
            "GPU host (--on-gpu-host to run it)"
        )
        return
    if not hasattr(os, "posix_fadvise"):
        sys.exit("bench_engram_store: needs posix_fadvise to drop the page cache (Linux)")
    args.out.mkdir(parents=True, exist_ok=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / row_file_name(1)
    t_begin = time.perf_counter()
    table = ensure_table(path, args.gb)
    rows = table["rows"]
    rng = np.random.default_rng(0)
    relayouts = [relayout_throughput(args.dir, args.relayout_gb) for _ in range(args.trials)]
    relayout = {
        **relayouts[0],
        "MBps": statistics.median(r["MBps"] for r in relayouts),
        "MBps_trials": [r["MBps"] for r in relayouts],
    }
    print(f"re-layout from a safetensors shard: {relayout['MBps']:.0f} MB/s", flush=True)

    configs = [  # (label, mode, threads)
        ("pread, 8 threads", "pread", 8),
        ("pread, 1 thread", "pread", 1),
        ("mmap", "mmap", 1),
    ]
    results = []
    for cold in (True, False):
        for label, mode, threads in configs:
            for prefetch in (False, True):
                runs = [
                    trial(path, rows, mode, threads, cold, prefetch, args.tokens, args.compute_ms / 1e3, rng)
                    for _ in range(args.trials)
                ]
                row = {"state": "cold" if cold else "warm", "store": label, "prefetch": prefetch}
                row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
                results.append(row)
                print(json.dumps(row), flush=True)
    bulk = []
    for label, mode, threads in configs + [("pread, 32 threads", "pread", 32)]:
        rate = statistics.median(bulk_trial(path, rows, mode, threads, 4096, rng) for _ in range(args.trials))
        bulk.append({"store": label, "rows": 4096, "cold_rows_per_s": rate})
        print(json.dumps(bulk[-1]), flush=True)

    report = {
        "machine": machine_info(path),
        "table": table,
        "tokens_per_trial": args.tokens,
        "trials": args.trials,
        "compute_ms": args.compute_ms,
        "per_token": results,
        "bulk": bulk,
        "relayout": relayout,
        "seconds": time.perf_counter() - t_begin,
    }
    (args.out / "bench_engram_store.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| state | store | prefetch | wait ms/token (median) | wait ms (p90) | fetch ms/token | rows/s "
        "| major faults/token | disk KiB/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['state']} | {r['store']} | {'yes' if r['prefetch'] else 'no'} | "
            f"{r['wait_ms_median']:.3f} | "
            f"{r['wait_ms_p90']:.3f} | {r['fetch_ms_per_token']:.3f} | {r['rows_per_s']:,.0f} | "
            f"{r['major_faults_per_token']:.2f} | {r['disk_KiB_per_token']:.1f} |"
        )
    lines += ["", "| store | cold rows/s, one read of 4096 random rows |", "|---|---|"]
    lines += [f"| {b['store']} | {b['cold_rows_per_s']:,.0f} |" for b in bulk]
    lines += [
        "",
        f"Row-file writing from a cold official-format shard: {relayout['MBps']:.0f} MB/s "
        f"({relayout['bytes'] / 1e9:.2f} GB; trials "
        f"{', '.join(f'{v:.0f}' for v in relayout['MBps_trials'])}).",
    ]
    (args.out / "bench_engram_store.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"total {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
