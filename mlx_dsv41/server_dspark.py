"""DSpark speculative decoding in the server, between the batch's steps. Imported by
`mlx_dsv41.server_generation` (importing mlx-lm is slow).

Speculation is batch-1: one sequence's drafts are verified by one main forward of 1 + k tokens.
So drafting requests do not join mlx-lm's decode batch; they run in the `DraftLane` of the same
batch generator (server_generation.SlicedBatchGenerator). Every step of the generator runs one
decode step of the batch, one prefill chunk of its waiting prompts, and then units of the lane's
sequences in turn, each a prefill chunk (the batch's time-bounded chunk size) or one DSpark round
(a draft block, a verify, the accepted tokens), for about `prefill_slice` seconds (at least one
unit). A long prompt, drafting or not, therefore never holds the others up, and an abandoned
request is removed between two units like a batched one.

The lane answers in the batch's own response types (progress, end of segment, tokens with the
finish reason and, at the end, the caches and the tokens they hold), so mlx-lm's generation loop
(progress reports, stop handling, prompt-cache inserts) treats both alike. A lane sequence's
caches are the main model's with its DraftCache last: server_generation.PromptCache keeps such
entries apart from the batch's.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from mlx_dsv41.speculative import DraftStats, Sampling, SpeculativeDecoder, feed


@dataclass(frozen=True)
class DraftRequest:
    """How one request drafts: `draft` as SpeculativeDecoder takes it, its sampling, and the
    server's counters to add its rounds to."""

    draft: int | str | None
    sampling: Sampling
    stats: DraftStats


class RequestSampler:
    """mlx-lm's sampler of a request, carrying how it drafts (`dspark`, None: it does not), which is
    how a drafting request reaches the batch generator (mlx-lm's loop passes it the samplers)."""

    def __init__(self, sampler, dspark: DraftRequest | None):
        self.sampler, self.dspark = sampler, dspark

    def __call__(self, logprobs):
        return self.sampler(logprobs)


class DraftingSequence:
    """One drafting request: its prompt still to prefill (segments), then DSpark rounds.

    `held` are the tokens the caches hold (the cached prefix, the prompt fed so far, then every
    token produced but the last, which is chosen and not yet run): the key of the caches when they
    go to the prompt cache. A round may accept tokens past a stop; they are held, not sent."""

    def __init__(
        self,
        uid: int,
        model,
        segments: list[list[int]],
        cache: list,
        held: list[int],
        dspark: DraftRequest,
        max_tokens: int,
        stop_sequences,
    ):
        *main, draft_cache = cache
        self.uid, self.max_tokens = uid, max_tokens
        self.decoder = SpeculativeDecoder(
            model, draft=dspark.draft, sampling=dspark.sampling, cache=main, draft_cache=draft_cache
        )
        self.decoder.stats = dspark.stats
        self.segments = [list(s) for s in segments if s]
        if len(self.segments[-1]) > 1:  # the last token alone, as BatchGenerator.insert_segments does
            self.segments[-1:] = [self.segments[-1][:-1], self.segments[-1][-1:]]
        self.held, self.sent = list(held), 0
        self.total = sum(len(s) for s in self.segments)
        self.done = 0  # prompt tokens fed
        self.matcher = stop_sequences.matcher()

    @property
    def prefilling(self) -> bool:
        return self.decoder.token is None

    def caches(self) -> list:
        return [*self.decoder.cache, self.decoder.draft_cache]

    def unit(self, chunk: int) -> tuple[list, list]:
        """One unit of work: (prompt responses, generation responses)."""
        if len(self.segments) > 1:
            return [self.prefill_chunk(chunk)], []
        if self.prefilling:
            progress, tokens = self.first_token()
            return [progress], tokens
        return [], self.round()

    def prefill_chunk(self, step: int) -> PromptProcessingBatch.Response:
        """Feed up to `step` tokens of the current segment (the last segment is the last token)."""
        segment = self.segments[0]
        n = min(step, len(segment))
        chunk, self.segments[0] = segment[:n], segment[n:]
        feed(self.decoder.model, self.decoder.cache, chunk, draft_cache=self.decoder.draft_cache, step=n)
        self.held += chunk
        self.done += n
        ended = not self.segments[0]
        if ended:
            self.segments.pop(0)
        return PromptProcessingBatch.Response(self.uid, (self.done, self.total), ended, False)

    def first_token(self) -> tuple[PromptProcessingBatch.Response, list[GenerationBatch.Response]]:
        """The prompt's last token: x_{p+1} is chosen, the prompt is done."""
        (last,) = self.segments.pop(0)
        token, logprobs = self.decoder.start(last)
        self.held.append(last)
        self.done = self.total
        return (
            PromptProcessingBatch.Response(self.uid, (self.total, self.total), True, True),
            self._send([(token, logprobs)]),
        )

    def round(self) -> list[GenerationBatch.Response]:
        """One DSpark round: its accepted tokens and the next one, up to a stop."""
        previous = self.decoder.token
        produced = self.decoder.round(self.max_tokens - self.sent)
        self.held += [previous] + [token for token, _, _ in produced[:-1]]
        return self._send([(token, logprobs) for token, logprobs, _ in produced])

    def _send(self, produced) -> list[GenerationBatch.Response]:
        responses = []
        for token, logprobs in produced:
            self.sent += 1
            finish = "length" if self.sent >= self.max_tokens else None
            if self.matcher.advance(token):
                finish = "stop"
            done = finish is not None
            responses.append(
                GenerationBatch.Response(
                    self.uid,
                    token,
                    logprobs,
                    finish,
                    self.caches() if done else None,
                    list(self.held) if done else None,
                )
            )
            if done:
                break
        return responses


