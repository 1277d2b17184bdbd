"""One rank of the distributed tests (tests/test_distributed.py), or the one-process reference.

Launched with MLX_RANK / MLX_HOSTFILE (ring backend, docs/mlx.md#ring-backend) or without them (one
process, `distributed.init` gives None and nothing distributed runs: the same code path as the CLI).

    generate CKPT OUT   prefill + greedy decode; writes tokens, logits and load figures to OUT
                        ("{rank}" in OUT is replaced by the rank)
    loop CKPT           decode until killed, printing "step i"; --victim/--at/--act inject a fault
    exchange OUT        both exchanges on crafted per-slot outputs (signed zeros, inf, NaN)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_dsv41 import distributed
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.loading import load_model
from mlx_dsv41.model.engram import MemoryRowSource
from mlx_dsv41.synthetic import synthetic_token_map

BATCH, PROMPT = 2, 20


def read_bytes() -> int:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def load(ckpt: Path, cluster, all_experts: bool = False):
    """(model, bytes read while loading the weights). Engram rows come from the tables the test
    saved next to the checkpoint (`engram_tables.npz`, layer -> rows)."""
    args = ModelArgs.from_file(ckpt / "config.json")
    rng = None if all_experts else distributed.expert_range(cluster, args.n_routed_experts)
    before = read_bytes()
    model = load_model(ckpt, lazy=False, expert_range=rng)
    read = read_bytes() - before
    tables = np.load(ckpt / "engram_tables.npz")
    model.set_engram(synthetic_token_map(args), {L: MemoryRowSource(tables[str(L)]) for L in args.engram_layer_ids})
    return model, read


def prompt(vocab: int) -> mx.array:
    return mx.array(np.random.default_rng(5).integers(0, vocab - 1, (BATCH, PROMPT)), mx.int32)


def cmd_generate(a) -> None:
    cluster = distributed.init(a.partition, timeout_s=a.timeout)
    model, read = load(a.ckpt, cluster, a.all_experts)
    distributed.apply(model, cluster)
    cache = model.make_cache()
    logits = model(prompt(model.args.vocab_size), cache)
    steps, tokens = [np.array(logits)], []
    exchanges_per_step, build_seconds = [], []
    rank = cluster.rank if cluster else 0
    for _ in range(a.decode):
        tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        tokens.append(np.array(tok))
        before = cluster.exchanges if cluster else 0
        if rank == a.lag:  # the others' forwards must not wait for this rank: no collective runs
            time.sleep(a.lag_seconds)  # while a graph is built (one evaluated graph per token)
        t0 = time.perf_counter()
        logits = model(tok, cache)
        build_seconds.append(time.perf_counter() - t0)
        steps.append(np.array(logits))
        exchanges_per_step.append((cluster.exchanges if cluster else 0) - before)
    experts = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if ".ffn.experts." in k)
    np.savez(
        str(a.out).replace("{rank}", str(rank)),
        prefill=steps[0],
        build_seconds=build_seconds,
        decode=np.concatenate(steps[1:], axis=1),
        tokens=np.concatenate(tokens, axis=1),
        expert_bytes=experts,
        read_bytes=read,
        exchanges_per_step=np.array(exchanges_per_step),
        exchange_bytes=cluster.exchange_bytes if cluster else 0,
        wire_itemsize=wire_itemsize(model),
    )


def wire_itemsize(model) -> int:
    """Bytes per exchanged value: the activation dtype's unless apply chose float32."""
    exchange = model.layers[0].ffn.exchange
    if exchange is None:
        return 0
    return (exchange.wire or model.embed.weight.dtype).size


def cmd_loop(a) -> None:
    cluster = distributed.init(a.partition, timeout_s=a.timeout)
    model, _ = load(a.ckpt, cluster)
    distributed.apply(model, cluster)
    cache = model.make_cache()
    logits = model(prompt(model.args.vocab_size), cache)
    for step in range(100_000):
        tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        logits = model(tok, cache)
        mx.eval(logits)
        print(f"step {step}", flush=True)
        if cluster.rank == a.victim and step == a.at:
            if a.act == "stall":  # alive and heartbeating, but never builds the next forward
                time.sleep(3600)
            if a.act == "fail":
                raise RuntimeError("injected failure")
            if a.act == "exit":
                sys.exit(0)


