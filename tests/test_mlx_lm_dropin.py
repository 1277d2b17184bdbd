"""`mlx_dsv41.load()` results in mlx-lm's own generation APIs, on the demo checkpoint (real EXL3 +
Engram formats, converted): `generate` / `stream_generate` / `batch_generate` give exactly our
greedy tokens, prompt caches round-trip through `save_prompt_cache` / `load_prompt_cache`, and
`mlx_lm.load(dir, trust_remote_code=True)` builds the same model and chat encoding."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from demo_helpers import demo_checkpoint, detokenize, greedy
from mlx_lm import batch_generate, generate, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import mlx_dsv41
from mlx_dsv41 import chat

N = 6  # tokens per generation: enough to cross a ratio-2 group and the demo's candidate blocks


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = demo_checkpoint(tmp_path_factory)
    model, tokenizer = mlx_dsv41.load(path)
    return path, model, tokenizer


PROMPTS = ["The quick brown fox", "Hello! How are you today? I am fine, thank you."]


def test_stream_generate_and_generate_give_our_greedy_tokens(loaded):
    _, model, tokenizer = loaded
    ids = tokenizer.encode(PROMPTS[1])
    want = greedy(model, tokenizer, ids, N)
    got = [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=N)]
    got = [t for t in got if t not in tokenizer.eos_token_ids]
    assert got == want
    assert generate(model, tokenizer, ids, max_tokens=N) == detokenize(tokenizer, want)


def test_batch_generate_equals_each_prompt_alone(loaded):
    _, model, tokenizer = loaded
    prompts = [tokenizer.encode(p) for p in PROMPTS]  # different lengths: right-padded by mlx-lm
    assert len({len(p) for p in prompts}) == 2
    result = batch_generate(model, tokenizer, prompts, max_tokens=N, return_token_ids=True)
    for ids, got in zip(prompts, result.token_ids):
        assert got == greedy(model, tokenizer, ids, N)
    assert result.texts == [tokenizer.decode(t) for t in result.token_ids]


def test_batch_generate_stacks_rows_at_the_same_position(loaded, monkeypatch):
    """Two prompts of one length run as one stacked batch: still exactly what each gives alone."""
    import mlx_dsv41.batch_cache as cache_module

    _, model, tokenizer = loaded
    a = tokenizer.encode("The cat sat on the mat.")
    b = tokenizer.encode(PROMPTS[1])[: len(a)]
    assert len(a) == len(b) and a != b
    stacked = []
    real_stack = cache_module._stack
    monkeypatch.setattr(cache_module, "_stack", lambda rows: stacked.append(len(rows)) or real_stack(rows))
    result = batch_generate(model, tokenizer, [a, b], max_tokens=N, return_token_ids=True)
    assert stacked and set(stacked) == {2}  # the rows really ran as one batch
    monkeypatch.undo()
    assert result.token_ids == [greedy(model, tokenizer, a, N), greedy(model, tokenizer, b, N)]


def test_prompt_cache_round_trip_continues_identically(loaded, tmp_path):
    _, model, tokenizer = loaded
    ids = tokenizer.encode(PROMPTS[1])
    cache = model.make_cache()
    for _ in generate_step(mx.array(ids), model, max_tokens=1, prompt_cache=cache):
        pass  # prefill (and one decode step) into `cache`
    kept = copy.deepcopy(cache)
    file = tmp_path / "prompt.safetensors"
    save_prompt_cache(str(file), cache, metadata={"prompt": PROMPTS[1]})
    loaded_cache, meta = load_prompt_cache(str(file), return_metadata=True)
    assert meta == {"prompt": PROMPTS[1]}
    assert [type(c).__name__ for c in loaded_cache] == [type(c).__name__ for c in kept]
    assert [c.offset for c in loaded_cache] == [c.offset for c in kept]
    nxt = tokenizer.encode(" and then", add_special_tokens=False)

    def continue_from(c):
        return [int(t) for t, _ in generate_step(mx.array(nxt), model, max_tokens=N, prompt_cache=c)]

    assert continue_from(loaded_cache) == continue_from(kept)


def test_mlx_lm_load_with_trust_remote_code(loaded):
    from mlx_lm import load

    path, model, tokenizer = loaded
    theirs, their_tok = load(str(path), trust_remote_code=True)
    assert isinstance(theirs, mlx_dsv41.Model)
    ids = mx.array([tokenizer.encode(PROMPTS[0])])
    a = np.array(model(ids, model.make_cache()))
    b = np.array(theirs(ids, theirs.make_cache()))
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    msgs = [{"role": "user", "content": "hi"}]
    assert their_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == chat.render(msgs)
    assert their_tok.eos_token_ids == tokenizer.eos_token_ids == {1}


def test_mlx_lm_load_needs_trust_remote_code(loaded):
    from mlx_lm import load

    with pytest.raises(ValueError, match="trust_remote_code|custom module"):
        load(str(loaded[0]))


# ------------------------------------------------------------------ the batched cache protocol


@pytest.fixture(scope="module")
def tiny():
    from mlx_dsv41.synthetic import tiny_model

    return tiny_model(seed=0)


def _alone(model, ids, n):
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def test_continuous_batching_joins_and_leaves_mid_generation(tiny):
    """mlx-lm's BatchGenerator: a sequence joins while others decode (extend), sequences finish at
    different steps (filter), prompts are prefilled in right-padded chunks (prepare/finalize)."""
    from mlx_lm.generate import BatchGenerator

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 150, n).tolist() for n in (9, 20, 5)]
    lengths = [7, 3, 6]
    gen = BatchGenerator(tiny, max_tokens=8, prefill_step_size=6)
    uids = gen.insert(prompts[:2], max_tokens=lengths[:2])
    got = {u: [] for u in uids}
    for step in range(100):
        if step == 2:
            (late,) = gen.insert(prompts[2:], max_tokens=lengths[2:])
            got[late] = []
            uids.append(late)
        responses = gen.next_generated()
        if not responses and step > 2:
            break
        for r in responses:
            got[r.uid].append(r.token)
    gen.close()
    assert [got[u] for u in uids] == [_alone(tiny, p, n) for p, n in zip(prompts, lengths)]


def test_extracted_cache_is_independent_and_continues_like_the_sequence(tiny):
    from mlx_dsv41.batch_cache import BatchCache

    rng = np.random.default_rng(4)
    a, b = rng.integers(3, 150, 11).tolist(), rng.integers(3, 150, 6).tolist()
    caches = [tiny.make_cache(), tiny.make_cache()]
    batch = [c[0].merge([caches[0][i], caches[1][i]]) for i, c in enumerate(zip(*caches))]
    assert all(isinstance(c, BatchCache) for c in batch)
    tokens = mx.array([a, b + [0] * (len(a) - len(b))])
    for c in batch:
        c.prepare(lengths=[len(a), len(b)], right_padding=[0, len(a) - len(b)])
    tiny(tokens, batch)
    for c in batch:
        c.finalize()
    assert [c.rows[1].offset for c in batch] == [len(b)] * len(batch)  # padding never ran
    extracted = [c.extract(1) for c in batch]
    offsets = [c.offset for c in extracted]
    tiny(mx.array([[5], [6]]), batch)  # the batch moves on ...
    assert [c.offset for c in extracted] == offsets  # ... the extracted copy does not
    alone = tiny.make_cache()
    want = np.array(tiny(mx.array([b]), alone))[0, -1]
    got = np.array(tiny(mx.array([[7]]), extracted))[0, -1]
    ref = np.array(tiny(mx.array([[7]]), alone))[0, -1]
    assert want.shape == got.shape and np.array_equal(got, ref)


def test_left_padding_is_refused(tiny):
    batch = [c.merge([c]) for c in tiny.make_cache()]
    with pytest.raises(ValueError, match="left-padded"):
        batch[0].prepare(left_padding=[2])
