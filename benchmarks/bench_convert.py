"""The converter on this machine: throughput (MB/s) and peak RSS converting a synthetic official
FP8/FP4 checkpoint of ~5 GB; major page faults per decoded token on converted tiny checkpoints.

Conversion: a checkpoint with Flash's tensor shapes (hidden 5120, vocab 129280, the real
attention / shared-expert / FP4 expert sizes and the release's formats) but 4 layers of 16
experts and one Engram layer whose table has 2.4 M rows (0.63 GB), plus the real-size token map
(129,280 tokens, 99,092 compressed ids), written once under --workdir with random bytes and reused.
Each trial drops the source from the page cache (posix_fadvise DONTNEED), runs
`python -m mlx_dsv41.convert SRC OUT` as a child process and reads its wall time, peak RSS and
block I/O from wait4; then a second run over the finished output (a no-op) is timed.

Decode: the tiny official and EXL3 checkpoints (mlx_dsv41.synthetic_checkpoints) converted, loaded
with lazy=False, 16-token prompt, 8 warm-up decode steps, then major / minor page faults
(getrusage) over 64 decode steps, per Engram read mode.

Storage / CPU benchmark for the development machine: it skips itself on the GPU host (nvidia-smi
present) unless --on-gpu-host is given. Results: bench_convert.{json,md} in --out.

    .venv/bin/python benchmarks/bench_convert.py --out /tmp/bench_out
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARD_BYTES = 1 << 30  # source shards of ~1 GiB
CHUNK_BYTES = 64 << 20


def bench_args():
    from mlx_dsv41.synthetic import tiny_args

    return tiny_args(
        vocab_size=129280,
        hidden_size=5120,
        num_hidden_layers=4,
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1280,
        o_lora_rank=1024,
        o_groups=8,
        moe_intermediate_size=2304,
        n_routed_experts=16,
        num_experts_per_tok=6,
        sliding_window=128,
        num_nextn_predict_layers=0,
        compress_ratios=(0, 0, 2, 2),
        kv_source_layer_ids=(2,),
        index_source_layer_ids=(2,),
        candidate_source_layer_id=-1,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        engram_layer_ids=(1,),
        engram_vocab_size=100_000,
        engram_n_heads=8,
        engram_head_dim=256,
        engram_compressed_vocab_size=99092,
        image_token_id=129264,
    )


def _random_rows(rng, dtype: str, shape: tuple[int, ...], rows: slice) -> np.ndarray:
    """Random raw bytes for rows of a tensor, valid for its format (no NaN codes or NaN scales)."""
    from mlx_dsv41.convert.safetensors_io import DTYPES

    n = (rows.stop - rows.start,) + shape[1:] if shape else ()
    if dtype == "F8_E8M0":
        return rng.integers(112, 132, n, dtype=np.uint8)
    if dtype == "F32":
        return rng.standard_normal(n).astype(np.float32)
    raw = np.frombuffer(rng.bytes(int(np.prod(n)) * DTYPES[dtype].itemsize), DTYPES[dtype]).reshape(n).copy()
    if dtype == "F8_E4M3":
        raw[(raw & 0x7F) == 0x7F] = 0x38
    elif dtype == "BF16":
        raw = (raw & 0x807F) | 0x3C00  # |x| in [2^-7, 2^-6): finite
    return raw


def write_source(path: Path, args, seed: int = 3) -> dict:
    """The synthetic official checkpoint (skipped if already complete)."""
    import mlx.core as mx

    from mlx_dsv41.convert.safetensors_io import DTYPES
    from mlx_dsv41.convert.safetensors_writer import SafetensorsWriter
    from mlx_dsv41.quant.official import fp4_shapes, fp8_shapes
    from mlx_dsv41.synthetic import official_shapes
    from mlx_dsv41.synthetic_checkpoints import OFFICIAL_QUANTIZATION, official_format, write_config, write_tokenizer

    done = path / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    specs = []
    for name, (shape, dtype) in official_shapes(args).items():
        fmt = official_format(name)
        if fmt is None:
            specs.append((name, {mx.bfloat16: "BF16", mx.float32: "F32"}[dtype], shape))
        else:
            w_shape, s_shape = (fp8_shapes if fmt == "fp8" else fp4_shapes)(*shape)
            specs.append((name, "F8_E4M3" if fmt == "fp8" else "I8", w_shape))
            specs.append((name.removesuffix(".weight") + ".scale", "F8_E8M0", s_shape))
    layer, rows = args.engram_layer_ids[0], args.engram_num_embeddings[0]
    table = [
        (f"layers.{layer}.engram.embed.weight", "F8_E4M3", (rows, args.engram_head_dim)),
        (f"layers.{layer}.engram.embed.scale", "F8_E8M0", (rows, args.engram_head_dim // 32)),
    ]
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = int(np.prod(spec[2])) * DTYPES[spec[1]].itemsize
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    shards += [current, table]
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with SafetensorsWriter(path / name, shard) as w:
            for tensor, dtype, shape in shard:
                row_bytes = int(np.prod(shape[1:])) * DTYPES[dtype].itemsize if shape else 1
                step = max(1, CHUNK_BYTES // max(row_bytes, 1)) if shape else 1
                for lo in range(0, shape[0] if shape else 1, step):
                    w.write(
                        tensor, _random_rows(rng, dtype, shape, slice(lo, min(lo + step, shape[0] if shape else 1)))
                    )
        weight_map.update({t: name for t, _, _ in shard})
        total += (path / name).stat().st_size
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_config(path, args, OFFICIAL_QUANTIZATION)
    write_tokenizer(path, args)
    info = {"shards": len(shards), "bytes": total, "engram_rows": rows}
    done.write_text(json.dumps(info))
    return info


def drop_cache(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_child(cmd: list[str]) -> dict:
    """Wall time and the child's own rusage (wait4: peak RSS, faults, block I/O)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"bench_convert: {' '.join(cmd)} failed:\n{err}")
    rss = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return {
        "seconds": seconds,
        "peak_rss": rss,
        "major_faults": usage.ru_majflt,
        "read_blocks": usage.ru_inblock,
        "write_blocks": usage.ru_oublock,
        "log": err.strip().splitlines()[-1:],
    }


