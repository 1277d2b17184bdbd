"""Engram inspection: which n-grams hit which table rows, and the gate of every residual stream.

    python examples/engram_inspect.py                      # the demo checkpoint
    python examples/engram_inspect.py --model DIR --prompt "the the the"

For each Engram layer and each position t, the 2-, 3- and 4-grams ending at t are hashed into one
row per (n, head) (spec §4.4b-d); a repeated n-gram hits the same rows again. The gate
sigmoid(signed sqrt(<h_s, k_s>)) decides per stream s how much of the gathered value is added
(spec §4.4f); it is read from the model's own Engram modules during one forward pass.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np

from common import load, parser, record_calls

PROMPT = "The cat sat. The cat sat on the mat."


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompt", default=PROMPT)
    args = p.parse_args()

    model, tokenizer = load(args.model)
    a = model.args
    layers = list(a.engram_layer_ids)
    if not layers:
        raise SystemExit("this model has no Engram layers")
    ids = tokenizer.encode(args.prompt)
    pieces = [tokenizer.decode([t]) for t in ids]
    rows = model.engram_row_ids(np.array([ids]))[0]  # [S, layers, columns], columns in (n, head) order

    gates: dict[int, np.ndarray] = {}
    for layer in layers:
        record_calls(model.layers[layer], "engram", lambda inner, args_, out, layer=layer: gates.__setitem__(
            layer, np.array(inner.gate_and_value(*args_)[0][0])))
    mx.eval(model(mx.array([ids]), model.make_cache()))

    heads = a.engram_n_heads
    for li, layer in enumerate(layers):
        print(f"\n== Engram layer {layer}: {a.engram_num_embeddings[li]} rows, {a.engram_columns} rows "
              f"per position ({len(a.engram_ngram_sizes)} n-gram sizes x {heads} heads)")
        print(f"{'pos':>4}  {'token':14} " + "  ".join(f"{n}-gram rows".ljust(22) for n in a.engram_ngram_sizes)
              + "  gate per stream")
        hits = Counter()
        for t, piece in enumerate(pieces):
            cells = []
            for k, n in enumerate(a.engram_ngram_sizes):
                ids_n = rows[t, li, k * heads : (k + 1) * heads]
                hits.update(int(r) for r in ids_n)
                cells.append(",".join(str(int(r)) for r in ids_n).ljust(22))
            gate = " ".join(f"{g:.3f}" for g in gates[layer][t])
            print(f"{t:4d}  {piece!r:14} " + "  ".join(cells) + f"  {gate}")
        print("n-grams per position (tokens t-n+1 .. t; '∅' = before the start):")
        for t in range(len(pieces)):
            grams = ["|".join(pieces[s] if s >= 0 else "∅" for s in range(t - n + 1, t + 1))
                     for n in a.engram_ngram_sizes]
            print(f"{t:4d}  " + "   ".join(repr(g) for g in grams))
        again = sum(c - 1 for c in hits.values() if c > 1)
        print(f"rows read: {sum(hits.values())}, distinct: {len(hits)}, hit again: {again}")
        g = gates[layer]
        print("gate mean per stream: " + " ".join(f"s{s}={g[:, s].mean():.3f}" for s in range(g.shape[1])))


if __name__ == "__main__":
    main()
