"""Expert-routing histogram per layer: how many (token, slot) picks each routed expert gets.

    python examples/expert_routing.py                      # the demo checkpoint, sample.txt
    python examples/expert_routing.py --model DIR --file text.txt --png routing.png

The router's picks (top-k of sqrtsoftplus(x W^T) + bias, docs/model.md#moe) are read from the
model's own gates during one teacher-forced pass. Per layer: a bar per expert, and the balance (max
/ mean load; normalised entropy, 1 = perfectly even). --png draws the counts as a layer x expert
heatmap.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from common import load, parse, parser, pyplot, record_calls, save_png


def routing_figure(counts: np.ndarray, title: str):
    """counts [layers, experts] as a heatmap, one row per layer."""
    plt = pyplot()
    fig, ax = plt.subplots(
        layout="constrained", figsize=(min(12.0, 5 + 0.02 * counts.shape[1]), 1.5 + 0.3 * counts.shape[0])
    )
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set(xlabel="routed expert", ylabel="layer", title=title)
    fig.colorbar(image, ax=ax, label="(token, slot) picks")
    return fig


def main():
    p = parser(__doc__.splitlines()[0], picture="the layer x expert counts")
    p.add_argument("--file", default=str(Path(__file__).with_name("sample.txt")), help="text to route")
    p.add_argument("--max-tokens", type=int, default=2048, help="route at most this many tokens")
    p.add_argument("--json", help="also write the counts to this JSON file")
    p.add_argument("--width", type=int, default=40, help="bar width")
    p.add_argument(
        "--show", type=int, default=32, help="bars for at most this many experts per layer (the most used ones)"
    )
    args = parse(p)

    model, tokenizer = load(args.model)
    a = model.args
    ids = tokenizer.encode(Path(args.file).read_text(encoding="utf-8"))[: args.max_tokens]
    counts = np.zeros((a.num_hidden_layers, a.n_routed_experts), np.int64)
    for i, block in enumerate(model.layers):
        record_calls(
            block.ffn, "gate", lambda inner, args_, out, i=i: np.add.at(counts[i], np.array(out[0]).reshape(-1), 1)
        )
    mx.eval(model(mx.array([ids]), model.make_cache()))

    print(f"{len(ids)} tokens, top-{a.num_experts_per_tok} of {a.n_routed_experts} experts per token")
    for i, row in enumerate(counts):
        mean = row.sum() / len(row)
        p_ = row / row.sum()
        entropy = -sum(x * math.log(x) for x in p_ if x > 0) / math.log(len(row))
        print(f"\nlayer {i}: max/mean {row.max() / mean:.2f}, entropy {entropy:.3f}")
        top = max(row.max(), 1)
        shown = np.argsort(-row, kind="stable")[: args.show] if len(row) > args.show else range(len(row))
        for e in sorted(shown):
            print(f"  expert {e:3d} {row[e]:6d} " + "#" * round(args.width * row[e] / top))
        if len(row) > args.show:
            print(
                f"  ({len(row) - args.show} less used experts not shown; {int((row == 0).sum())} experts got no pick)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": len(ids), "counts": counts.tolist()}))
    if args.png:
        save_png(routing_figure(counts, f"expert picks over {len(ids)} tokens"), args.png)


if __name__ == "__main__":
    main()
