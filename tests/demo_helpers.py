"""The demo checkpoint for the CLI / drop-in / server / example tests: built once per test session
in the session's temp directory (never in ~/.cache), and the environment for subprocesses that
makes `--demo` find it there; our own greedy loop, what mlx-lm's generation must reproduce; one
demo server per session (`python -m mlx_dsv41.server --demo` on a free port)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from mlx_dsv41.demo import CACHE_ENV, DEMO_VERSION, ensure_demo

REPO = Path(__file__).resolve().parents[1]


def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "mlx_dsv41_cache"


def demo_checkpoint(tmp_path_factory) -> Path:
    """The converted demo directory (built on the first call of the session)."""
    return ensure_demo(cache_dir(tmp_path_factory) / f"demo-v{DEMO_VERSION}", progress=False)


def demo_env(tmp_path_factory) -> dict[str, str]:
    """os.environ for a subprocess whose `--demo` uses this session's demo checkpoint."""
    demo_checkpoint(tmp_path_factory)
    return {**os.environ, CACHE_ENV: str(cache_dir(tmp_path_factory)), "PYTHONUNBUFFERED": "1"}


def greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    """Our own loop: one prefill, then one token at a time, argmax, stop at EOS (not emitted)."""
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]))
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache)
    return out


def detokenize(tokenizer, tokens: list[int]) -> str:
    """`tokens` as mlx-lm's streaming detokenizer writes them."""
    d = tokenizer.detokenizer
    for t in tokens:
        d.add_token(t)
    d.finalize()
    return d.text
