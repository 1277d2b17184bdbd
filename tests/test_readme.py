"""Every ```python block of README.md runs, in a fresh process, against the demo checkpoint (a block
that loads a real checkpoint gets the demo's path; the openai-client block the session's demo
server), and what it prints is our own greedy text. A new block needs its entry in RUNS."""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from demo_helpers import REPO, demo_checkpoint, detokenize, greedy

from mlx_dsv41 import chat

BLOCKS = re.findall(r"^```python\n(.*?)^```$", (REPO / "README.md").read_text(), re.S | re.M)
HI = [{"role": "user", "content": "Hi"}]


def run(env, code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()  # no newline translation: generated text may hold a bare \r


def shown(tokenizer, tokens: list[int]) -> str:
    """The text of `tokens` without the `</think>` that ends reasoning (the server strips it)."""
    end = chat.control_token_ids(tokenizer)[chat.END_THINK]
    if end not in tokens:
        return detokenize(tokenizer, tokens)
    cut = tokens.index(end)
    return detokenize(tokenizer, tokens[:cut]) + detokenize(tokenizer, tokens[cut + 1 :])


def mlx_lm_model(ctx, code):
    model, tokenizer = ctx.loaded
    prompt = chat.encode(tokenizer, [{"role": "user", "content": "Hello"}], thinking=True, effort="max")
    assert run(ctx.env, code) == detokenize(tokenizer, greedy(model, tokenizer, prompt, 8)) + "\n"


def two_machines(ctx, code):
    """Outside mlx.launch: no cluster, and the model continues a prompt as ours does."""
    model, tokenizer = ctx.loaded
    ids = tokenizer.encode("The cat sat on the mat.")
    check = f"\nfrom mlx_lm import generate\nprint(cluster, generate(model, tokenizer, {ids}, max_tokens=4))"
    out = run(ctx.env, f"path = {str(ctx.path)!r}\n" + code + check)
    assert out == f"None {detokenize(tokenizer, greedy(model, tokenizer, ids, 4))}\n"


def openai_client(ctx, code):
    """Against the session's demo server (tests/demo_helpers.py)."""
    model, tokenizer = ctx.loaded
    host, port, _ = ctx.request.getfixturevalue("server")
    out = run(ctx.env, code.replace("http://127.0.0.1:8080", f"http://{host}:{port}"))
    prompt = chat.encode(tokenizer, HI, thinking=True, effort="medium")
    assert out == shown(tokenizer, greedy(model, tokenizer, prompt, 8)) + "\n"


RUNS = [mlx_lm_model, openai_client, two_machines]  # in the README's order


def test_every_block_has_a_run():
    assert len(BLOCKS) == len(RUNS), "a README python block was added or removed: give it a run here"


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f.__name__ for f in RUNS])
def test_readme_block(env, loaded, tmp_path_factory, request, i):
    ctx = SimpleNamespace(env=env, loaded=loaded, path=demo_checkpoint(tmp_path_factory), request=request)
    RUNS[i](ctx, BLOCKS[i])
