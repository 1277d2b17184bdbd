"""DSpark greedy decoding against plain greedy decoding: how often the tokens differ (issue 18).

Every emitted token is the main model's argmax given the accepted prefix, so the two agree token
for token when a verify forward of 1 + k rows computes the same logits as k + 1 one-row steps.
That holds on the CPU (tests/test_speculative.py); on a GPU a multi-row forward may round
differently and flip a near-tie. This measures it, on any backend:

    python benchmarks/dspark_agreement.py --model DIR [--prompts 8] [--tokens 128] [--draft 5]
    python benchmarks/dspark_agreement.py --demo --prompts 2 --tokens 16

Prompts are consecutive lines of examples/sample.txt (plain text, not chat-encoded). For each:
plain greedy (mlx-lm's loop, one token per forward) and DSpark greedy from the same prompt; it
prints where they first differ, then the totals and the DSpark statistics line (tokens per main
forward, acceptance by position: meaningful on a real checkpoint only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sample.txt"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="a converted checkpoint directory")
    where.add_argument("--demo", action="store_true", help="the demo checkpoint (random weights)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft", default=None, help="drafts per main forward, or 'auto'")
    a = parser.parse_args()

    import mlx_dsv41
    from mlx_dsv41.demo import ensure_demo
    from mlx_dsv41.speculative import DraftStats, stream_generate

    model, tokenizer = mlx_dsv41.load(ensure_demo() if a.demo else a.model)
    if not model.mtp:
        raise SystemExit(f"error: this checkpoint cannot draft: {model.dspark_unavailable}")
    draft = a.draft if a.draft in (None, "auto") else int(a.draft)
    lines = [line for line in SAMPLE.read_text().splitlines() if line.strip()]
    stats, same, agreed, total = DraftStats(), 0, 0, 0
    for i in range(a.prompts):
        ids = tokenizer.encode(lines[i % len(lines)])
        plain = [r.token for r in stream_generate(model, tokenizer, ids, a.tokens, draft=0)]
        drafted = [r.token for r in stream_generate(model, tokenizer, ids, a.tokens, draft=draft, stats=stats)]
        at = first_difference(plain, drafted)
        same += at is None
        agreed += len(plain) if at is None else at
        total += len(plain)
        told = "identical" if at is None else f"first difference at token {at}"
        print(f"prompt {i}: {len(ids)} tokens, {len(plain)} generated: {told}", flush=True)
    print(f"identical: {same} of {a.prompts} prompts; tokens before the first difference: {agreed} of {total}")
    print(stats.line())


if __name__ == "__main__":
    main()