class DraftLane:
    """The drafting sequences of one batch generator, run a unit at a time in turn."""

    def __init__(self):
        self.sequences: dict[int, DraftingSequence] = {}
        self.turn = 0  # where the next step starts (round robin)

    def __len__(self) -> int:
        return len(self.sequences)

    def __contains__(self, uid) -> bool:
        return uid in self.sequences

    def add(self, sequence: DraftingSequence) -> None:
        self.sequences[sequence.uid] = sequence

    def step(self, chunk: int, budget_s: float):
        """Units of the sequences in turn for about `budget_s` seconds (at least one): (prompt
        responses, generation responses, prompt tokens fed, seconds spent feeding them)."""
        prompt_responses, generation_responses = [], []
        fed, feeding = 0, 0.0
        order = list(self.sequences.values())
        if not order:
            return prompt_responses, generation_responses, fed, feeding
        first, start = self.turn % len(order), time.perf_counter()
        for i, sequence in enumerate(order[first:] + order[:first]):  # noqa: B007 (i: read after the loop)
            chunked, tic, before = len(sequence.segments) > 1, time.perf_counter(), sequence.done
            progress, tokens = sequence.unit(chunk)
            if chunked:  # what the chunk-size controller measures (BatchGenerator counts the same)
                fed, feeding = fed + sequence.done - before, feeding + time.perf_counter() - tic
            prompt_responses += progress
            generation_responses += tokens
            if any(r.finish_reason is not None for r in tokens):
                del self.sequences[sequence.uid]
            if time.perf_counter() - start >= budget_s:
                break
        self.turn = first + i + 1
        return prompt_responses, generation_responses, fed, feeding

    def remove(self, uids) -> None:
        for uid in uids:
            self.sequences.pop(uid, None)

    def extract_cache(self, uids) -> dict:
        """{uid: (a copy of its caches, the tokens they hold)}, as BatchGenerator.extract_cache."""
        return {
            uid: (copy.deepcopy(self.sequences[uid].caches()), list(self.sequences[uid].held))
            for uid in uids
            if uid in self.sequences
        }

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for s in self.sequences.values() for c in s.caches())
