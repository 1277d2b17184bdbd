"""Expert parallelism over mx.distributed (issue 7): the same tokens as one process.

Attention, router, shared expert, Engram and head are replicated; the routed experts are split.
Each rank computes the routed outputs it owns for every token's selected slots, one collective per
MoE layer brings the per-slot outputs [T, k, D] together, and every rank sums them in the original
slot order (model/moe.py), so logits and tokens are bit-identical to one process on the same backend.

    cluster = distributed.init("experts")             # None in one process
    model = load_model(path, expert_range=distributed.expert_range(cluster, args.n_routed_experts))
    distributed.apply(model, cluster)                 # checks the ranks agree, installs the exchange

Partitions (`--moe-partition`):
- "experts": rank r holds the contiguous experts [r·E/n, (r+1)·E/n) and computes the slots routed
  to them. Per layer one `all_sum` of [T, k, D] in the activation dtype (bf16): the owner's value
  plus -0.0 from every other rank. x + (-0.0) == x bit for bit for every x, -0.0 included (+0.0
  would turn an owner's -0.0 into +0.0), so the sum reproduces the owner's bytes in any order.
- "slots": every rank holds every expert (the reference engine's split); rank r computes slots
  r, r+n, r+2n, ... and one `all_gather` of [T, ceil(k/n), D] restores the slot order.
Per-slot outputs are bf16-valued (the experts contract, docs/design.md), so exchanging bf16 is
exact; `apply` probes every experts module once and exchanges float32 instead (twice the bytes,
still exact) for modules that return unrounded values. Both exchanges are lazy: every layer's
collective sits in the one graph a forward builds (no host sync per layer).

Ranks must agree: `init` checks the partition, `apply` the software versions, the config and the
loaded tensors (names, shapes, dtypes); a mismatch is a one-line DistributedError on every rank.
`init` also starts the peer watchdog (mlx_dsv41/watchdog.py): a dead, frozen or stalled peer ends
every other rank with a one-line error within `timeout_s` (+ at most 2 s).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_dsv41 import __version__
from mlx_dsv41.model.moe import MoE
from mlx_dsv41.watchdog import Watchdog, hub_host, open_hub

PARTITIONS = ("experts", "slots")
_HOST_BYTES = 64  # rank 0's address travels in the init all_gather as one int32 per byte


class DistributedError(RuntimeError):
    """Ranks that cannot run together (they disagree on the partition, the model or the software)."""


@dataclass(eq=False)
class Cluster:
    """This process's place in the group. `exchanges` and `exchange_bytes` count the collectives
    built so far and the bytes this rank passed into them (graph-build time, not evaluation)."""

    group: mx.distributed.Group
    rank: int
    size: int
    partition: str
    watchdog: Watchdog | None = None
    exchanges: int = 0
    exchange_bytes: int = 0

    def note_exchange(self, nbytes: int) -> None:
        self.exchanges += 1
        self.exchange_bytes += nbytes
        if self.watchdog is not None:
            self.watchdog.note_exchange()


# --------------------------------------------------------------------------------- setup


def _gather_rows(group: mx.distributed.Group, row: list[int]) -> np.ndarray:
    """Every rank's int32 row, [size, len(row)] (one collective, evaluated now)."""
    return np.array(mx.distributed.all_gather(mx.array([row], mx.int32), group=group))


