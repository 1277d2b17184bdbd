"""Speculative decoding with the DSpark draft head (docs/dspark.md#speculative): the main model's
tokens, or its distribution when sampling, with fewer main-model forwards.

One round at main position p (the caches cover 0..p, x_{p+1} is chosen and emitted):

  1. draft     `draft_block`: the rings get their missing entries up to p, then one block of
               drafts d_1..d_S from x_{p+1}; k of them are verified (fixed, or from the
               confidence head)
  2. verify    ONE main forward over [x_{p+1}, d_1..d_k] at p+1..p+1+k, capturing its hidden rows
  3. accept    greedy: the longest prefix the main argmax agrees with, then the main argmax
               after it; sampling: the standard rule (accept d_j with min(1, P/Q), else draw from
               norm(max(P - Q, 0)); all accepted: a bonus token from P), docs/dspark.md#greedy,
               docs/dspark.md#sampling
  4. roll back every main cache (window rings, compressed and index state, Engram history) by
               the k - n rejected tokens with their exact `trim` (cache.py); the DraftCache keeps
               the n + 1 accepted hidden rows, so the rings never see a rejected position
               (docs/dspark.md#stage-rollback)

P and Q are the distributions plain sampling would use: mlx-lm's filters (top-p, min-p, top-k, in
make_sampler's order) on the log-probabilities, then the temperature, for both the target and the
draft logits. Greedy output equals plain greedy decoding token for token wherever a forward of
1 + k rows gives the same logits as k + 1 one-row forwards (true on the CPU backend).

    decoder = SpeculativeDecoder(model, draft=4)      # or "auto"; Sampling(temp=...) to sample
    first = decoder.prefill(prompt_ids)
    for token, logprobs, from_draft in decoder.round(): ...

`stream_generate(model, tokenizer, prompt, ...)` wraps this as mlx-lm's generator of
`GenerationResponse`s (falling back to mlx-lm's own loop when the model cannot draft or draft=0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_dsv41.model.dspark import Draft, draft_block, greedy

AUTO = "auto"
DEFAULT_CONFIDENCE = 0.5  # --draft auto: verify the slots whose sigmoid(confidence) reaches this


@dataclass(frozen=True)
class Sampling:
    """The request's sampling: temperature 0 is greedy; top_p 1, top_k 0, min_p 0 are off."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def scaled(self, logits: mx.array) -> mx.array:
        """The logits plain sampling draws from [..., V]: log-probabilities through mlx-lm's
        filters (make_sampler's order), times 1/temp."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            x = apply_top_p(x, self.top_p)
        if self.min_p != 0.0:
            x = apply_min_p(x, self.min_p)
        if self.top_k > 0:
            x = apply_top_k(x, self.top_k)
        return x * (1.0 / self.temp)

    def probabilities(self, logits: mx.array) -> mx.array:
        return mx.softmax(self.scaled(logits), axis=-1)

    def choose(self, logits: mx.array) -> mx.array:
        """One token per row of logits [..., V]: the argmax, or a sample of `probabilities`."""
        if self.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.random.categorical(self.scaled(logits)).astype(mx.int32)


def accept(
    drafted: mx.array, draft_logits: mx.array, target_logits: mx.array, sampling: Sampling
) -> tuple[mx.array, mx.array]:
    """The acceptance step for a batch of rounds (lazy).

    drafted [B, k] the drafts d_1..d_k; draft_logits [B, k, V] the logits each was chosen from
    (with `sampling.choose`); target_logits [B, k+1, V] the main logits L_0..L_k of the verify.
    Returns (n [B]: drafts accepted, next [B]: the token after them), docs/dspark.md#greedy,
    docs/dspark.md#sampling."""
    k = drafted.shape[1]
    if sampling.greedy:
        choice = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # [B, k+1]
        n = _prefix_length(drafted.astype(mx.int32) == choice[:, :k])
        return n, mx.take_along_axis(choice, n[:, None], axis=1)[:, 0]
    p = sampling.probabilities(target_logits)  # [B, k+1, V]
    q = sampling.probabilities(draft_logits)  # [B, k, V]
    picked = drafted.astype(mx.int32)[..., None]
    p_d = mx.take_along_axis(p[:, :k], picked, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, picked, axis=-1)[..., 0]
    # u < min(1, p/q) without dividing: q_d > 0 for a token drawn from q.
    n = _prefix_length(mx.random.uniform(shape=p_d.shape) * q_d < p_d)
    residual = mx.maximum(p[:, :k] - q, 0.0)
    # A residual with no mass (P == Q up to rounding: the rejection had probability ~0) is P.
    empty = mx.sum(residual, axis=-1, keepdims=True) <= 0
    residual = mx.where(empty, p[:, :k], residual)
    dist = mx.concatenate([residual, p[:, k:]], axis=1)  # row j: what to draw if n == j
    candidates = mx.random.categorical(mx.log(dist)).astype(mx.int32)  # [B, k+1]
    return n, mx.take_along_axis(candidates, n[:, None], axis=1)[:, 0]


