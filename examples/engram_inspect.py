"""Engram inspection: which n-grams hit which table rows, and the gate of every residual stream.

    python examples/engram_inspect.py                      # the demo checkpoint
    python examples/engram_inspect.py --model DIR --prompt "the the the" --png gates.png

For each Engram layer and each position t, the 2-, 3- and 4-grams ending at t are hashed into one
row per (n, head) (docs/model.md#engram-hashing); a repeated n-gram hits the same rows again. The
gate sigmoid(signed sqrt(<h_s, k_s>)) decides per stream s how much of the gathered value is added
(docs/model.md#engram-gate); it is read from the model's own Engram modules during one forward pass.
--png draws the gates as a heatmap per Engram layer: streams x the prompt's tokens.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
from common import load, pad, parse, parser, pyplot, record_calls, save_png, width

PROMPT = "The cat sat. The cat sat on the mat."


def engram_gates(model, ids: list[int]) -> dict[int, np.ndarray]:
    """Engram layer -> its gates [positions, streams] in one forward pass over `ids`."""
    gates: dict[int, np.ndarray] = {}
    for layer in model.args.engram_layer_ids:
        record_calls(
            model.layers[layer],
            "engram",
            lambda inner, args_, out, layer=layer: gates.__setitem__(
                layer, np.array(inner.gate_and_value(*args_)[0][0])
            ),
        )
    mx.eval(model(mx.array([ids]), model.make_cache()))
    return gates


def tick_label(piece: str) -> str:
    """A token as an axis label: escaped, fullwidth bars plain (fonts lack them), at most 12 characters."""
    text = repr(piece)[1:-1].replace("｜", "|").replace("▁", "_")
    return text if len(text) <= 12 else text[:11] + "…"


def gates_figure(gates: dict[int, np.ndarray], pieces: list[str]):
    """One heatmap per Engram layer: a row per residual stream, a column per token, 0..1."""
    plt = pyplot()
    fig, axes = plt.subplots(
        len(gates),
        1,
        squeeze=False,
        layout="constrained",
        figsize=(max(6.0, 0.3 * len(pieces) + 2), 0.5 + 2.6 * len(gates)),
    )
    for ax, (layer, g) in zip(axes[:, 0], gates.items()):
        image = ax.imshow(g.T, aspect="auto", interpolation="nearest", cmap="magma", vmin=0, vmax=1)
        ax.set(ylabel="stream", title=f"Engram layer {layer}: gate per stream and token")
        ax.set_yticks(range(g.shape[1]))
        ax.set_xticks(range(len(pieces)), [tick_label(p) for p in pieces], rotation=90, fontsize=7)
        fig.colorbar(image, ax=ax)
    return fig


def print_layer(a, li: int, layer: int, pieces: list[str], rows: np.ndarray, gates: np.ndarray) -> None:
    heads, sizes = a.engram_n_heads, a.engram_ngram_sizes
    print(
        f"\n== Engram layer {layer}: {a.engram_num_embeddings[li]} rows, {a.engram_columns} rows "
        f"per position ({len(sizes)} n-gram sizes x {heads} heads)"
    )
    cells = [
        [",".join(str(int(r)) for r in rows[t, li, k * heads : (k + 1) * heads]) for k in range(len(sizes))]
        for t in range(len(pieces))
    ]
    names = [repr(p) for p in pieces]
    token_w = max(5, *map(width, names))
    cell_w = [max(len(f"{n}-gram rows"), *(len(c[k]) for c in cells)) for k, n in enumerate(sizes)]
    print(
        f"{'pos':>4}  {pad('token', token_w)}  "
        + "  ".join(f"{n}-gram rows".ljust(w) for n, w in zip(sizes, cell_w))
        + "  gate per stream"
    )
    for t, name in enumerate(names):
        print(
            f"{t:4d}  {pad(name, token_w)}  "
            + "  ".join(c.ljust(w) for c, w in zip(cells[t], cell_w))
            + "  "
            + " ".join(f"{g:.3f}" for g in gates[t])
        )
    print("n-grams per position (tokens t-n+1 .. t; '∅' = before the start):")
    for t in range(len(pieces)):
        grams = ["|".join(pieces[s] if s >= 0 else "∅" for s in range(t - n + 1, t + 1)) for n in sizes]
        print(f"{t:4d}  " + "   ".join(repr(g) for g in grams))
    hits = Counter(int(r) for r in rows[:, li].reshape(-1))
    again = sum(c - 1 for c in hits.values() if c > 1)
    print(f"rows read: {sum(hits.values())}, distinct: {len(hits)}, hit again: {again}")
    print("gate mean per stream: " + " ".join(f"s{s}={gates[:, s].mean():.3f}" for s in range(gates.shape[1])))


def main():
    p = parser(__doc__.splitlines()[0], picture="the gates (streams x tokens) of each Engram layer")
    p.add_argument("--prompt", default=PROMPT)
    args = parse(p)

    model, tokenizer = load(args.model)
    if not model.args.engram_layer_ids:
        raise SystemExit("error: this model has no Engram layers")
    ids = tokenizer.encode(args.prompt)
    pieces = [tokenizer.decode([t]) for t in ids]
    rows = model.engram_row_ids(np.array([ids]))[0]  # [S, layers, columns], columns in (n, head) order
    gates = engram_gates(model, ids)
    for li, layer in enumerate(model.args.engram_layer_ids):
        print_layer(model.args, li, layer, pieces, rows, gates[layer])
    if args.png:
        save_png(gates_figure(gates, pieces), args.png)


if __name__ == "__main__":
    main()