def init(partition: str = "experts", timeout_s: float = 120.0) -> Cluster | None:
    """Join the group mlx.launch set up; None when there is none (one process).

    All ranks must pass the same partition. The watchdog bound is the largest `timeout_s` of any
    rank: it must exceed the longest evaluation of one forward (first-call JIT compiles included).
    MLX_DSV41_WATCHDOG=0 turns the watchdog off; MLX_DSV41_WATCHDOG_HOST / _PORT set rank 0's
    address for it when the launch environment does not tell it (or a firewall needs a fixed port).
    """
    if partition not in PARTITIONS:
        raise ValueError(f"moe partition must be one of {', '.join(PARTITIONS)}; got {partition!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    group = mx.distributed.init()
    if group.size() == 1:
        return None
    rank, size = group.rank(), group.size()

    hub, host = None, ""
    if rank == 0 and os.environ.get("MLX_DSV41_WATCHDOG", "1") != "0":
        host = hub_host() or ""
        try:
            hub = open_hub(host) if host else None
        except OSError as e:
            print(f"mlx_dsv41.distributed: cannot listen on {host} for the watchdog ({e})", file=sys.stderr)
    port = hub.getsockname()[1] if hub else 0
    encoded = list(host.encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0"))
    rows = _gather_rows(group, [PARTITIONS.index(partition), int(timeout_s * 1000), port, *encoded])

    if len(set(rows[:, 0])) > 1:
        told = ", ".join(f"rank {r} {PARTITIONS[p]!r}" for r, p in enumerate(rows[:, 0]))
        raise DistributedError(
            f"ranks disagree on the moe partition ({told}): launch every rank with the same --moe-partition"
        )
    timeout_s = float(rows[:, 1].max()) / 1000
    port = int(rows[0, 2])
    host = bytes(rows[0, 3:].astype(np.uint8)).rstrip(b"\0").decode()
    watchdog = None
    if port:
        watchdog = Watchdog.start(rank, size, timeout_s, (host, port), hub)
    elif rank == 0:
        print(
            "mlx_dsv41.distributed: watchdog off (MLX_DSV41_WATCHDOG=0, or rank 0's address is "
            "unknown: set MLX_DSV41_WATCHDOG_HOST): a lost peer can hang the others",
            file=sys.stderr,
        )
    return Cluster(group, rank, size, partition, watchdog)


def held_experts(rank: int, size: int, partition: str, n_experts: int) -> tuple[int, int]:
    """(lo, hi): the experts rank `rank` of `size` holds under `partition`."""
    if partition == "slots":
        return 0, n_experts
    if n_experts % size:
        raise ValueError(
            f"the 'experts' partition needs a rank count that divides the {n_experts} "
            f"routed experts; got {size} ranks (or use --moe-partition slots)"
        )
    share = n_experts // size
    return rank * share, (rank + 1) * share


def expert_range(cluster: Cluster | None, n_experts: int) -> tuple[int, int] | None:
    """The experts this rank loads: its contiguous share in "experts" mode; None (all) otherwise."""
    if cluster is None or cluster.partition == "slots":
        return None
    return held_experts(cluster.rank, cluster.size, cluster.partition, n_experts)


# --------------------------------------------------------------------------------- exchanges


class Exchange:
    """The MoE hook (model/moe.py): `exchange(experts, x, indices, weights)` -> every rank's per-slot
    outputs [T, k, D] fp32. Values travel as `wire` (None: the activation dtype x.dtype, exact for
    outputs that follow the experts contract; float32 for experts modules that do not round)."""

    def __init__(self, cluster: Cluster, wire: mx.Dtype | None = None):
        self.cluster, self.wire = cluster, wire

    def _send(self, slots: mx.array, x: mx.array) -> mx.array:
        out = slots.astype(self.wire or x.dtype)
        self.cluster.note_exchange(out.nbytes)
        return out


class ExpertsExchange(Exchange):
    """ "experts" mode: this rank's slots, -0.0 elsewhere, summed over the ranks."""

    def __call__(self, experts, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        lo, hi = experts.expert_range
        slots = experts(x, indices, weights)  # [T, k, D] fp32, exactly 0 outside [lo, hi)
        owned = (indices >= lo) & (indices < hi)
        # -0.0, not +0.0, for the slots other ranks own: it leaves every owner's value unchanged.
        mine = self._send(mx.where(owned[..., None], slots, -0.0), x)
        return mx.distributed.all_sum(mine, group=self.cluster.group).astype(mx.float32)


class SlotsExchange(Exchange):
    """ "slots" mode: rank r computes slots r, r+n, ...; all_gather puts every slot back in place."""

    def __init__(self, cluster: Cluster, wire: mx.Dtype | None = None):
        super().__init__(cluster, wire)
        self._columns: dict[int, mx.array] = {}

    def columns(self, k: int) -> mx.array:
        """Slots r, r+n, ... padded to ceil(k/n) with slot k-1 (computed, then dropped)."""
        if k not in self._columns:
            n, r = self.cluster.size, self.cluster.rank
            self._columns[k] = mx.array([min(r + j * n, k - 1) for j in range(-(-k // n))], mx.int32)
        return self._columns[k]

    def __call__(self, experts, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        T, k = indices.shape
        n = self.cluster.size
        cols = self.columns(k)
        mine = self._send(experts(x, mx.take(indices, cols, axis=1), mx.take(weights, cols, axis=1)), x)
        every = mx.distributed.all_gather(mine, group=self.cluster.group)  # [n·T, m, D], rank-major
        m, D = mine.shape[1:]
        # Rank r's j-th slot is slot j·n + r: [n, T, m, D] -> [T, m, n, D] -> [T, m·n, D].
        every = every.reshape(n, T, m, D).transpose(1, 2, 0, 3).reshape(T, m * n, D)
        return every[:, :k].astype(mx.float32)


def rounds_to(experts, held: tuple[int, int], dim: int, k: int, dtype: mx.Dtype) -> mx.array:
    """Whether the module's per-slot outputs are `dtype`-valued, as the experts contract says
    (docs/design.md), as a lazy bool: one probe of two tokens routed to held experts. A module that
    does not round returns values with bits below `dtype`'s precision (all of them in range, by
    chance, has probability ~0), and exchanging `dtype` would change them."""
    lo, hi = held
    idx = mx.array([[lo + (t * k + s) % (hi - lo) for s in range(k)] for t in range(2)], mx.int32)
    x = mx.random.normal((2, dim), key=mx.random.key(1)).astype(dtype)
    w = mx.random.uniform(0.1, 1.0, (2, k), key=mx.random.key(2))
    y = experts(x, idx, w)
    return mx.all((y.astype(dtype).astype(mx.float32) == y) | mx.isnan(y))


# --------------------------------------------------------------------------------- apply


def _digest(value) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()[:16]


def model_digests(model) -> dict[str, bytes]:
    """What every rank must hold alike, 16 bytes each. The routed experts' tensors differ between
    ranks in "experts" mode (and per-expert bit widths group EXL3 trellises differently), so they
    enter as their module type per layer; their ranges are checked by `apply` on each rank."""
    params = tree_flatten(model.parameters())
    replicated = [(k, list(v.shape), str(v.dtype)) for k, v in params if ".ffn.experts." not in k]
    experts = [(name, type(m.experts).__name__) for name, m in model.named_modules() if isinstance(m, MoE)]
    return {
        "the software (mlx, mlx_dsv41 versions)": _digest([mx.__version__, __version__]),
        "the model config": _digest(dataclasses.asdict(model.args)),
        "the loaded tensors (names, shapes, dtypes)": _digest(sorted(replicated)),
        "the routed-expert formats": _digest(sorted(experts)),
    }


_HINTS = {
    "the software (mlx, mlx_dsv41 versions)": "install the same versions on every machine",
    "the model config": "load the same checkpoint on every rank",
    "the loaded tensors (names, shapes, dtypes)": "load the same checkpoint on every rank",
    "the routed-expert formats": "load the same checkpoint on every rank",
}


def _first_wrong_layout(moes, wants) -> list[int]:
    """[i, lo, hi]: the first MoE layer (index i) holding other experts than wants[i], and the
    range it holds; [-1, 0, 0] when every layer holds its share."""
    for i, (_, moe) in enumerate(moes):
        held = tuple(getattr(moe.experts, "expert_range", None) or (-1, -1))
        if held != wants[i]:
            return [i, *held]
    return [-1, 0, 0]


def _check_rows(model, moes, rows: np.ndarray, digest_names: list[str], size: int, partition: str) -> None:
    """Every rank's gathered row (its layout, rounding flag and digests) agrees, or every rank
    raises the same DistributedError for the first disagreement."""
    parts = {what: rows[:, 4 + 4 * i : 8 + 4 * i] for i, what in enumerate(digest_names)}

    def check(what: str) -> None:
        if (parts[what] != parts[what][0]).any():
            told = ", ".join(f"rank {r} {parts[what][r].astype(np.int32).tobytes()[:4].hex()}" for r in range(size))
            raise DistributedError(f"ranks disagree on {what} ({told}): {_HINTS[what]}")

    check("the software (mlx, mlx_dsv41 versions)")
    check("the model config")
    for r in range(size):
        i, lo, hi = (int(v) for v in rows[r, :3])
        if i >= 0:
            n_experts = moes[i][1].gate.weight.shape[0] if i < len(moes) else model.args.n_routed_experts
            w = held_experts(r, size, partition, n_experts)
            name = moes[i][0] if i < len(moes) else f"MoE layer {i}"
            raise DistributedError(
                f"rank {r} of {size} ({partition!r} partition) must hold experts {w[0]}..{w[1] - 1} "
                f"but its {name}.experts holds {lo}..{hi - 1}: load with "
                f"expert_range=distributed.expert_range(cluster, {model.args.n_routed_experts})"
            )
    check("the loaded tensors (names, shapes, dtypes)")
    check("the routed-expert formats")


def apply(model, cluster: Cluster | None) -> None:
    """Install the exchange of `cluster.partition` in every MoE layer, after checking (one
    collective) that every rank holds its share of the experts and that all ranks agree on the
    model; any problem is the same DistributedError on every rank. A no-op for cluster None."""
    if cluster is None:
        return
    moes = sorted(
        ((name, m) for name, m in model.named_modules() if isinstance(m, MoE)),
        key=lambda item: [int(t) if t.isdigit() else t for t in item[0].split(".")],
    )
    if not moes:
        raise ValueError("apply: the model has no MoE layers")
    size, partition = cluster.size, cluster.partition
    # Each MoE's share of its own experts (the DSpark stages have fewer than the backbone).
    wants = [held_experts(cluster.rank, size, partition, moe.gate.weight.shape[0]) for _, moe in moes]
    layout = _first_wrong_layout(moes, wants)
    act = model.embed(mx.array([[0]])).dtype  # the activation dtype the MoE hands its experts
    rounded = (
        layout[0] >= 0
        or mx.all(
            mx.stack(
                [
                    rounds_to(moe.experts, want, model.args.hidden_size, moe.gate.top_k, act)
                    for want, (_, moe) in zip(wants, moes)
                ]
            )
        ).item()
    )
    digests = model_digests(model)
    row = [*layout, int(rounded), *(int(v) for d in digests.values() for v in np.frombuffer(d, np.int32))]
    rows = _gather_rows(cluster.group, row)
    _check_rows(model, moes, rows, list(digests), size, partition)

    wire = None
    if not rows[:, 3].all():  # some rank's experts do not round to the activation dtype
        wire = mx.float32
        if cluster.rank == 0:
            kind, dtype = type(moes[0][1].experts).__name__, str(act).rsplit(".", 1)[-1]
            print(
                f"mlx_dsv41.distributed: the routed experts ({kind}) return per-slot outputs that "
                f"are not {dtype}-valued (experts contract, docs/design.md): exchanging float32 "
                "(twice the bytes) to stay bit-identical",
                file=sys.stderr,
            )
    exchange = (ExpertsExchange if partition == "experts" else SlotsExchange)(cluster, wire)
    for _, moe in moes:
        moe.exchange = exchange
