"""The compiled decode step (model/compiled_step.py) forced on the CPU: it computes the same bytes as
the eager forward (the same operations, traced once and replayed), traces once per open-group
parity and never per offset, keeps the caches' bookkeeping as an eager call would (trim, then
decode), and refuses to create buffers inside a trace. MLX compiles the CPU's fused kernels with
the host compiler on first use (about a minute on a cold 2-core machine, cached afterwards)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.cache import LayerCache
from mlx_dsv41.model import compiled_step
from mlx_dsv41.synthetic import tiny_model

L, PREFILL = 22, 9


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def ids():
    return mx.array(np.random.default_rng(2).integers(0, 159, (2, L)))


def _decode(model, ids, compiled: bool, monkeypatch, cache=None, start=0):
    monkeypatch.setenv(compiled_step.ENV_VAR, "1" if compiled else "0")
    cache = model.make_cache() if cache is None else cache
    out = []
    if start == 0:
        monkeypatch.setenv(compiled_step.ENV_VAR, "0")  # the prompt: eager (more than MAX_TOKENS)
        out.append(np.array(model(ids[:, :PREFILL], cache)))
        monkeypatch.setenv(compiled_step.ENV_VAR, "1" if compiled else "0")
        start = PREFILL
    for t in range(start, ids.shape[1]):
        out.append(np.array(model(ids[:, t : t + 1], cache)))
    return np.concatenate(out, axis=1), cache


def test_compiled_decode_gives_the_eager_bytes_and_traces_once_per_parity(model, ids, monkeypatch):
    eager, eager_cache = _decode(model, ids, False, monkeypatch)
    traces = []
    traced = compiled_step.CompiledStep._traced
    monkeypatch.setattr(compiled_step.CompiledStep, "_traced", lambda self, *a: traces.append(1) or traced(self, *a))
    monkeypatch.setattr(model, "_compiled", None)  # a fresh CompiledStep, built on the counting method
    got, cache = _decode(model, ids, True, monkeypatch)
    assert np.array_equal(got.view(np.uint32), eager.view(np.uint32))
    # 13 decode steps, positions 9..21: ratio-2 owners alternate between an open and a closed
    # group, so two traces; nothing else (the offset is data, the buffers keep their shapes).
    assert len(traces) == 2
    assert [c.offset for c in cache] == [c.offset for c in eager_cache]
    assert all(
        mx.array_equal(a, b).item()
        for c, e in zip(cache[:-1], eager_cache[:-1])
        for a, b in zip(c.arrays(), e.arrays())
    )


def test_trim_then_compiled_decode_equals_never_decoded(model, ids, monkeypatch):
    _, cache = _decode(model, ids[:, :16], True, monkeypatch)
    for c in cache:
        assert c.trim(3) == 3
    got, _ = _decode(model, ids, True, monkeypatch, cache=cache, start=13)
    want, _ = _decode(model, ids, False, monkeypatch)
    assert np.array_equal(got.view(np.uint32), want[:, 13:].view(np.uint32))


def test_a_step_starts_at_the_position_the_step_before_left_on_the_device(model, ids, monkeypatch):
    """Only the first step after a prefill or a trim makes its position on the host; the others
    take the previous step's output (docs/design.md#step-position), with the same bytes."""
    made = []

    class CountingMx:  # compiled_step's `mx`, counting the positions it makes on the host
        def __getattr__(self, name):
            return getattr(mx, name)

        def array(self, *a, **k):
            made.append(a[0])
            return mx.array(*a, **k)

    monkeypatch.setattr(compiled_step, "mx", CountingMx())
    monkeypatch.setattr(model, "_compiled", None)
    got, cache = _decode(model, ids[:, :16], True, monkeypatch)
    assert [np.array(m).tolist() for m in made] == [[PREFILL] * compiled_step.POSITION_LANES]
    for c in cache:
        assert c.trim(3) == 3
    more, _ = _decode(model, ids, True, monkeypatch, cache=cache, start=13)
    assert [np.array(m).tolist() for m in made] == [
        [PREFILL] * compiled_step.POSITION_LANES,
        [13] * compiled_step.POSITION_LANES,
    ]
    want, _ = _decode(model, ids, False, monkeypatch)
    assert np.array_equal(got.view(np.uint32), want[:, :16].view(np.uint32))
    assert np.array_equal(more.view(np.uint32), want[:, 13:].view(np.uint32))


