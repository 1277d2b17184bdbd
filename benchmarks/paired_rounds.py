"""Decode speed in alternating rounds: each model decodes a block of tokens in turn, round after
round, in one process, so that the host's drift (a shared 2-core machine's pace moves by 1.5x
within a minute) falls on every model alike. Each round gives each model's ms/token and its ratio
to the reference model of that round; the report holds the rounds' medians. Beside the pace, each
thread's CPU time per token (Linux, /proc/self/task): the main thread (Python building the graph,
a compiled step's replay, MLX encoding every node and waiting on its stream) apart from the rest
(MLX's CPU stream running the nodes, BLAS threads).

Used by bench_model.py (--rounds); docs/benchmarks.md says what it showed.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx


def thread_cpu_s() -> dict[int, float]:
    """Each thread's user + system CPU seconds ({} where /proc/self/task is not there)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(t)] = (int(fields[11]) + int(fields[12])) / tick
    return out


@contextmanager
def environment(settings: dict[str, str]):
    """os.environ with `settings` inside, as it was after (a variable unset before is unset again)."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Contender:
    """A model in the rounds: `forward(ids, cache)` -> logits, under `env` (e.g. the compile switch)."""

    name: str
    forward: object
    cache: object
    env: dict = field(default_factory=dict)
    token: mx.array | None = None
    runs: dict = field(default_factory=lambda: {"sync": [], "pipelined": [], "main_cpu": [], "other_cpu": []})

    def next_token(self, token: mx.array) -> mx.array:
        return mx.argmax(self.forward(token, self.cache)[:, -1:], axis=-1).astype(mx.int32)


def sync_block(c: Contender, steps: int) -> float:
    """`steps` tokens, each evaluated before the next is built: ms per token."""
    t0 = time.perf_counter()
    for _ in range(steps):
        c.token = c.next_token(c.token)
        mx.eval(c.token)
    return 1e3 * (time.perf_counter() - t0) / steps


def pipelined_block(c: Contender, steps: int) -> tuple[float, float, float]:
    """mlx-lm's loop (token i+1 built and queued before token i is read), timed from the first
    token read to the last; with the main thread's and the other threads' CPU ms per token."""
    main = threading.get_native_id()
    nxt = c.next_token(c.token)
    mx.async_eval(nxt)
    int(nxt.item())
    before, t0 = thread_cpu_s(), time.perf_counter()
    for _ in range(steps):
        cur = nxt
        nxt = c.next_token(cur)
        mx.async_eval(nxt)
        int(cur.item())
    int(nxt.item())
    wall, after = time.perf_counter() - t0, thread_cpu_s()
    c.token = nxt
    used = {t: s - before.get(t, 0.0) for t, s in after.items()}
    main_s = used.pop(main, 0.0)
    return 1e3 * wall / steps, 1e3 * main_s / steps, 1e3 * sum(used.values()) / steps


def run(contenders: list[Contender], prompt: mx.array, rounds: int, steps: int, warmup: int = 2) -> dict:
    """Prefill each, `warmup` steps each, then `rounds` rounds of `steps` tokens each, synchronous
    then pipelined. The last contender is the reference of the ratios."""
    for c in contenders:
        with environment(c.env):
            c.token = c.next_token(prompt)
            mx.eval(c.token)
            sync_block(c, warmup)
    for _ in range(rounds):
        for c in contenders:
            with environment(c.env):
                c.runs["sync"].append(sync_block(c, steps))
                pace, main_cpu, other_cpu = pipelined_block(c, steps)
            c.runs["pipelined"].append(pace)
            c.runs["main_cpu"].append(main_cpu)
            c.runs["other_cpu"].append(other_cpu)
    ref = contenders[-1]
    out = {"rounds": rounds, "steps_per_round": steps, "reference": ref.name, "models": {}}
    for c in contenders:
        d = {f"{k}_ms": statistics.median(v) for k, v in c.runs.items()}
        d["pipelined_ms_each_round"] = [round(v, 2) for v in c.runs["pipelined"]]
        for mode in ("sync", "pipelined"):
            ratios = [r / m for m, r in zip(c.runs[mode], ref.runs[mode])]
            d[f"{mode}_ratio_median"] = statistics.median(ratios)
        out["models"][c.name] = d
    return out


def table(result: dict) -> str:
    ref = result["reference"]
    lines = [
        f"Alternating rounds ({result['rounds']} x {result['steps_per_round']} tokens each; medians; "
        f"ratio: {ref}'s ms/token over the model's, round by round)",
        "| model | ms/token sync | ms/token pipelined | tokens/s pipelined | CPU ms/token: main thread / others "
        "| x reference, sync / pipelined |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, d in result["models"].items():
        lines.append(
            f"| {name} | {d['sync_ms']:.2f} | {d['pipelined_ms']:.2f} | {1e3 / d['pipelined_ms']:.1f} "
            f"| {d['main_cpu_ms']:.2f} / {d['other_cpu_ms']:.2f} "
            f"| {d['sync_ratio_median']:.2f}x / {d['pipelined_ratio_median']:.2f}x |"
        )
    return "\n".join(lines)