def feed(
    model, cache: list, tokens, *, draft_cache=None, step: int = 2048, progress: Callable[[int], None] | None = None
) -> None:
    """Run `tokens` (a prompt's first part: nothing is chosen) into the main caches, `step` at a
    time as mlx-lm prefills; with a `draft_cache`, the captured rows of every position too, so
    drafting can start after them. `progress(done)` after every chunk."""
    ids = mx.array(tokens, dtype=mx.int32).reshape(-1)
    for lo in range(0, ids.shape[0], step):
        chunk = ids[None, lo : lo + step]
        if draft_cache is None:
            model(chunk, cache)
        else:
            draft_cache.append(model(chunk, cache, capture=True)[1])
        mx.eval([c.state for c in cache], [] if draft_cache is None else draft_cache.arrays())
        if progress is not None:
            progress(min(lo + step, ids.shape[0]))


def _prefix_length(ok: mx.array) -> mx.array:
    """[B, k] bool -> [B] int32: how many leading entries of each row are True."""
    if ok.shape[1] == 0:
        return mx.zeros(ok.shape[:1], mx.int32)
    return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)


@dataclass
class DraftStats:
    """Counts over the decode rounds: main forwards, tokens they emitted, and per draft position j
    (1-based) how often it was verified and accepted."""

    forwards: int = 0
    emitted: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, k: int, n: int) -> None:
        if len(self.proposed) < k:
            self.proposed += [0] * (k - len(self.proposed))
            self.accepted += [0] * (k - len(self.accepted))
        for j in range(k):
            self.proposed[j] += 1
            self.accepted[j] += j < n
        self.forwards += 1
        self.emitted += n + 1

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.forwards if self.forwards else 0.0

    def rates(self) -> list[float]:
        """Acceptance rate by draft position: accepted / verified."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def line(self) -> str:
        rates = ", ".join(f"{j + 1}: {100 * r:.0f}%" for j, r in enumerate(self.rates())) or "none"
        return (
            f"DSpark: {self.tokens_per_forward:.2f} tokens per main forward ({self.forwards} forwards), "
            f"acceptance by position {rates}"
        )


class SpeculativeDecoder:
    """DSpark speculative decoding of one sequence (batch 1).

    draft: the number of drafts to verify per round (1 .. dspark_block_size), or "auto": the
    leading slots whose sigmoid(confidence) reaches `confidence` (at least one). `cache` and
    `draft_cache` may hold a prefix already (both at the same offset); by default they are new.
    Timing API (benchmarks): after `prefill`, `draft()` runs one draft block and `verify(drafted)`
    one main forward of 1 + k tokens; `rewind(k)` takes that forward back.
    """

    def __init__(
        self,
        model,
        *,
        draft: int | str | None = None,
        sampling: Sampling = Sampling(),
        confidence: float = DEFAULT_CONFIDENCE,
        cache: list | None = None,
        draft_cache=None,
    ):
        if not model.mtp:
            raise ValueError(f"this model cannot draft: {model.dspark_unavailable}")
        block = model.args.dspark_block_size
        draft = block if draft is None else draft
        if draft != AUTO and not (isinstance(draft, int) and 1 <= draft <= block):
            raise ValueError(f"draft must be 1..{block} (dspark_block_size) or {AUTO!r}, got {draft!r}")
        self.model, self.length, self.sampling = model, draft, sampling
        self.threshold = math.log(confidence / (1 - confidence))  # sigmoid(c) >= confidence
        self.cache = model.make_cache() if cache is None else cache
        self.draft_cache = model.make_draft_cache() if draft_cache is None else draft_cache
        if self.draft_cache.offset != self.cache[0].offset:
            raise ValueError(
                f"the draft cache is at position {self.draft_cache.offset}, the main cache at {self.cache[0].offset}"
            )
        slack = min(c.trim_slack for c in [*self.cache, self.draft_cache])
        if slack < block + 1:  # a verify of 1 + k tokens is taken back whole by `rewind`
            raise ValueError(
                f"caches with trim_slack {slack} cannot take back a verify of 1 + {block} "
                f"tokens; build them with trim_slack >= {block + 1}"
            )
        self.token: int | None = None  # x_{p+1}: chosen, emitted, not yet run
        self.stats = DraftStats()
        # Test hook: drafted [1, k] int32 -> the tokens to verify instead (greedy only: under
        # sampling the rule needs the tokens the draft distribution produced).
        self.replace_drafts: Callable[[mx.array], mx.array] | None = None

    # ---------------------------------------------------------------- the steps

    def _forward(self, tokens: mx.array) -> mx.array:
        """Main forward over tokens [1, S] at the caches' offset; keeps its hidden rows."""
        logits, hidden = self.model(tokens, self.cache, capture=True)
        self.draft_cache.append(hidden)
        return logits

    def prefill(
        self, prompt, step: int = 2048, progress: Callable[[int, int], None] | None = None
    ) -> tuple[int, mx.array]:
        """Run the prompt (all but its last token in chunks, then the last alone, as mlx-lm's
        generate_step does); returns (x_{p+1}, its log-probabilities). `progress(done, total)` is
        mlx-lm's prompt-progress callback: 0 first, after every chunk, and total once x_{p+1} is
        chosen."""
        ids = mx.array(prompt, dtype=mx.int32).reshape(1, -1)
        total = ids.shape[1]
        if total == 0:
            raise ValueError("the prompt is empty")
        report = progress or (lambda done, total: None)
        report(0, total)
        feed(
            self.model,
            self.cache,
            ids[0, :-1],
            draft_cache=self.draft_cache,
            step=step,
            progress=lambda done: report(done, total),
        )
        first = self.start(ids[0, -1].item())
        report(total, total)
        return first

    def start(self, last: int) -> tuple[int, mx.array]:
        """Run the prompt's last token (the caches hold the rest) and choose x_{p+1}; returns it
        and its log-probabilities."""
        logits = self._forward(mx.array([[last]], mx.int32))[0, -1]
        token = self.sampling.choose(logits)
        mx.eval(token)
        self.token = int(token.item())
        return self.token, logits - mx.logsumexp(logits)

    def draft(self) -> Draft:
        """One draft block from the current state (lazy). Repeating it drafts the same block: it
        rewrites only the ring entry of p, which is idempotent."""
        choose = greedy if self.sampling.greedy else self.sampling.choose  # the same argmax; `greedy` compiles
        return draft_block(self.model, self.draft_cache, mx.array([self.token]), choose)

    def verify(self, drafted: mx.array) -> tuple[mx.array, mx.array]:
        """One main forward over [x_{p+1}, drafted [1, k]] (lazy): (logits [1, 1+k, V], hidden
        rows). The main caches move on by 1 + k (`round` trims the rejected, `rewind(k)` all)."""
        tokens = mx.concatenate([mx.array([[self.token]], mx.int32), drafted.astype(mx.int32)], axis=1)
        return self.model(tokens, self.cache, capture=True)

    def rewind(self, k: int) -> None:
        """Take a whole `verify` of k drafts back (benchmarks)."""
        for c in self.cache:
            c.trim(k + 1)

    def draft_length(self, draft: Draft) -> int:
        if self.length != AUTO:
            return self.length
        confident = np.array(draft.confidence[0] >= self.threshold)
        return max(1, int(np.cumprod(confident).sum()))

    # ---------------------------------------------------------------- one round

    def round(self, limit: int | None = None) -> list[tuple[int, mx.array, bool]]:
        """One draft + verify round: [(token, log-probabilities, from_draft)], 1 to k + 1 of them
        (at most `limit`). The caches end at the last accepted position; the last token returned
        is x_{p'+1}, not yet run."""
        block = self.model.args.dspark_block_size
        k_max = block if limit is None else min(limit - 1, block)
        if k_max < 1:  # one token left: a plain step
            logits = self._forward(mx.array([[self.token]], mx.int32))[0]
            return self._settle(mx.zeros((1, 0), mx.int32), logits, 0, self.sampling.choose(logits[-1:]), 0)
        draft = self.draft()
        mx.eval(draft.tokens, draft.confidence)
        k = min(self.draft_length(draft), k_max)
        drafted = draft.tokens[:, 1 : k + 1]
        if self.replace_drafts is not None:
            drafted = self.replace_drafts(drafted)
        logits, hidden = self.verify(drafted)
        n, token = accept(drafted, draft.logits[:, :k], logits, self.sampling)
        mx.eval(n, token)
        n = int(n.item())
        for c in self.cache:
            c.trim(k - n)
        self.draft_cache.append(hidden[:, : n + 1])
        return self._settle(drafted, logits[0], n, token, k)

    def _settle(self, drafted: mx.array, logits: mx.array, n: int, token: mx.array, k: int):
        """Record the round and return its tokens; x_{p'+1} becomes the next round's input."""
        self.stats.add(k, n)
        logprobs = logits[: n + 1] - mx.logsumexp(logits[: n + 1], axis=-1, keepdims=True)
        self.token = int(token.reshape(-1)[0].item())
        tokens = [int(t) for t in np.array(drafted[0, :n])] + [self.token]
        return [(t, logprobs[i], i < n) for i, t in enumerate(tokens)]

    def generate(
        self, prompt, max_tokens: int, step: int = 2048, progress: Callable[[int, int], None] | None = None
    ) -> Iterator[tuple[int, mx.array, bool]]:
        """(token, log-probabilities, from_draft) for up to max_tokens tokens (-1: no limit)."""
        token, logprobs = self.prefill(prompt, step, progress)
        yield token, logprobs, False
        emitted = 1
        while max_tokens < 0 or emitted < max_tokens:
            left = None if max_tokens < 0 else max_tokens - emitted
            for item in self.round(left):
                emitted += 1
                yield item


