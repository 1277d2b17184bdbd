"""Teacher-forced log-likelihood and perplexity of a text file.

    python examples/perplexity.py                          # the demo checkpoint, sample.txt
    python examples/perplexity.py --model DIR --file book.txt --chunk 1024 --png loss.png

The text is tokenized (with BOS) and fed through the model in chunks of --chunk tokens with one
cache, so memory stays bounded and every token sees its whole prefix (the cache is exact across
chunk boundaries). Token t+1 is scored by the fp32 log-softmax of the logits at t. --png plots the
loss (-log p, nats) of every token along the text, with its mean.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from common import load, parse, parser, pyplot, save_png


def token_log_likelihoods(model, ids: list[int], chunk: int) -> mx.array:
    """log p(ids[t+1] | ids[:t+1]) for t = 0 .. len-2, fp32."""
    cache = model.make_cache()
    out = []
    for start in range(0, len(ids) - 1, chunk):
        inputs = mx.array([ids[start : start + chunk]])
        targets = mx.array(ids[start + 1 : start + chunk + 1])
        logits = model(inputs, cache)[0, : targets.shape[0]].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append(mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0])
        mx.eval(out[-1])
    return mx.concatenate(out)


def loss_figure(nll, title: str):
    """Per-token loss along the text, and its mean."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
    positions = range(1, len(nll) + 1)
    ax.plot(positions, nll, linewidth=0.8, label="-log p(token | prefix)")
    ax.axhline(float(nll.mean()), color="tab:red", linewidth=1, label=f"mean {float(nll.mean()):.3f}")
    ax.set(xlabel="token position", ylabel="nats", title=title)
    ax.legend(loc="upper right")
    return fig


def main():
    p = parser(__doc__.splitlines()[0], picture="every token's loss along the text")
    p.add_argument("--file", default=str(Path(__file__).with_name("sample.txt")), help="text file to score")
    p.add_argument("--chunk", type=int, default=512, help="tokens per forward (default 512)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    args = parse(p)
    if args.chunk < 1:
        p.error("--chunk must be >= 1")

    model, tokenizer = load(args.model)
    text = Path(args.file).read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if len(ids) < 2:
        p.error(f"{args.file}: needs at least 2 tokens, got {len(ids)}")

    start = time.perf_counter()
    ll = token_log_likelihoods(model, ids, args.chunk)
    seconds = time.perf_counter() - start
    total = -float(mx.sum(ll))
    n = ll.shape[0]
    scored_bytes = len(tokenizer.decode(ids[1:]).encode("utf-8"))
    print(f"file:              {args.file}")
    print(f"tokens scored:     {n} (chunks of {args.chunk}, {n / seconds:.1f} tokens/s)")
    print(f"log-likelihood:    {-total:.4f} nats")
    print(f"mean NLL:          {total / n:.4f} nats/token")
    print(f"perplexity:        {math.exp(total / n):.3f}")
    print(f"bits per byte:     {total / math.log(2) / max(scored_bytes, 1):.4f}")
    print(f"vocabulary size:   {model.args.vocab_size} (a uniform guess has perplexity {model.args.vocab_size})")
    if args.png:
        save_png(loss_figure(-np.array(ll), f"per-token loss, {Path(args.file).name}"), args.png)


if __name__ == "__main__":
    main()
