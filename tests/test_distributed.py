"""Expert parallelism (issue 7) on the ring backend over localhost: 2 and 4 ranks give the same
logits bytes and tokens as one process in both partitions (dense and EXL3 experts, Engram on; the
CLI with DSpark drafting, the stages' experts split too);
each rank loads and reads only its experts; no collective runs while a forward builds its graph;
`mlx.launch ... python -m mlx_dsv41.generate` prints the one-process text; ranks that disagree fail
with one clear line; a dead, frozen, stalled or failed peer ends the others within the watchdog
bound.

Ranks are subprocesses of tests/dist_worker.py with MLX_RANK / MLX_HOSTFILE on free ports
(docs/mlx.md#ring-backend); the one-process reference is the same script without them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import distributed
from mlx_dsv41.quant import DenseExperts
from mlx_dsv41.synthetic import random_engram_tables, random_weights, tiny_args, tiny_model, write_checkpoint
from mlx_dsv41.synthetic_checkpoints import write_exl3_checkpoint
from mlx_dsv41.watchdog import EXIT_CODE

WORKER = Path(__file__).with_name("dist_worker.py")
ARGS = tiny_args()  # 8 layers, 8 experts top-2, Engram at layers 1 and 2
DECODE = 5


# ------------------------------------------------------------------------------- launching


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "MLX_IBV", "MLX_JACCL", "NCCL_", "MLX_DSV41_WATCHDOG")
        )
    }
    return {**env, **extra}


def start_ranks(tmp: Path, n: int, argv, **popen) -> list[subprocess.Popen]:
    """n ring ranks; argv(rank) is the worker's argument list for that rank."""
    hostfile = tmp / f"hosts_{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), *map(str, argv(r))],
            env=_env({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )
        for r in range(n)
    ]


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    """(returncode, stderr) per rank; kills everything left at the deadline."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def run_ranks(tmp: Path, n: int, argv, timeout: float = 120) -> list[tuple[int, str]]:
    return finish(start_ranks(tmp, n, argv), timeout)


def last_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------------------- fixtures


def _save_tables(path: Path, tables: dict[int, np.ndarray]) -> Path:
    np.savez(path / "engram_tables.npz", **{str(layer): rows for layer, rows in tables.items()})
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Plain bf16 checkpoint: dense experts (bf16-valued per-slot outputs)."""
    path = tmp_path_factory.mktemp("dist_ckpt")
    tables = random_engram_tables(ARGS, seed=3)
    write_checkpoint(path, ARGS, random_weights(ARGS, seed=3), tables)
    return _save_tables(path, tables)


@pytest.fixture(scope="module")
def exl3_ckpt(tmp_path_factory) -> Path:
    """exllamav3-layout checkpoint: EXL3 experts at mixed K (the real checkpoint's format)."""
    ck = write_exl3_checkpoint(tmp_path_factory.mktemp("dist_exl3"), ARGS, seed=4)
    return _save_tables(ck.path, ck.tables)


@pytest.fixture(scope="module")
def checkpoints(ckpt, exl3_ckpt) -> dict[str, Path]:
    return {"dense": ckpt, "exl3": exl3_ckpt}


