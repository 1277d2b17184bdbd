"""Random but valid EXL3 tensors (numpy arrays as stored), for tests and the synthetic checkpoints
of the demo.

Every int16 pattern is a valid trellis (docs/exl3.md#bit-ring), so trellises are uniform random.
suh/svh get the magnitudes exllamav3 produces for weights ~N(0, 0.02²) (docs/exl3.md#scales): |suh|
≈ 0.02 with per-channel spread, |svh| ≈ 1, random signs, and 0 on padded channels (their RMS is 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mlx_dsv41.exl3.codebook import MARKER_VALUES
from mlx_dsv41.exl3.hadamard import BLOCK


def _padded(d: int) -> int:
    return -(-d // BLOCK) * BLOCK


def _signed(rng, size: int, true_size: int, scale: float, spread: float) -> np.ndarray:
    v = scale * rng.lognormal(0.0, spread, size) * rng.choice([-1.0, 1.0], size)
    v[true_size:] = 0.0
    return v.astype(np.float16)


def random_linear_tensors(
    in_features: int,
    out_features: int,
    bits: float,
    codebook: str = "mul1",
    *,
    seed: int = 0,
    bias: bool = False,
    prefix: str | None = None,
) -> dict:
    """Stored tensors of one EXL3 linear (in -> out, padded to 128) at K = ``bits`` (1..8 or
    1.5/2.5/3.5). Keys are ``prefix.trellis`` etc., or bare names without a prefix."""
    k, n = _padded(in_features), _padded(out_features)
    k2 = int(round(2 * bits))
    rng = np.random.default_rng(seed)
    out = {
        "trellis": rng.integers(-(1 << 15), 1 << 15, size=(k // 16, n // 16, 8 * k2), dtype=np.int16),
        "suh": _signed(rng, k, in_features, 0.02, 0.3),
        "svh": _signed(rng, n, out_features, 1.0, 0.25),
    }
    if codebook in MARKER_VALUES:
        out[codebook] = np.array(MARKER_VALUES[codebook], np.uint32).view(np.int32).reshape(())
    elif codebook != "3inst":
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    if bias:
        b = rng.normal(0.0, 0.1, n)
        b[out_features:] = 0.0
        out["bias"] = b.astype(np.float16)
    return out if prefix is None else {f"{prefix}.{name}": v for name, v in out.items()}


def random_experts_tensors(
    n_experts: int, hidden: int, intermediate: int, bits=3, codebook="mul1", *, seed: int = 0, prefix: str = "experts"
) -> dict:
    """Stored tensors ``{prefix}.{e}.{w1,w3,w2}.*`` of a routed-experts layer.

    ``bits`` and ``codebook`` are one value, or a mapping projection -> value or sequence of values
    cycled over the experts (e.g. ``bits={"w2": (2, 3)}``: mixed K within w2).
    """

    def pick(spec, proj, e):
        v = spec.get(proj, 3 if spec is bits else "mul1") if isinstance(spec, Mapping) else spec
        return v[e % len(v)] if isinstance(v, (tuple, list)) else v

    shapes = {"w1": (hidden, intermediate), "w3": (hidden, intermediate), "w2": (intermediate, hidden)}
    out = {}
    for e in range(n_experts):
        for i, (proj, (d_in, d_out)) in enumerate(shapes.items()):
            out.update(
                random_linear_tensors(
                    d_in,
                    d_out,
                    pick(bits, proj, e),
                    pick(codebook, proj, e),
                    seed=seed * 100_003 + e * 3 + i,
                    prefix=f"{prefix}.{e}.{proj}",
                )
            )
    return out
