"""Two roundings DeepSeek's reference makes and the model does not (issue 15, item 3): attention
probabilities rounded to bf16 before P·V, and indexer scores formed in bf16. Measured on the
float64 attention reference of the tests (tests/attention_stack.py: ReferenceStack with
`bf16_probs` / `bf16_index_scores`) over a stack of every attention role, against the
same stack with fp32 (here float64) probabilities and scores, as the model computes them.

For each seed: random weights and input, one prefill, teacher-forced (every layer of a variant
gets the exact run's input to that layer). Reported: the share of (layer, query) top-k
selections that differ; for those, whether the exact scores tie at the k-th place, or else the
score margin (the gap between the k-th and the (k+1)-th entry relative to the row's largest
magnitude); and the relative L2 difference of the layers' outputs.

    .venv/bin/python benchmarks/reference_roundings.py [--seeds 6] [--length 48]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_stack import ReferenceStack, build_stack, f64, random_input, rb, tiny_args  # noqa: E402

CONFIGS = {
    "tiny (2 index heads x 32, top-4)": {},
    "wider (8 index heads x 64, top-16)": dict(
        index_n_heads=8, index_head_dim=64, index_topk=16, candidate_topk_blocks=12
    ),
}


def teacher_forced(args, layers, x, probs: bool, scores: bool):
    """Each layer's output and the published state, every layer fed the exact run's input."""
    exact, variant = ReferenceStack(args, layers), ReferenceStack(args, layers)
    variant.bf16_probs, variant.bf16_index_scores = probs, scores
    h, shared, shared_v, diffs = x, {}, {}, []
    for i in range(args.num_hidden_layers):
        y, y_v = exact.layer(i, h, shared), variant.layer(i, h, shared_v)
        diffs.append(np.linalg.norm(y_v - y) / np.linalg.norm(y))
        h = rb(h + y)
    return shared, shared_v, diffs


def selection_changes(shared, shared_v, k):
    """(rows whose top-k set differs, of rows; of those: exact ties at the k-th place, margins)."""
    changed = total = ties = 0
    gaps = []
    for key, picks in shared.items():
        if not key.startswith("topk."):
            continue
        scores = shared[f"scores.{key.split('.')[1]}"]
        for t, (a, b) in enumerate(zip(picks, shared_v[key])):
            total += 1
            if set(a) == set(b):
                continue
            changed += 1
            row = np.sort(scores[t][np.isfinite(scores[t])])[::-1]
            if row[k - 1] == row[k]:
                ties += 1
            else:
                gaps.append((row[k - 1] - row[k]) / np.abs(row).max())
    return changed, total, ties, gaps


def measure(name: str, overrides: dict, seeds: int, length: int) -> str:
    args = tiny_args(**overrides)
    changed = total = ties = 0
    gaps, diff_scores, diff_probs = [], [], []
    for seed in range(seeds):
        layers = build_stack(args, seed=seed)
        x = f64(random_input(args, 1, length, seed=100 + seed))[0]
        shared, shared_s, d_s = teacher_forced(args, layers, x, False, True)
        _, _, d_p = teacher_forced(args, layers, x, True, False)
        c, n, t, g = selection_changes(shared, shared_s, args.index_topk)
        changed, total, ties, gaps = changed + c, total + n, ties + t, gaps + g
        diff_scores += d_s
        diff_probs += d_p
    g = f"{min(gaps):.1e} .. {max(gaps):.1e}" if gaps else "—"
    return (
        f"| {name} | {changed} / {total} ({changed / total:.1%}) | {ties} | {g} | "
        f"{np.median(diff_scores):.1e} (max {max(diff_scores):.1e}) | "
        f"{np.median(diff_probs):.1e} (max {max(diff_probs):.1e}) |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--length", type=int, default=48)
    a = ap.parse_args()
    if a.seeds < 1 or a.length < 2:
        ap.error("--seeds must be >= 1 and --length >= 2")
    print(f"{a.seeds} seeds, {a.length}-token prefill, 7 attention layers (every role), teacher-forced\n")
    print(
        "| indexer shape | top-k selections that differ (bf16 scores) | of them, exact ties at k | "
        "margins of the others | layer output, bf16 scores vs fp32: median (max) | "
        "layer output, bf16 probabilities vs fp32: median (max) |"
    )
    print("|---|---|---|---|---|---|")
    for name, overrides in CONFIGS.items():
        print(measure(name, overrides, a.seeds, a.length))
    return 0


if __name__ == "__main__":
    sys.exit(main())