def stream_generate(
    model,
    tokenizer,
    prompt,
    max_tokens: int = 256,
    *,
    draft: int | str | None = None,
    sampling: Sampling = Sampling(),
    confidence: float = DEFAULT_CONFIDENCE,
    prompt_cache: list | None = None,
    draft_cache=None,
    prefill_step_size: int = 2048,
    stats: DraftStats | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
):
    """mlx-lm's `stream_generate` contract (a generator of `GenerationResponse`s, stopping at EOS or
    after max_tokens, the last one with its finish_reason) with DSpark speculative decoding.

    draft: 0 turns drafting off, None drafts whole blocks, N or "auto" as SpeculativeDecoder.
    Without drafting (or when the model cannot draft) this is mlx-lm's own loop with the same
    sampling. `prompt_cache` (and, drafting, `draft_cache` at the same position) may hold the
    prompt's first tokens already: `prompt` is the rest. `stats` (a DraftStats) receives the
    rounds' counts; `prompt_progress_callback(done, total)` reports the prefill as mlx-lm does."""
    from mlx_lm.generate import stream_generate as plain_stream_generate
    from mlx_lm.sample_utils import make_sampler

    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (-1: no limit)")
    if draft == 0 or not model.mtp:
        sampler = make_sampler(sampling.temp, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k)
        yield from plain_stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens,
            sampler=sampler,
            prompt_cache=prompt_cache,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=prompt_progress_callback,
        )
        return
    decoder = SpeculativeDecoder(
        model, draft=draft, sampling=sampling, confidence=confidence, cache=prompt_cache, draft_cache=draft_cache
    )
    if stats is not None:
        decoder.stats = stats
    yield from _drafted_responses(
        decoder, tokenizer, _prompt_ids(tokenizer, prompt), max_tokens, prefill_step_size, prompt_progress_callback
    )