class CraftedExperts:
    """Stands in for an experts module: fixed per-slot outputs for the slots it owns, exactly 0
    elsewhere (the experts contract), so the exchange alone decides the bytes."""

    def __init__(self, values: mx.array, expert_range: tuple[int, int], slots_mode: bool):
        self.values, self.expert_range, self.slots_mode = values, expert_range, slots_mode

    def __call__(self, x, indices, weights):
        if self.slots_mode:  # called with this rank's slot columns: look them up by weight = slot id
            return mx.take(self.values, weights[0].astype(mx.int32), axis=1)
        lo, hi = self.expert_range
        inside = (indices >= lo) & (indices < hi)
        return mx.where(inside[..., None], self.values, 0.0)


def crafted_slots(T: int, k: int, D: int) -> np.ndarray:
    """bf16-valued fp32 [T, k, D]: random values, +0.0, -0.0, ±inf and NaN at known places."""
    rng = np.random.default_rng(11)
    v = rng.standard_normal((T, k, D)).astype(np.float32)
    v = np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32))
    v[:, :, 0] = -0.0
    v[:, :, 1] = 0.0
    v[0, :, 2], v[0, :, 3], v[0, :, 4] = np.inf, -np.inf, np.nan
    return v


def cmd_exchange(a) -> None:
    cluster = distributed.init(a.partition, timeout_s=a.timeout)
    T, k, D, E = 3, 4, 8, 8
    values = crafted_slots(T, k, D)
    rng = np.random.default_rng(3)
    indices = mx.array(np.stack([np.sort(rng.choice(E, k, replace=False)) for _ in range(T)]), mx.int32)
    slot_ids = mx.broadcast_to(mx.arange(k, dtype=mx.float32), (T, k))  # slots mode: weight = slot id
    x = mx.zeros((T, D), mx.bfloat16)
    slots_mode = a.partition == "slots"
    lo_hi = distributed.expert_range(cluster, E) or (0, E)
    experts = CraftedExperts(mx.array(values), lo_hi, slots_mode)
    exchange = (distributed.SlotsExchange if slots_mode else distributed.ExpertsExchange)(cluster)
    got = np.array(exchange(experts, x, indices, slot_ids))
    # The same sum with +0.0 for the slots other ranks own: shows the crafted -0.0s matter.
    owned = (indices >= lo_hi[0]) & (indices < lo_hi[1])
    plus = mx.where(owned[..., None], mx.array(values), 0.0).astype(mx.bfloat16)
    plus = np.array(mx.distributed.all_sum(plus, group=cluster.group).astype(mx.float32))
    np.savez(str(a.out).replace("{rank}", str(cluster.rank)), got=got, expected=values, plus=plus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "loop", "exchange"):
        p = sub.add_parser(name)
        if name != "exchange":
            p.add_argument("ckpt", type=Path)
        if name != "loop":
            p.add_argument("out")
        p.add_argument("--partition", default="experts")
        p.add_argument("--timeout", type=float, default=60.0)
        if name == "generate":
            p.add_argument("--decode", type=int, default=5)
            p.add_argument("--all-experts", action="store_true", help="ignore the rank's share (a mistake)")
            p.add_argument("--lag", type=int, default=-1, help="this rank sleeps before each decode forward")
            p.add_argument("--lag-seconds", type=float, default=0.8)
        if name == "loop":
            p.add_argument("--victim", type=int, default=-1)
            p.add_argument("--at", type=int, default=-1)
            p.add_argument("--act", choices=("stall", "fail", "exit"), default=None)
    a = ap.parse_args()
    {"generate": cmd_generate, "loop": cmd_loop, "exchange": cmd_exchange}[a.cmd](a)


if __name__ == "__main__":
    main()
