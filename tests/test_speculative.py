"""DSpark speculative decoding (mlx_dsv41.speculative, docs/dspark.md#speculative) on the CPU.

Greedy: the output is plain greedy decoding's, token for token, whatever the drafts are: forced
rejections at every draft position (the drafts replaced by the true continuation with position j
corrupted), full acceptance (bonus token), the head's own drafts, fixed and confidence-chosen
lengths, on the dense tiny model, the official-format checkpoint (mxfp8 / mxfp4) and the demo
(EXL3, compressed attention, Engram from SSD); `stream_generate` yields mlx-lm's responses. A
rejected tail leaves every cache exactly as if it had never been decoded. Sampling: the acceptance rule
draws the target distribution (chi-square on a tiny vocabulary, with a negative control), and a
sampled round on the tiny model emits its first token with the main model's probabilities.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from demo_helpers import detokenize, greedy

from mlx_dsv41.cache import DraftCache, EngramHistory, LayerCache
from mlx_dsv41.speculative import AUTO, DraftStats, Sampling, SpeculativeDecoder, accept, stream_generate
from mlx_dsv41.synthetic import TINY_DSPARK, tiny_args, tiny_model

ARGS = tiny_args(**TINY_DSPARK)  # window 8, block 5, three stages
PROMPT = np.random.default_rng(11).integers(3, 150, 13).tolist()  # past the window: rings wrap
N = 14


@pytest.fixture(scope="module")
def model():
    return tiny_model(ARGS, seed=2)


def plain_greedy(model, prompt, n):
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache)
    return out


@pytest.fixture(scope="module")
def reference(model):
    return plain_greedy(model, PROMPT, N + ARGS.dspark_block_size)


def oracle(decoder: SpeculativeDecoder, truth: list[int], emitted: list[int], wrong_at):
    """Replace the drafts by the true continuation, position `wrong_at` (0-based; None: none; a
    list: one per round, in turn) corrupted."""
    rounds = [0]

    def replace(drafted):
        k, n = drafted.shape[1], len(emitted)
        tokens = list(truth[n : n + k])
        wrong = wrong_at[rounds[0] % len(wrong_at)] if isinstance(wrong_at, list) else wrong_at
        rounds[0] += 1
        if wrong is not None and wrong < k:
            tokens[wrong] = (tokens[wrong] + 1) % decoder.model.args.vocab_size
        return mx.array([tokens], mx.int32)

    decoder.replace_drafts = replace


def run(decoder, prompt, n, truth=None, wrong_at=None):
    emitted: list[int] = []
    if truth is not None:
        oracle(decoder, truth, emitted, wrong_at)
    for token, _, _ in decoder.generate(prompt, n):
        emitted.append(token)
    return emitted


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3, 4, None])
def test_greedy_equals_plain_greedy_with_a_rejection_at_every_position(model, reference, wrong_at):
    decoder = SpeculativeDecoder(model)
    assert run(decoder, PROMPT, N, reference, wrong_at) == reference[:N]
    stats = decoder.stats
    accepted = ARGS.dspark_block_size if wrong_at is None else wrong_at
    assert stats.accepted[:accepted] == stats.proposed[:accepted]  # every round up to the wrong one
    assert sum(stats.accepted[accepted:]) == 0
    assert stats.emitted == N - 1  # the first token comes from the prefill


@pytest.mark.parametrize("draft", [1, 3, AUTO])
def test_greedy_with_the_heads_own_drafts_and_any_length(model, reference, draft):
    decoder = SpeculativeDecoder(model, draft=draft)
    assert run(decoder, PROMPT, N) == reference[:N]
    verified = len(decoder.stats.proposed)  # the deepest position any round verified
    assert verified == draft if draft != AUTO else 1 <= verified <= ARGS.dspark_block_size


def test_official_formats_checkpoint_drafts_the_plain_greedy_tokens(tmp_path):
    """mxfp8 linears (main_proj and the stages' attention), mxfp4 experts, bf16 heads."""
    from mlx_dsv41.synthetic_checkpoints import write_official_checkpoint

    model = write_official_checkpoint(tmp_path, ARGS, seed=3).source_model()
    assert type(model.mtp[0].main_proj).__name__ == "MXLinear"
    assert type(model.mtp[1].ffn.experts).__name__ == "MXExperts"
    truth = plain_greedy(model, PROMPT[:9], 12)
    assert run(SpeculativeDecoder(model), PROMPT[:9], 8, truth, wrong_at=2) == truth[:8]
    assert run(SpeculativeDecoder(model), PROMPT[:9], 8) == truth[:8]


def test_the_demo_drafts_its_greedy_tokens_with_a_rejection_at_every_position(loaded):
    """The demo (EXL3, compressed KV, Engram from SSD), three drafts per round: rounds rejecting
    at positions 1, 2, 3 and accepting all, in turn."""
    model, tokenizer = loaded
    ids = tokenizer.encode("The quick brown fox")
    truth = greedy(model, tokenizer, ids, 11)
    assert len(truth) == 11  # no end of sentence: every round runs
    decoder = SpeculativeDecoder(model, draft=3)
    assert run(decoder, ids, 11, truth, wrong_at=[0, 1, 2, None]) == truth
    assert decoder.stats.proposed == [4, 4, 4] and decoder.stats.accepted == [3, 2, 1]


def test_stream_generate_yields_mlx_lm_responses(model, reference, loaded):
    """Our generator of mlx-lm's GenerationResponse (the demo's tokenizer on the tiny model's
    ids): the greedy tokens, the text streamed in pieces, and at the end the end-of-sentence
    token with finish_reason "stop" (the tiny model emits it fifth), as mlx-lm's own loop."""
    tokenizer = loaded[1]
    want = reference[: reference.index(1) + 1]
    assert len(want) < 8 and set(tokenizer.eos_token_ids) == {1}
    responses = list(stream_generate(model, tokenizer, PROMPT, 8))
    assert all(type(r).__name__ == "GenerationResponse" for r in responses)
    assert [r.token for r in responses] == want and responses[-1].finish_reason == "stop"
    assert "".join(r.text for r in responses) == detokenize(tokenizer, want[:-1])
    assert responses[0].prompt_tokens == len(PROMPT) and not responses[0].from_draft
    plain = list(stream_generate(model, tokenizer, PROMPT, 8, draft=0))  # mlx-lm's loop

    def seen(rs):
        return [(r.token, r.text, r.finish_reason) for r in rs]

    assert seen(plain) == seen(responses)
    assert [r.token for r in stream_generate(model, tokenizer, PROMPT, 3)] == want[:3]


# ------------------------------------------------------------------------------ caches


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _ring_rows(c: LayerCache) -> dict[int, np.ndarray]:
    """Position -> ring row, for every position the ring still holds."""
    held = range(max(c.offset - c.ring_size, c.ring_from), c.offset)
    return {t: _f32(c.ring[:, t % c.ring_size]) for t in held}


def assert_same_cache(a, b):
    assert type(a) is type(b) and a.offset == b.offset
    if isinstance(a, EngramHistory):
        assert np.array_equal(a.last(1), b.last(1))
        return
    if isinstance(a, DraftCache):
        assert np.array_equal(_f32(a.hidden)[:, -a.window :], _f32(b.hidden)[:, -b.window :])
        return
    ra, rb = _ring_rows(a), _ring_rows(b)
    both = ra.keys() & rb.keys()
    assert both >= set(range(max(0, a.offset - a.window_size), a.offset))  # the next windows
    assert all(np.array_equal(ra[t], rb[t]) for t in both)
    assert (a.kv is None) == (b.kv is None)
    if a.kv is not None:
        count = a.offset // a.ratio
        for x, y in ((a.kv, b.kv), (a.index_keys, b.index_keys)):
            assert np.array_equal(_f32(x[:, :count]), _f32(y[:, :count]))
    if a.raw_kv is not None:
        open_group = a.offset % a.ratio
        for x, y in ((a.raw_kv, b.raw_kv), (a.raw_gate, b.raw_gate)):
            x, y = np.array(x), np.array(y)
            assert np.array_equal(x[:, x.shape[1] - open_group :], y[:, y.shape[1] - open_group :])


def test_a_saved_prompt_with_its_draft_state_drafts_as_one_prefill(model, reference, tmp_path):
    """generate --prompt-cache-file: the prompt's start fed (`feed`, in chunks) into the main caches
    and the DraftCache, saved (mlx-lm's file, the DraftCache beside it) and read back, then
    continued, drafts the very blocks of one whole prefill (the head reads the saved rows: a fresh
    or misplaced DraftCache drafts others) and emits the plain greedy tokens; progress is mlx-lm's."""
    from mlx_dsv41 import prompt_cache
    from mlx_dsv41.speculative import feed

    head, rest, file = PROMPT[:9], PROMPT[9:], tmp_path / "prompt.safetensors"
    cache, draft_cache = model.make_cache(), model.make_draft_cache()
    feed(model, cache, head, draft_cache=draft_cache, step=4)
    prompt_cache.save(file, cache, head, tmp_path, None, draft_cache)
    saved = prompt_cache.read(file, tmp_path)
    assert prompt_cache.draft_file(file).is_file() and saved.cached == saved.draft_cache.offset == len(head)
    resumed = SpeculativeDecoder(model, draft=3, cache=saved.cache, draft_cache=saved.draft_cache)
    whole = SpeculativeDecoder(model, draft=3)
    reports = []
    assert resumed.prefill(rest, step=2, progress=lambda *r: reports.append(r))[0] == whole.prefill(PROMPT)[0]
    assert reports == [(0, 4), (2, 4), (3, 4), (4, 4)]
    ours, theirs = resumed.draft(), whole.draft()
    assert np.array_equal(np.array(ours.tokens), np.array(theirs.tokens))
    assert np.array_equal(np.array(ours.logits), np.array(theirs.logits))
    emitted = [resumed.token]
    while len(emitted) < N:
        emitted += [token for token, _, _ in resumed.round(N - len(emitted))]
    assert emitted == reference[:N]
    prompt_cache.save(file, cache, head, tmp_path, None)  # without a DraftCache: no stale one left beside
    assert not prompt_cache.draft_file(file).exists() and prompt_cache.read(file, tmp_path).draft_cache is None


@pytest.mark.parametrize("wrong_at", [1, 2])
def test_a_rejected_tail_leaves_every_cache_as_if_never_decoded(model, reference, wrong_at):
    """A 6-token verify keeps 1 + wrong_at tokens: window rings, compressed KV and index keys
    (trims inside and across ratio-2 groups), raw group rows, Engram history and the DraftCache
    equal those of a run that only ever saw the accepted tokens; the next forward agrees bit for
    bit."""
    decoder = SpeculativeDecoder(model)
    emitted = [decoder.prefill(PROMPT)[0]]
    oracle(decoder, reference, emitted, wrong_at)
    emitted += [t for t, _, _ in decoder.round()]
    assert emitted == reference[: 2 + wrong_at]
    plain, plain_draft = model.make_cache(), model.make_draft_cache()
    _, hidden = model(mx.array([PROMPT + emitted[:-1]]), plain, capture=True)
    plain_draft.append(hidden)
    for a, b in zip(decoder.cache + [decoder.draft_cache], plain + [plain_draft]):
        assert_same_cache(a, b)
    step = mx.array([[emitted[-1]]])
    assert np.array_equal(np.array(model(step, decoder.cache)), np.array(model(step, plain)))


def test_rings_equal_a_from_scratch_recomputation(model, reference):
    """After rounds with rejections, each stage's ring holds fq8(rope_t(kv_norm(wkv(main_x[t]))))
    of the accepted sequence's own hidden rows for the window before p (docs/dspark.md#stage-cache,
    docs/dspark.md#stage-rollback)."""
    decoder = SpeculativeDecoder(model)
    emitted = run(decoder, PROMPT, 11, reference, wrong_at=1)
    decoder.draft()  # writes the rings up to p
    seq = PROMPT + emitted[:-1]
    _, hidden = model(mx.array([seq]), model.make_cache(), capture=True)
    first = model.mtp[0]
    main_x = first.main_norm(first.main_proj(hidden))
    p, W = len(seq) - 1, ARGS.sliding_window
    for stage, ring in zip(model.mtp, decoder.draft_cache.rings):
        assert ring.offset == p + 1
        for t in range(p - W + 1, p + 1):
            want = stage.attn.window_keys(main_x[:, t : t + 1], t)[:, 0]
            assert np.array_equal(_f32(ring.ring[:, t % ring.ring_size]), _f32(want)), t


def test_timing_api_draft_is_repeatable_and_verify_rewinds(model):
    """The benchmark's calls: draft() twice gives the same block; verify(k) then rewind(k) leaves
    the caches where they were (the same verify logits again)."""
    decoder = SpeculativeDecoder(model, draft=4)
    decoder.prefill(PROMPT)
    a, b = decoder.draft(), decoder.draft()
    assert np.array_equal(np.array(a.tokens), np.array(b.tokens))
    assert np.array_equal(np.array(a.logits), np.array(b.logits))
    offsets = [c.offset for c in decoder.cache]
    first, _ = decoder.verify(a.tokens[:, 1:5])
    mx.eval(first)
    decoder.rewind(4)
    assert [c.offset for c in decoder.cache] == offsets
    again, _ = decoder.verify(a.tokens[:, 1:5])
    assert np.array_equal(np.array(first), np.array(again))


# ------------------------------------------------------------------------------ sampling


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs, bins with an expectation under 5 merged into one."""
    from math import erf, sqrt

    n = counts.sum()
    expected = probs * n
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    dof = max(int(keep.sum()) - 1, 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))  # Wilson-Hilferty
    return 0.5 * (1 - erf(z / sqrt(2)))


V = 6
_TARGET = np.random.default_rng(1).normal(size=(V, V)) * 1.5  # logits of token | previous token
_DRAFT = _TARGET + np.random.default_rng(2).normal(size=(V, V)) * 1.5  # a different chain


def _simulate(sampling: Sampling, trials: int, k: int, rule=accept) -> np.ndarray:
    """Speculative decoding of a first-order chain from token 0 until every trial has 3 tokens;
    returns the first three tokens of each trial [trials, 3]."""
    target, draft = mx.array(_TARGET, mx.float32), mx.array(_DRAFT, mx.float32)
    out = np.full((trials, 3 + k + 1), -1)
    length = np.zeros(trials, int)
    last = mx.zeros((trials,), mx.int32)
    while length.min() < 3:
        tokens, prev, q_logits = [], last, []
        for _ in range(k):
            q_logits.append(draft[prev])
            prev = sampling.choose(draft[prev])
            tokens.append(prev)
        drafted = mx.stack(tokens, axis=1)
        context = mx.concatenate([last[:, None], drafted], axis=1)  # the tokens L_0..L_k follow
        n, nxt = rule(drafted, mx.stack(q_logits, axis=1), target[context], sampling)
        n, nxt, drafted = np.array(n), np.array(nxt), np.array(drafted)
        for i in range(trials):
            got = list(drafted[i, : n[i]]) + [nxt[i]]
            take = min(len(got), out.shape[1] - length[i])
            out[i, length[i] : length[i] + take] = got[:take]
            length[i] += take
        last = mx.array(nxt.astype(np.int32))
    return out[:, :3]


def _exact_joint(sampling: Sampling) -> np.ndarray:
    step = np.array(sampling.probabilities(mx.array(_TARGET, mx.float32)).astype(mx.float32), np.float64)
    return step[0][:, None, None] * step[:, :, None] * step[None, :, :]  # P(a|0) P(b|a) P(c|b)


@pytest.mark.parametrize(
    "sampling",
    [Sampling(temp=1.0), Sampling(temp=0.7, top_k=4), Sampling(temp=1.3, top_p=0.8), Sampling(temp=1.0, min_p=0.1)],
)
def test_the_acceptance_rule_samples_the_target_distribution(sampling):
    """The joint distribution of three tokens, over rounds of k = 2 drafts from another chain,
    is the target's (filters applied to P and Q alike)."""
    mx.random.seed(5)
    samples = _simulate(sampling, 6000, k=2)
    counts = np.bincount(samples @ np.array([V * V, V, 1]), minlength=V**3)
    assert _chi_square_p(counts, _exact_joint(sampling).reshape(-1)) > 1e-4


def test_the_chi_square_check_catches_a_wrong_rule():
    """Negative control: keeping every draft is not the target distribution, and the same
    check rejects it."""

    def keep_all(drafted, q_logits, target_logits, sampling):
        n = mx.full((drafted.shape[0],), drafted.shape[1], mx.int32)
        return n, sampling.choose(target_logits[:, -1])

    mx.random.seed(5)
    sampling = Sampling(temp=1.0)
    samples = _simulate(sampling, 6000, k=2, rule=keep_all)
    counts = np.bincount(samples @ np.array([V * V, V, 1]), minlength=V**3)
    assert _chi_square_p(counts, _exact_joint(sampling).reshape(-1)) < 1e-6


def test_a_sampled_round_emits_its_first_token_with_the_main_probabilities(model):
    """End to end on the tiny model, many rounds at once (batch rows from one state): the draft
    samples from its filtered distribution, the verify's logits give P, and the token a round
    emits first (an accepted d_1, or the residual draw) is distributed as P."""
    from mlx_dsv41.model.dspark import draft_block

    rows, k = 600, 2
    sampling = Sampling(temp=1.0, top_k=8)
    cache, draft_cache = model.make_cache(), model.make_draft_cache()
    logits, hidden = model(mx.array([PROMPT[:6]]), cache, capture=True)
    draft_cache.append(hidden)
    cache, draft_cache = _tile(cache, rows), _tile([draft_cache], rows)[0]  # one state, `rows` times
    x = mx.full((rows,), int(mx.argmax(logits[0, -1])), mx.int32)
    mx.random.seed(3)
    draft = draft_block(model, draft_cache, x, sampling.choose)
    drafted = draft.tokens[:, 1 : k + 1]
    target, _ = model(mx.concatenate([x[:, None], drafted], axis=1), cache, capture=True)
    n, nxt = accept(drafted, draft.logits[:, :k], target, sampling)
    first = np.where(np.array(n) >= 1, np.array(drafted[:, 0]), np.array(nxt))
    p = np.array(sampling.probabilities(target[0, 0]).astype(mx.float32), np.float64)
    assert np.allclose(np.array(target[:, 0]), np.array(target[0, 0]))  # one state for every row
    assert 0 < np.mean(np.array(n) >= 1) < 1  # both branches of the rule ran
    assert _chi_square_p(np.bincount(first, minlength=ARGS.vocab_size), p) > 1e-4


def _tile(caches: list, rows: int) -> list:
    """The caches of one sequence repeated over `rows` batch rows."""
    return [
        type(c).from_state(tuple(mx.repeat(v, rows, axis=0) if isinstance(v, mx.array) else v for v in c.state))
        for c in caches
    ]


def test_top_k_one_sampling_is_greedy(model, reference):
    decoder = SpeculativeDecoder(model, sampling=Sampling(temp=1.0, top_k=1))
    assert run(decoder, PROMPT, 8) == reference[:8]


def test_draft_stats_count_positions():
    stats = DraftStats()
    for k, n in [(5, 2), (5, 5), (3, 0), (5, 1)]:
        stats.add(k, n)
    assert stats.forwards == 4 and stats.emitted == 2 + 5 + 0 + 1 + 4
    assert stats.proposed == [4, 4, 4, 3, 3] and stats.accepted == [3, 2, 1, 1, 1]
    assert "3.00 tokens per main forward (4 forwards)" in stats.line() and "1: 75%, 2: 50%" in stats.line()


def test_bad_draft_lengths_are_refused(model):
    for bad in (0, 6, "most", 2.5):
        with pytest.raises(ValueError, match="draft must be"):
            SpeculativeDecoder(model, draft=bad)
    cache = model.make_cache()
    model(mx.array([PROMPT[:3]]), cache)
    with pytest.raises(ValueError, match="draft cache is at position 0"):
        SpeculativeDecoder(model, cache=cache)
    from mlx_dsv41.cache import make_layer_cache

    short = [make_layer_cache(ARGS, i, trim_slack=4) for i in range(ARGS.num_hidden_layers)]
    with pytest.raises(ValueError, match=r"trim_slack 4 cannot take back a verify of 1 \+ 5 tokens"):
        SpeculativeDecoder(model, cache=short + [model.make_cache()[-1]])