def _prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt given as text (encoded as mlx-lm does: BOS added unless the text starts with it),
    an mx.array or a sequence of ids, as a list of ids."""
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return list(np.array(prompt).reshape(-1).tolist()) if isinstance(prompt, mx.array) else list(prompt)


def _drafted_responses(
    decoder, tokenizer, prompt: list[int], max_tokens: int, prefill_step_size: int, prompt_progress_callback
):
    """stream_generate's responses from a SpeculativeDecoder's tokens."""
    from mlx_lm.generate import GenerationResponse

    detokenizer = tokenizer.detokenizer
    eos = set(tokenizer.eos_token_ids)
    tic = time.perf_counter()
    prompt_tps, n, token, logprobs, from_draft = 0.0, 0, None, None, False

    def response(finish_reason):
        return GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=len(prompt),
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
        )

    steps = decoder.generate(prompt, max_tokens, prefill_step_size, prompt_progress_callback)
    for n, (token, logprobs, from_draft) in enumerate(steps):  # noqa: B007 (response() reads them)
        if n == 0:
            prompt_tps = len(prompt) / (time.perf_counter() - tic)
            tic = time.perf_counter()
        if token in eos:
            break
        detokenizer.add_token(token)
        if n + 1 == max_tokens:
            break
        yield response(None)
    detokenizer.finalize()
    yield response("stop" if token in eos else "length")