def test_a_trace_may_not_create_buffers():
    """A buffer made inside a trace would be a constant of the replayed graph: refused, and the
    cache is left as it was."""
    cache = LayerCache(window=4)

    def forward(caches, position, *_):
        caches[0].ring = mx.zeros((1, 4, 2))
        return mx.zeros((1,))

    with pytest.raises(RuntimeError, match="caches must be reserved first"):
        compiled_step.CompiledStep(forward)([cache], mx.zeros((1, 1), mx.int32), None, {}, None)
    assert cache.offset == 0 and cache.ring is None


def test_gpus_compile_by_default_and_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.delenv(compiled_step.ENV_VAR, raising=False)
    monkeypatch.setattr(compiled_step, "backend", lambda: "cpu")
    assert not compiled_step.compiles(1)  # the CPU's eager bytes are the reference
    for gpu in ("cuda", "metal"):
        monkeypatch.setattr(compiled_step, "backend", lambda gpu=gpu: gpu)
        assert compiled_step.compiles(1) and not compiled_step.compiles(compiled_step.MAX_TOKENS + 1)
    monkeypatch.setenv(compiled_step.ENV_VAR, "0")
    assert not compiled_step.compiles(1)
    monkeypatch.setenv(compiled_step.ENV_VAR, "1")
    assert compiled_step.compiles(1) and compiled_step.compiles(compiled_step.MAX_TOKENS)
    assert not compiled_step.compiles(compiled_step.MAX_TOKENS + 1)  # a prompt: always eager
    monkeypatch.setenv(compiled_step.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="MLX_DSV41_COMPILE must be 0 or 1; got 'yes'"):
        compiled_step.compiles(1)
    with pytest.raises(ValueError, match="MLX_DSV41_COMPILE must be 0 or 1; got 'yes'"):
        tiny_model(seed=0)  # refused when the model is made, not at its first decode step


def test_exl3_weights_are_decoded_outside_the_trace(loaded, monkeypatch):
    """The CPU reference keeps each small EXL3 layer's decoded W̃. A trace must find it held: decoded
    inside the trace, W̃ would be part of the replayed graph and decoded again at every step (the
    demo with a 2-token prompt decoded 6x slower compiled than eagerly). The steps still give the
    eager bytes."""
    from mlx_dsv41.exl3 import ops

    model = loaded[0]
    tracing, decoded_in_trace = [False], []
    traced, decode = compiled_step.CompiledStep._traced, ops.cpu_weight

    def in_trace(self, *a):
        tracing[0] = True
        try:
            return traced(self, *a)
        finally:
            tracing[0] = False

    monkeypatch.setattr(compiled_step.CompiledStep, "_traced", in_trace)
    monkeypatch.setattr(ops, "cpu_weight", lambda *a: decoded_in_trace.append(tracing[0]) or decode(*a))
    for module in model.modules():  # as loaded: nothing decoded yet
        module.pop("_w_tilde", None)
    model._compiled = None
    ids = mx.array(np.random.default_rng(5).integers(3, model.args.vocab_size, (1, 7)))
    out = {}
    for compiled in (True, False):
        monkeypatch.setenv(compiled_step.ENV_VAR, "1" if compiled else "0")
        cache = model.make_cache()
        out[compiled] = [np.array(model(ids[:, :2], cache))]  # a short prompt: the first trace
        out[compiled] += [np.array(model(ids[:, t : t + 1], cache)) for t in range(2, 7)]
    assert decoded_in_trace and not any(decoded_in_trace)
    for a, b in zip(out[True], out[False]):
        assert a.tobytes() == b.tobytes()