def conversion(workdir: Path, trials: int) -> dict:
    args = bench_args()
    src = workdir / "src"
    t0 = time.perf_counter()
    info = write_source(src, args)
    print(
        f"source {src}: {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    runs = []
    for trial in range(trials):
        out = workdir / f"out{trial}"
        shutil.rmtree(out, ignore_errors=True)
        drop_cache(src)
        run = run_child([sys.executable, "-m", "mlx_dsv41.convert", str(src), str(out)])
        run["out_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        run["noop_seconds"] = run_child([sys.executable, "-m", "mlx_dsv41.convert", str(src), str(out), "-q"])[
            "seconds"
        ]
        shutil.rmtree(out)
        print(
            f"trial {trial}: {run['seconds']:.1f} s, {info['bytes'] / 1e6 / run['seconds']:.0f} MB/s read, "
            f"peak RSS {run['peak_rss'] / 1e6:.0f} MB, second run {run['noop_seconds']:.2f} s",
            flush=True,
        )
        runs.append(run)
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    return {
        "source_bytes": info["bytes"],
        "out_bytes": runs[0]["out_bytes"],
        "shards": info["shards"],
        "engram_rows": info["engram_rows"],
        "seconds": med("seconds"),
        "read_MBps": info["bytes"] / 1e6 / med("seconds"),
        "write_MBps": runs[0]["out_bytes"] / 1e6 / med("seconds"),
        "peak_rss": med("peak_rss"),
        "noop_seconds": med("noop_seconds"),
        "trials": runs,
    }


def decode_faults(workdir: Path, steps: int = 64, warmup: int = 8) -> list[dict]:
    import mlx.core as mx

    from mlx_dsv41.convert.checkpoint import convert_checkpoint
    from mlx_dsv41.loading import load_converted
    from mlx_dsv41.synthetic_checkpoints import write_engram_shards, write_exl3_checkpoint, write_official_checkpoint

    tiny = workdir / "tiny"
    shutil.rmtree(tiny, ignore_errors=True)
    ck = write_official_checkpoint(tiny / "official")
    convert_checkpoint(ck.path, tiny / "official_out", progress=False)
    ce = write_exl3_checkpoint(tiny / "exl3")
    write_engram_shards(tiny / "engram", ce.args, ce.tables)
    convert_checkpoint(ce.path, tiny / "exl3_out", engram_from=tiny / "engram", progress=False)
    rows = []
    for name in ("official_out", "exl3_out"):
        for mode in ("pread", "mmap"):
            model = load_converted(tiny / name, lazy=False, engram_mode=mode)
            cache = model.make_cache()
            token = model(mx.array(np.random.default_rng(0).integers(3, 159, (1, 16))), cache=cache)[:, -1:].argmax(-1)
            for _ in range(warmup):
                token = model(token, cache=cache)[:, -1:].argmax(-1)
            mx.eval(token)
            before, read0 = (
                resource.getrusage(resource.RUSAGE_SELF),
                {k: s.stats.rows_requested for k, s in model.engram_sources.items()},
            )
            t0 = time.perf_counter()
            for _ in range(steps):
                token = model(token, cache=cache)[:, -1:].argmax(-1)
                mx.eval(token)
            seconds = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_SELF)
            engram_rows = sum(s.stats.rows_requested - read0[k] for k, s in model.engram_sources.items())
            rows.append(
                {
                    "checkpoint": name.removesuffix("_out"),
                    "engram_mode": mode,
                    "major_faults_per_token": (after.ru_majflt - before.ru_majflt) / steps,
                    "minor_faults_per_token": (after.ru_minflt - before.ru_minflt) / steps,
                    "engram_rows_per_token": engram_rows / steps,
                    "ms_per_token": 1e3 * seconds / steps,
                }
            )
            for s in model.engram_sources.values():
                s.close()
            print(rows[-1], flush=True)
    shutil.rmtree(tiny)
    return rows