@pytest.fixture(scope="module")
def references(checkpoints, tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """The one-process runs: the same worker, no distributed environment."""
    out = {}
    for fmt, path in checkpoints.items():
        file = tmp_path_factory.mktemp("dist_ref") / f"{fmt}.npz"
        proc = subprocess.run(
            [sys.executable, str(WORKER), "generate", str(path), str(file), "--decode", str(DECODE)],
            env=_env({}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out[fmt] = dict(np.load(file))
    return out


def _expert_file_bytes(path: Path) -> int:
    """Stored bytes of the routed experts (safetensors headers only: mx.load is lazy)."""
    return sum(v.nbytes for f in path.glob("*.safetensors") for k, v in mx.load(str(f)).items() if ".ffn.experts." in k)


# ------------------------------------------------------------------------------- one process


def test_one_process_is_untouched():
    assert distributed.init("experts") is None  # not launched: no group, nothing installed
    assert distributed.expert_range(None, 384) is None
    model = tiny_model(ARGS)
    distributed.apply(model, None)
    assert all(layer.ffn.exchange is None for layer in model.layers)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="moe partition must be one of experts, slots; got 'rows'"):
        distributed.init("rows")
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        distributed.init("experts", timeout_s=0)
    with pytest.raises(ValueError, match="rank count that divides the 384 routed experts; got 5 ranks"):
        distributed.held_experts(0, 5, "experts", 384)
    shares = [distributed.held_experts(r, 4, "experts", 384) for r in range(4)]
    assert shares == [(0, 96), (96, 192), (192, 288), (288, 384)]
    assert distributed.held_experts(3, 4, "slots", 384) == (0, 384)


def test_slot_columns_cover_every_slot_once():
    # Rank r's j-th gathered slot is slot j*n + r; padding (slot >= k) is dropped.
    for n in (1, 2, 3, 4, 8):
        for k in (1, 2, 6):
            owners = {}
            for r in range(n):
                cluster = distributed.Cluster(None, r, n, "slots")
                cols = np.array(distributed.SlotsExchange(cluster).columns(k)).tolist()
                assert len(cols) == -(-k // n)
                for j, c in enumerate(cols):
                    if j * n + r < k:
                        assert c == j * n + r
                        owners.setdefault(c, []).append(r)
            assert owners == {s: [s % n] for s in range(k)}


def test_signed_zero_rule():
    # Why non-owners send -0.0: x + (-0.0) is x for every bf16 x, while +0.0 turns -0.0 into +0.0.
    every = mx.array(np.arange(1 << 16, dtype=np.uint16)).view(mx.bfloat16)
    nan = mx.isnan(every)
    minus = (every + mx.array(-0.0, mx.bfloat16)).view(mx.uint16) == every.view(mx.uint16)
    assert bool(mx.all(minus | nan))
    plus = (every + mx.array(0.0, mx.bfloat16)).view(mx.uint16) == every.view(mx.uint16)
    assert int(mx.sum(~plus & ~nan)) == 1  # exactly -0.0 changes


def test_rounding_probe():
    # Dense experts round each slot to the activation dtype (bf16 travels exactly); a module that
    # returns unrounded fp32 is caught, so apply exchanges float32 for it.
    dense = DenseExperts(8, 64, 32, 10.0, (4, 8))
    assert distributed.rounds_to(dense, (4, 8), 64, 2, mx.bfloat16).item()

    class Unrounded:
        def __call__(self, x, indices, weights):
            return dense(x, indices, weights) * (1 + 2.0**-12)

    assert not distributed.rounds_to(Unrounded(), (4, 8), 64, 2, mx.bfloat16).item()
    assert distributed.rounds_to(Unrounded(), (4, 8), 64, 2, mx.float32).item()


# ------------------------------------------------------------------------------- exchanges


@pytest.mark.parametrize("partition", ["experts", "slots"])
def test_exchange_keeps_every_byte(tmp_path, partition):
    """Crafted per-slot outputs with ±0.0, ±inf and NaN come back byte for byte on every rank."""
    out = tmp_path / "ex_{rank}.npz"
    results = run_ranks(tmp_path, 2, lambda r: ["exchange", out, "--partition", partition])
    assert all(rc == 0 for rc, _ in results), results
    for r in range(2):
        d = np.load(str(out).replace("{rank}", str(r)))
        assert np.array_equal(d["got"].view(np.uint32), d["expected"].view(np.uint32))
        if partition == "experts":  # +0.0 from non-owners would have flipped every owned -0.0
            flipped = d["plus"].view(np.uint32) != d["expected"].view(np.uint32)
            assert flipped.any() and np.all(np.signbit(d["expected"][flipped]))


# ------------------------------------------------------------------------------- model runs


@pytest.mark.parametrize(
    "fmt, n, partition",
    [
        ("dense", 2, "experts"),
        ("dense", 2, "slots"),
        ("dense", 4, "experts"),
        ("dense", 4, "slots"),
        ("exl3", 2, "experts"),
        ("exl3", 2, "slots"),
    ],
)
def test_ranks_match_one_process(tmp_path, checkpoints, references, fmt, n, partition):
    path, reference = checkpoints[fmt], references[fmt]
    out = tmp_path / "run_{rank}.npz"
    lag = ["--lag", n - 1] if (fmt, n) == ("dense", 2) else []
    results = run_ranks(
        tmp_path, n, lambda r: ["generate", path, out, "--partition", partition, "--decode", DECODE, *lag]
    )
    assert all(rc == 0 for rc, _ in results), results
    k, D, L = ARGS.num_experts_per_tok, ARGS.hidden_size, ARGS.num_hidden_layers
    for r in range(n):
        got = dict(np.load(str(out).replace("{rank}", str(r))))
        assert np.array_equal(got["tokens"], reference["tokens"])
        for part in ("prefill", "decode"):  # logits bytes, every position of every step
            assert np.array_equal(got[part].view(np.uint32), reference[part].view(np.uint32)), (r, part)
        # One exchange per MoE layer per forward; this rank's payload is [T, k or ceil(k/n), D] in
        # bf16 when the experts round to bf16 (dense does), else float32.
        assert got["exchanges_per_step"].tolist() == [L] * DECODE
        if lag and r != n - 1:  # a forward only builds the graph: it never waited for the late rank
            assert max(got["build_seconds"]) < 0.4, got["build_seconds"]
        wire = int(got["wire_itemsize"])
        assert wire == 2 if fmt == "dense" else wire in (2, 4)
        tokens = 2 * 20 + 2 * DECODE  # worker: batch 2, prompt 20, then DECODE steps
        per_token = (k if partition == "experts" else -(-k // n)) * D * wire
        assert int(got["exchange_bytes"]) == L * tokens * per_token
        if partition == "experts":  # each rank holds and reads only its share of the experts
            assert int(got["expert_bytes"]) * n == int(reference["expert_bytes"])
            unread = int(reference["read_bytes"]) - int(got["read_bytes"])
            stored = _expert_file_bytes(path)
            assert abs(unread - stored * (n - 1) / n) < 0.01 * stored, (unread, stored)
        else:
            assert int(got["expert_bytes"]) == int(reference["expert_bytes"])


_LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()"
_CLI = ("--demo", "--prompt", "Hello there", "--max-tokens", "8")


@pytest.fixture(scope="module")
def demo_text(tmp_path_factory) -> tuple[dict[str, str], str]:
    """(environment with a private demo cache, the one-process CLI's greedy text)."""
    env = _env({"MLX_DSV41_CACHE": str(tmp_path_factory.mktemp("demo_cache"))})
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dsv41.generate", *_CLI],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    return env, proc.stdout


@pytest.mark.parametrize("partition", ["experts", "slots"])
def test_cli_under_mlx_launch(demo_text, partition):
    """`mlx.launch --backend ring -n 2 python -m mlx_dsv41.generate ...` prints (on rank 0 only)
    exactly the one-process text."""
    env, single = demo_text
    cmd = [
        sys.executable,
        "-c",
        _LAUNCH,
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(_free_ports(1)[0]),
        sys.executable,
        "-m",
        "mlx_dsv41.generate",
        *_CLI,
        "--moe-partition",
        partition,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert single.strip() and proc.stdout == single
    assert "DSpark:" in proc.stderr  # the demo drafts: two ranks, one process's tokens, DSpark on


# ------------------------------------------------------------------------------- disagreement


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory) -> Path:
    args = tiny_args(rope_theta=20000.0)
    path = tmp_path_factory.mktemp("dist_ckpt_other")
    tables = random_engram_tables(args, seed=3)
    write_checkpoint(path, args, random_weights(args, seed=3), tables)
    return _save_tables(path, tables)


def _all_fail_with(results, message: str) -> None:
    for rank, (rc, err) in enumerate(results):
        assert rc != 0, f"rank {rank} succeeded"
        assert message in last_line(err), (rank, err[-2000:])


def test_partitions_must_agree(tmp_path, ckpt):
    results = run_ranks(
        tmp_path, 2, lambda r: ["generate", ckpt, tmp_path / "o{rank}.npz", "--partition", ("experts", "slots")[r]]
    )
    _all_fail_with(
        results,
        "DistributedError: ranks disagree on the moe partition "
        "(rank 0 'experts', rank 1 'slots'): launch every rank with the same "
        "--moe-partition",
    )


def test_configs_must_agree(tmp_path, ckpt, other_ckpt):
    results = run_ranks(tmp_path, 2, lambda r: ["generate", (ckpt, other_ckpt)[r], tmp_path / "o{rank}.npz"])
    _all_fail_with(results, "ranks disagree on the model config (rank 0 ")
    assert "load the same checkpoint on every rank" in last_line(results[0][1])


def test_each_rank_must_hold_its_share(tmp_path, ckpt):
    results = run_ranks(
        tmp_path, 2, lambda r: ["generate", ckpt, tmp_path / "o{rank}.npz", *(["--all-experts"] if r == 1 else [])]
    )
    _all_fail_with(
        results,
        "DistributedError: rank 1 of 2 ('experts' partition) must hold experts "
        "4..7 but its layers.0.ffn.experts holds 0..7: load with "
        "expert_range=distributed.expert_range(cluster, 8)",
    )


# ------------------------------------------------------------------------------- watchdog

TIMEOUT = 3.0  # the watchdog bound in these runs (plus one heartbeat, 0.375 s)


def _loop(tmp_path, ckpt, **fault) -> list[subprocess.Popen]:
    extra = [f"--{k}={v}" for k, v in fault.items()]
    return start_ranks(tmp_path, 2, lambda r: ["loop", ckpt, "--timeout", TIMEOUT, *extra])


def _wait_for_step(proc: subprocess.Popen, step: int, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == f"step {step}":
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"rank exited early: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"no 'step {step}' within {limit} s")


# When the peer's process is gone, the ring backend may notice first (its sockets close) and
# fail the collective; the watchdog turns that into the same one-line exit.
RING_LOST = "a collective failed: [ring] connection to a peer was lost"


def _survivor_exits(proc: subprocess.Popen, t0: float, bound: float, *messages: str) -> None:
    rc, err = finish([proc], timeout=bound + 30)[0]
    elapsed = time.monotonic() - t0
    assert rc == EXIT_CODE, (rc, err[-2000:])
    assert any(f"mlx_dsv41.distributed: rank 0 of 2: {m}" in last_line(err) for m in messages), err[-2000:]
    assert elapsed < bound, f"took {elapsed:.1f} s, bound {bound} s"


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_lost_peer_ends_the_survivor(tmp_path, ckpt, how):
    procs = _loop(tmp_path, ckpt)
    try:
        _wait_for_step(procs[1], 3)
        t0 = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "kill":  # at once: the side channel closes
            _survivor_exits(
                procs[0], t0, 5.0, "rank 1 disconnected without finishing: its process died or was killed", RING_LOST
            )
        else:  # frozen: silence for TIMEOUT, then one heartbeat interval
            _survivor_exits(procs[0], t0, TIMEOUT + 5.0, "rank 1 stopped answering: nothing heard for 3 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.mark.parametrize(
    "act, message",
    [
        ("stall", "rank 1 stopped making progress: it has built"),
        ("fail", "rank 1 exited with an error (see its output)"),
        ("exit", "rank 1 exited after"),
    ],
)
def test_misbehaving_peer_ends_the_survivor(tmp_path, ckpt, act, message):
    procs = _loop(tmp_path, ckpt, victim=1, at=3, act=act)
    try:
        _wait_for_step(procs[1], 3)
        t0 = time.monotonic()
        bound = TIMEOUT + 5.0 if act == "stall" else 5.0
        _survivor_exits(procs[0], t0, bound, message, *([RING_LOST] if act != "stall" else []))
        if act == "fail":
            assert "RuntimeError: injected failure" in finish([procs[1]])[0][1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
