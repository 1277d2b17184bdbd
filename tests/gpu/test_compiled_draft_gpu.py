"""The compiled DSpark draft block on the GPU (MLX_DSV41_COMPILE=1; model/dspark.py): against the
eager block on the same GPU, over rounds of a greedy speculative generation (the rings written
1 .. block + 1 rows at a time): the same drafted tokens and logits and ring contents within 1e-3 of
their scale (the bound tests/gpu/test_compiled_step_gpu.py uses: compiled elementwise fusions may
round differently from MLX's separate kernels), one trace per ring-row count. Not yet run on a
GPU: until it passes there, drafts compile only when MLX_DSV41_COMPILE=1 is set explicitly."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.model import compiled_step, dspark
from mlx_dsv41.speculative import SpeculativeDecoder
from mlx_dsv41.synthetic import TINY_DSPARK, tiny_args, tiny_model

pytestmark = pytest.mark.gpu
ARGS = tiny_args(**TINY_DSPARK)
PROMPT = np.random.default_rng(11).integers(3, 150, 13).tolist()


def _drafts(model, compiled: bool, monkeypatch, plain: list[int]) -> tuple[list, list]:
    """Per round of a generation that follows `plain` with a rejection at rotating positions:
    (the ring-row count, the draft's arrays and the rings as numpy fp32 / int)."""
    monkeypatch.setenv(compiled_step.ENV_VAR, "1" if compiled else "0")
    decoder, out, rows, count = SpeculativeDecoder(model), [], [], [0]
    drafted = decoder.draft

    def draft():
        rows.append(decoder.draft_cache.rows_to_write().shape[1])
        d = drafted()
        rings = [a for r in decoder.draft_cache.rings for a in r.arrays()]
        arrays = (d.tokens, d.logits, d.confidence, *rings)
        out.append([np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in arrays])
        return d

    def replace(tokens):
        k, at, n = tokens.shape[1], count[0] % (ARGS.dspark_block_size + 1), len(emitted)
        count[0] += 1
        want = list(plain[n : n + k])
        if at < k:
            want[at] = (want[at] + 1) % ARGS.vocab_size
        return mx.array([want], mx.int32)

    decoder.draft, decoder.replace_drafts, emitted = draft, replace, []
    for token, _, _ in decoder.generate(PROMPT, 20):
        emitted.append(token)
    return rows, out


def test_compiled_drafts_match_eager_on_the_gpu(monkeypatch):
    model = tiny_model(ARGS, seed=2)
    monkeypatch.setenv(compiled_step.ENV_VAR, "0")
    plain = [t for t, _, _ in SpeculativeDecoder(model).generate(PROMPT, 20 + ARGS.dspark_block_size)]
    keys = []
    traced = dspark.CompiledDraft._traced
    monkeypatch.setattr(
        dspark.CompiledDraft, "_traced", lambda self, key, *a: keys.append(key) or traced(self, key, *a)
    )
    monkeypatch.setattr(model, "_compiled_draft", None)
    eager_rows, eager = _drafts(model, False, monkeypatch, plain)
    rows, got = _drafts(model, True, monkeypatch, plain)
    assert rows == eager_rows and len(got) == len(eager)
    for a, b in zip(got, eager):
        assert np.array_equal(a[0], b[0])  # the drafted tokens
        for x, y in zip(a[1:], b[1:]):
            assert x.shape == y.shape and np.abs(x - y).max() <= 1e-3 * max(np.abs(y).max(), 1e-6)
    assert sorted(k[2][0] for k in keys) == sorted(set(rows))