def markdown(result: dict) -> str:
    c = result["conversion"]
    lines = [
        f"Synthetic official checkpoint: {c['source_bytes'] / 1e9:.2f} GB in {c['shards']} shards "
        f"-> {c['out_bytes'] / 1e9:.2f} GB converted (median of {len(c['trials'])} cold trials).",
        "",
        "| seconds | read MB/s | write MB/s | peak RSS MB | second run (no-op) s |",
        "|---|---|---|---|---|",
        f"| {c['seconds']:.1f} | {c['read_MBps']:.0f} | {c['write_MBps']:.0f} | {c['peak_rss'] / 1e6:.0f} "
        f"| {c['noop_seconds']:.2f} |",
        "",
        "| checkpoint | Engram mode | major faults / token | minor faults / token | Engram rows / token | ms / token |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["decode"]:
        lines.append(
            f"| {r['checkpoint']} | {r['engram_mode']} | {r['major_faults_per_token']:.2f} | "
            f"{r['minor_faults_per_token']:.1f} | {r['engram_rows_per_token']:.0f} | {r['ms_per_token']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/mlx_dsv41_bench_convert"))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--on-gpu-host", action="store_true")
    args = ap.parse_args()
    if shutil.which("nvidia-smi") and not args.on_gpu_host:
        print(
            "bench_convert: storage benchmark for the development machine; skipped on the GPU host "
            "(--on-gpu-host to run it)"
        )
        return
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    import mlx.core as mx

    result = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "conversion": conversion(args.workdir, args.trials),
        "decode": decode_faults(args.workdir),
    }
    (args.out / "bench_convert.json").write_text(json.dumps(result, indent=1))
    (args.out / "bench_convert.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
