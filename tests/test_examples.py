"""Every script in examples/ runs on the demo checkpoint, and what it prints is checked against
an independent computation in this process; the PNGs they draw (--png) are pixel for pixel the
figures of that computation's numbers; a bad --model, or --png without matplotlib, is one line."""

import hashlib
import importlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from demo_helpers import REPO, demo_checkpoint

import mlx_dsv41


def run(env, script, *args):
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "SYNTHETIC" in r.stderr  # the demo says what it is
    return r.stdout


@pytest.fixture(scope="module")
def examples():
    """The example modules, imported (their figure functions and computations)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        yield {name: importlib.import_module(name) for name in ("perplexity", "engram_inspect", "expert_routing")}
    finally:
        sys.path.remove(str(REPO / "examples"))


def width(text: str) -> int:
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def same_picture(png: Path, figure, tmp_path) -> bool:
    """`png` (written by a script) has exactly the pixels of `figure` drawn the same way here."""
    from matplotlib.image import imread

    ours = tmp_path / "ours.png"
    figure.savefig(ours, dpi=100)
    a, b = imread(png), imread(ours)
    return a.shape == b.shape and a.shape[0] > 100 and bool((a == b).all())


def test_perplexity_equals_one_unchunked_forward(env, loaded, examples, tmp_path):
    out = run(env, "perplexity.py", "--chunk", "7", "--max-tokens", "40", "--png", str(tmp_path / "loss.png"))
    model, tokenizer = loaded
    ids = tokenizer.encode((REPO / "examples" / "sample.txt").read_text())[:40]
    logits = model(mx.array([ids]), model.make_cache())[0].astype(mx.float32)
    logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)
    nll = -np.mean(logp[np.arange(len(ids) - 1), ids[1:]])
    assert "tokens scored:     39 (chunks of 7" in out
    got = float(re.search(r"mean NLL:\s+([\d.]+)", out).group(1))
    assert got == pytest.approx(nll, abs=1e-3)
    assert float(re.search(r"perplexity:\s+([\d.]+)", out).group(1)) == pytest.approx(math.exp(nll), rel=1e-3)
    loss = -np.array(examples["perplexity"].token_log_likelihoods(model, ids, 7))
    assert loss.mean() == pytest.approx(nll, abs=1e-4)
    figure = examples["perplexity"].loss_figure(loss, "per-token loss, sample.txt")
    assert np.array_equal(figure.axes[0].lines[0].get_ydata(), loss)
    assert same_picture(tmp_path / "loss.png", figure, tmp_path)


def test_attention_variants_are_byte_identical(env, loaded):
    prompt = "A short prompt, then two greedy steps."
    out = run(env, "attention_variants.py", "--decode", "2", "--repeats", "1", "--prompt", prompt)
    assert "logits byte-identical across variants: yes; greedy tokens identical: yes" in out
    digests = re.findall(r"^(serial|parallel|auto) .* ([0-9a-f]{16})$", out, re.M)
    assert [v for v, _ in digests] == ["serial", "parallel", "auto"] and len({d for _, d in digests}) == 1
    # The printed digest is that of the model's own logits (prefill, then two greedy steps),
    # recomputed here: on the CPU every variant runs the same reference, so this is what can fail.
    model, tokenizer = loaded
    ids = tokenizer.encode(prompt)
    cache = model.make_cache()
    steps = [model(mx.array([ids]), cache)[0].astype(mx.float32)]
    for _ in range(2):
        steps.append(model(mx.array([[int(mx.argmax(steps[-1][-1]))]]), cache)[0].astype(mx.float32))
    want = hashlib.sha256(np.concatenate([np.array(s) for s in steps]).tobytes()).hexdigest()[:16]
    assert digests[0][1] == want


def test_engram_inspect_shows_the_model_rows_and_gates(env, loaded, examples, tmp_path_factory, tmp_path):
    prompt = "The cat sat. The cat sat."
    out = run(env, "engram_inspect.py", "--prompt", prompt, "--png", str(tmp_path / "gates.png"))
    model, tokenizer = loaded
    ids = tokenizer.encode(prompt)
    rows = model.engram_row_ids(np.array([ids]))[0]
    heads, sizes = model.args.engram_n_heads, model.args.engram_ngram_sizes
    for li, layer in enumerate(model.args.engram_layer_ids):
        section = out.split(f"== Engram layer {layer}:")[1].split("== Engram layer")[0]
        table = re.findall(r"^\s+(\d+)\s+'.*?'\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+((?:[\d.]+ ?){4})$", section, re.M)
        assert len(table) == len(ids)
        lines = [line for line in section.splitlines() if re.match(r"^\s+\d+\s+'", line)][: len(ids)]
        gate_column = {width(line[: line.rindex("  ") + 2]) for line in lines}  # where the gates start
        assert len(gate_column) == 1, lines  # the columns line up (wide characters count twice)
        for t, *cells, gates in table:
            want = [
                ",".join(str(int(r)) for r in rows[int(t), li, k * heads : (k + 1) * heads]) for k in range(len(sizes))
            ]
            assert cells == want
            assert all(0 < float(g) < 1 for g in gates.split())
        assert int(re.search(r"hit again: (\d+)", section).group(1)) > 0  # "The cat sat" twice
    fresh, _ = mlx_dsv41.load(demo_checkpoint(tmp_path_factory))  # the example wraps its Engram modules
    gates = examples["engram_inspect"].engram_gates(fresh, ids)
    figure = examples["engram_inspect"].gates_figure(gates, [tokenizer.decode([t]) for t in ids])
    for ax, g in zip(figure.axes[: len(gates)], gates.values()):  # then the colorbars
        assert np.array_equal(ax.images[0].get_array(), g.T) and ((0 < g) & (g < 1)).all()
    assert same_picture(tmp_path / "gates.png", figure, tmp_path)


def test_expert_routing_counts_every_pick(env, loaded, examples, tmp_path):
    out = run(
        env,
        "expert_routing.py",
        "--json",
        str(tmp_path / "counts.json"),
        "--show",
        "4",
        "--png",
        str(tmp_path / "routing.png"),
    )
    data = json.loads((tmp_path / "counts.json").read_text())
    args = loaded[0].args
    counts = np.array(data["counts"])
    assert counts.shape == (args.num_hidden_layers, args.n_routed_experts)
    assert (counts.sum(axis=1) == data["tokens"] * args.num_experts_per_tok).all()
    assert out.count("\nlayer ") == args.num_hidden_layers
    assert "less used experts not shown" in out
    figure = examples["expert_routing"].routing_figure(counts, f"expert picks over {data['tokens']} tokens")
    assert np.array_equal(figure.axes[0].images[0].get_array(), counts)
    assert same_picture(tmp_path / "routing.png", figure, tmp_path)


def test_a_bad_model_is_one_line(env, tmp_path):
    """(Every example loads through common.load.)"""
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "perplexity.py"), "--model", str(tmp_path / "nothing")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr == f"error: {tmp_path / 'nothing'}: no such directory\n"


def test_png_without_matplotlib_is_one_line_before_any_work(env, tmp_path):
    """A matplotlib that fails to import stands in for a missing one."""
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "expert_routing.py"), "--png", "x.png"],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: --png needs matplotlib") and r.stderr.count("\n") == 1
