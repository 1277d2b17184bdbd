"""The demo checkpoint for the CLI / drop-in / server / example tests: built once per test session
in the session's temp directory (never in ~/.cache), and the environment for subprocesses that
makes `--demo` find it there; our own greedy loop, what mlx-lm's generation must reproduce; one
demo server per session (`python -m mlx_dsv41.server --demo` on a free port)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

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


# Module-scoped fixtures shared by the test files that run the demo checkpoint (import them).
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return demo_env(tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    import mlx_dsv41

    return mlx_dsv41.load(demo_checkpoint(tmp_path_factory))


@pytest.fixture(scope="session", name="server")
def demo_server(tmp_path_factory):
    """(host, port, log file) of the session's demo server (default max_tokens 4)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_dsv41.server", "--demo", "--port", "0", "--max-tokens", "4"],
            cwd=REPO, env=demo_env(tmp_path_factory), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            m = re.search(r"Serving on http://([\d.]+):(\d+)", log.read_text())
            if m:
                break
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"server did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.2)
        yield m.group(1), int(m.group(2)), log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
