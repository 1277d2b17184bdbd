"""The DSpark draft block compiled (MLX_DSV41_COMPILE=1; model/dspark.py, model/compiled_step.py) on
the CPU: the eager bytes (tokens, logits, confidence and ring contents) over rounds whose ring-row
counts vary (forced rejections at every position), the same greedy generation, one trace per
number of ring rows (never one per round), and sampling left eager. MLX builds the CPU's fused
kernels with the host compiler at first use (about a minute on a cold 2-core machine)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.model import compiled_step, dspark
from mlx_dsv41.speculative import AUTO, Sampling, SpeculativeDecoder
from mlx_dsv41.synthetic import TINY_DSPARK, tiny_args, tiny_model

ARGS = tiny_args(**TINY_DSPARK)  # window 8, block 5, three stages
PROMPT = np.random.default_rng(11).integers(3, 150, 13).tolist()  # past the window: rings wrap
WRONG_AT = [4, 0, None, 2, 1, 3]  # one forced rejection position per round, in turn


@pytest.fixture(scope="module")
def model():
    return tiny_model(ARGS, seed=2)


def _bytes(a: mx.array) -> tuple:
    return a.dtype, a.shape, bytes(memoryview(a.view(mx.uint8) if a.dtype == mx.bfloat16 else a))


def _rounds(model, compiled: bool, monkeypatch, n: int = 24, draft=None, sampling=Sampling()):
    """Generate n tokens with forced rejections; returns (tokens, per round: the draft's tokens,
    logits, confidence and every ring array, as bytes; the ring rows each round wrote)."""
    truth, rounds, row_counts, count = [], [], [], [0]
    if sampling.greedy:  # the true continuation, to corrupt (eagerly: its drafts are not counted)
        monkeypatch.setenv(compiled_step.ENV_VAR, "0")
        plain = SpeculativeDecoder(model)
        truth = [t for t, _, _ in plain.generate(PROMPT, n + model.args.dspark_block_size)]
    monkeypatch.setenv(compiled_step.ENV_VAR, "1" if compiled else "0")
    mx.random.seed(7)
    decoder = SpeculativeDecoder(model, draft=draft, sampling=sampling)
    drafted = decoder.draft
    if sampling.greedy:

        def replace(tokens):
            k, at = tokens.shape[1], WRONG_AT[count[0] % len(WRONG_AT)]
            emitted, count[0] = len(generated), count[0] + 1
            want = list(truth[emitted : emitted + k])
            if at is not None and at < k:
                want[at] = (want[at] + 1) % model.args.vocab_size
            return mx.array([want], mx.int32)

        decoder.replace_drafts = replace

    def draft():
        row_counts.append(decoder.draft_cache.rows_to_write().shape[1])  # idempotent
        d = drafted()
        mx.eval(d.tokens, d.logits, d.confidence)
        rings = [a for r in decoder.draft_cache.rings for a in r.arrays()]
        rounds.append([_bytes(a) for a in (d.tokens, d.logits, d.confidence, *rings)])
        return d

    decoder.draft = draft
    generated: list[int] = []
    for token, _, _ in decoder.generate(PROMPT, n):
        generated.append(token)
    return generated, rounds, row_counts


def _count_traces(monkeypatch, model) -> list:
    keys = []
    traced = dspark.CompiledDraft._traced
    monkeypatch.setattr(
        dspark.CompiledDraft, "_traced", lambda self, key, *a: keys.append(key) or traced(self, key, *a)
    )
    monkeypatch.setattr(model, "_compiled_draft", None)  # a fresh one, built on the counting method
    return keys


def test_compiled_drafts_give_the_eager_bytes_and_trace_once_per_row_count(model, monkeypatch):
    eager_tokens, eager, eager_rows = _rounds(model, False, monkeypatch)
    keys = _count_traces(monkeypatch, model)
    tokens, got, rows = _rounds(model, True, monkeypatch)
    assert tokens == eager_tokens and rows == eager_rows
    assert len(set(rows)) >= 4  # a fresh ring's window, then 1 .. block + 1 after rejections
    assert len(got) == len(eager) and all(a == b for a, b in zip(got, eager))
    assert sorted(k[2][0] for k in keys) == sorted(set(rows))  # one trace per ring-row count
    again, _, _ = _rounds(model, True, monkeypatch)  # every key seen: replays only
    assert again == tokens and len(keys) == len(set(rows))


@pytest.mark.parametrize("draft", [None, 2, AUTO])
def test_compiled_greedy_generation_gives_the_eager_tokens(model, monkeypatch, draft):
    decoders = {}
    for compiled in (False, True):
        monkeypatch.setenv(compiled_step.ENV_VAR, "1" if compiled else "0")
        decoders[compiled] = SpeculativeDecoder(model, draft=draft)
        decoders[compiled].tokens = [t for t, _, _ in decoders[compiled].generate(PROMPT, 20)]
    assert decoders[True].tokens == decoders[False].tokens
    assert decoders[True].stats == decoders[False].stats


def test_the_demo_checkpoint_drafts_the_eager_bytes_compiled(loaded, monkeypatch):
    """EXL3 / FP8 / FP4 stages (their decoded weights held before the first trace)."""
    model = loaded[0]
    eager_tokens, eager, eager_rows = _rounds(model, False, monkeypatch, n=10)
    keys = _count_traces(monkeypatch, model)
    tokens, got, rows = _rounds(model, True, monkeypatch, n=10)
    assert tokens == eager_tokens and rows == eager_rows and got == eager
    assert len(keys) == len(set(rows))


def test_sampling_drafts_stay_eager(model, monkeypatch):
    keys = _count_traces(monkeypatch, model)
    sampling = Sampling(temp=0.8)
    eager, eager_rounds, _ = _rounds(model, False, monkeypatch, n=8, sampling=sampling)
    got, rounds, _ = _rounds(model, True, monkeypatch, n=8, sampling=sampling)
    assert got == eager and rounds == eager_rounds and keys == []


def test_drafts_compile_as_steps_do(monkeypatch):
    monkeypatch.delenv(compiled_step.ENV_VAR, raising=False)
    monkeypatch.setattr(compiled_step, "backend", lambda: "cuda")
    assert compiled_step.compiles(1) and compiled_step.compiles_draft()  # the GPU default
    monkeypatch.setattr(compiled_step, "backend", lambda: "cpu")
    assert not compiled_step.compiles_draft()  # the CPU: eager, as its steps
    monkeypatch.setenv(compiled_step.ENV_VAR, "0")
    assert not compiled_step.compiles_draft()
    monkeypatch.setenv(compiled_step.ENV_VAR, "1")
    assert compiled_step.compiles_draft()
    monkeypatch.setenv(compiled_step.ENV_VAR, "on")
    with pytest.raises(ValueError, match="MLX_DSV41_COMPILE must be 0 or 1"):
        compiled_step.compiles_draft()
