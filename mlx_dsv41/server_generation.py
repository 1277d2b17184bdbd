"""The server's generation side: subclasses of mlx-lm's server classes (mlx_lm.server,
mlx_lm.generate.BatchGenerator) for our model. Imported by `mlx_dsv41.server` when it serves
(importing mlx-lm is slow).

- `ModelProvider`: the one model, loaded and checked before the server starts.
- `ResponseGenerator`: chat prompts in the DeepSeek-V4.1 encoding, token by token, with segments
  (system prefix, conversation, answer header) mlx-lm caches separately; DSpark speculative
  decoding per request (`num_draft_tokens`, mlx-lm's field; default --draft, 0 turns it off) when
  the checkpoint has the draft head and nothing in the request changes the logits (logits
  processors, XTC); a generation thread that fails its pending requests and restarts instead of
  dying.
- `PromptCache`: mlx-lm's LRU prompt cache, never handing back an empty remainder (an exact hit
  used to kill the generation thread: "Sequence N has an empty prompt") nor trimming our caches
  further than they trim exactly (`LayerCache.max_trim`); entries that hold a DSpark state are kept
  apart, for drafting requests.
- `SlicedBatchGenerator`: mlx-lm's continuous batching interleaves one decode step of the running
  requests with one prefill chunk of the waiting prompts, but a chunk is `prefill_step_size`
  tokens (2048): tens of seconds on a CPU, during which every other request waits. Here a chunk
  is also bounded in time (`prefill_slice` seconds, from the measured prefill rate), so decode
  steps, new requests and the removal of abandoned ones come at least that often. Drafting
  requests run beside the batch in its `DraftLane` (server_dspark.py), sliced the same way.
  Seeded requests, which mlx-lm serves alone, draft in `_serve_single` (speculative.stream_generate).
"""

from __future__ import annotations

import logging
import weakref
from queue import Queue

import mlx.core as mx
from mlx_lm import server
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_dsv41 import chat
from mlx_dsv41.cache import DraftCache
from mlx_dsv41.server_dspark import DraftingSequence, DraftLane, DraftRequest, RequestSampler
from mlx_dsv41.speculative import DraftStats, Sampling, stream_generate

FIRST_STEP = 128  # prompt tokens of the first chunk, before any rate is known
MIN_STEP = 16  # below this, per-call overhead dominates


class PromptCache(LRUPromptCache):
    """mlx-lm's LRU prompt cache, safe for our caches and for exact hits. Entries whose caches end
    with a DraftCache (a drafting request's) live under the key (model, "dspark"), and a drafting
    request looks only there: its decoding needs the DSpark state, which a batched request's
    caches lack (and the batch cannot carry)."""

    drafting = False  # the request being scheduled drafts (set by ResponseGenerator._tokenize)

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        if prompt_cache and isinstance(prompt_cache[-1], DraftCache):
            model = (model, "dspark")
        return super().insert_cache(model, tokens, prompt_cache, *args, **kwargs)

    def fetch_nearest_cache(self, model, tokens):
        if self.drafting:
            model = (model, "dspark")
        try:
            cache, rest = super().fetch_nearest_cache(model, tokens)
        except ValueError as e:  # our caches trim only max_trim() tokens exactly: no reuse
            logging.info(f"prompt cache: not reusing a longer entry ({e})")
            return None, tokens
        if cache is not None and not rest:
            # mlx-lm needs at least one token to run: give back the last one.
            if can_trim_prompt_cache(cache) and min(c.max_trim() for c in cache) >= 1:
                trim_prompt_cache(cache, 1)
                return cache, tokens[-1:]
            return None, tokens
        return cache, rest


class ModelProvider(server.ModelProvider):
    """Holds the one model, loaded before the server starts."""

    def __init__(self, cli_args, model, tokenizer, name: str):
        super().__init__(cli_args)
        self.model, self.tokenizer, self.served_name = model, tokenizer, name
        self.model_key = ("mlx_dsv41", name)
        self.is_batchable = True

    def load_default(self):
        pass

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None:
            raise ValueError("adapters are not supported by this server")
        return self.model, self.tokenizer


class SlicedBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator with prefill chunks sized by time: about `prefill_slice` seconds
    each (0: by tokens only, mlx-lm's way), or twice the fixed cost of a forward pass where that
    cost alone exceeds the slice (a CPU: the prefill then keeps at least half its speed). The cost
    model, time = fixed + per_token x tokens per prompt, is fitted to the last chunks.
    Chunked prefill computes the same bytes as one prefill (our caches are exact across chunk
    boundaries): only the schedule changes."""

    prefill_slice: float = 0.0  # seconds; set by use_sliced_prefill

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_step = self.prefill_step_size
        self.timings: list[tuple[float, float]] = []  # (tokens, seconds) per prompt, see record
        self.lane = DraftLane()
        if self.prefill_slice > 0:
            self.prefill_step_size = min(self.max_step, FIRST_STEP)

    def _next(self):
        with self.stats() as done:
            prompt_responses, generation_responses = super()._next()
            chunks = len(self._currently_processing)  # each got a chunk in this call
            lane_prompts, lane_tokens, fed, feeding = self.lane.step(self.prefill_step_size, self.prefill_slice)
            self._counters.prompt_tokens += fed
            self._counters.prompt_time += feeding
            chunks += sum(1 for r in lane_prompts if not r.end_of_prompt)
        if self.prefill_slice > 0 and done.prompt_tokens > 0 and done.prompt_time > 0:
            prompts = max(1, chunks)
            self.record(done.prompt_tokens / prompts, done.prompt_time / prompts)
            self.prefill_step_size = self._step(prompts)
        return prompt_responses + lane_prompts, generation_responses + lane_tokens

    # ---------------------------------------------------------------- the drafting lane

    def insert_segments(
        self,
        segments,
        max_tokens=None,
        caches=None,
        all_tokens=None,
        samplers=None,
        logits_processors=None,
        stop_sequences=None,
    ):
        """Sequences whose sampler drafts go to the lane, the others to the batch (less the
        DraftCache their cache may end with: the batch runs the main model only)."""
        options = {
            "max_tokens": max_tokens,
            "caches": caches,
            "all_tokens": all_tokens,
            "samplers": samplers,
            "logits_processors": logits_processors,
            "stop_sequences": stop_sequences,
        }
        uids = []
        for i, segs in enumerate(segments):
            row = {name: None if values is None else values[i] for name, values in options.items()}
            if getattr(row["samplers"], "dspark", None) is not None:
                uids.append(self._add_drafting(segs, **row))
                continue
            if row["caches"] and isinstance(row["caches"][-1], DraftCache):
                row["caches"] = row["caches"][:-1]
            uids += super().insert_segments(
                [segs], **{name: None if value is None else [value] for name, value in row.items()}
            )
        return uids

    def _add_drafting(self, segments, *, max_tokens, caches, all_tokens, samplers, stop_sequences, **_) -> int:
        if caches is None:
            caches = [*self.model.make_cache(), self.model.make_draft_cache()]
        elif not isinstance(caches[-1], DraftCache):  # PromptCache.drafting sees that it never is
            raise ValueError("a drafting request's cached prompt has no DSpark state")
        uid, self._uid_count = self._uid_count, self._uid_count + 1
        self.lane.add(
            DraftingSequence(
                uid,
                self.model,
                segments,
                caches,
                all_tokens or [],
                samplers.dspark,
                max_tokens or self.max_tokens,
                stop_sequences or self._default_stop_sequences,
            )
        )
        return uid

    def remove(self, uids, return_prompt_caches=False):
        drafting = [u for u in uids if u in self.lane]
        caches = self.lane.extract_cache(drafting) if return_prompt_caches else {}
        self.lane.remove(drafting)
        return {**super().remove([u for u in uids if u not in drafting], return_prompt_caches), **caches}

    def extract_cache(self, uids):
        return {**super().extract_cache([u for u in uids if u not in self.lane]), **self.lane.extract_cache(uids)}

    @property
    def prompt_cache_nbytes(self):
        return super().prompt_cache_nbytes + self.lane.nbytes

    def record(self, tokens: float, seconds: float) -> None:
        """Keep the last timing of each of the last 8 chunk sizes (steady chunks add no new size,
        so the fit keeps the sizes it was made from)."""
        self.timings = [*(t for t in self.timings if t[0] != tokens), (tokens, seconds)][-8:]

    def _step(self, prompts: int) -> int:
        tokens, seconds = zip(*self.timings)
        # at most doubling per chunk: a few noisy timings cannot make one chunk block for long
        grown = min(self.max_step, 2 * self.prefill_step_size)
        if len(set(tokens)) == 1:  # one size tells no fixed cost from per-token cost: try another
            return grown if seconds[-1] < 2 * self.prefill_slice else max(MIN_STEP, int(tokens[-1]) // 2)
        mean_n, mean_t = sum(tokens) / len(tokens), sum(seconds) / len(seconds)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self.timings) / sum((n - mean_n) ** 2 for n in tokens)
        per_token = slope if slope > 0 else mean_t / mean_n
        fixed = max(0.0, mean_t - per_token * mean_n)
        target = max(self.prefill_slice / prompts, 2 * fixed)
        return max(MIN_STEP, min(grown, int((target - fixed) / per_token)))


def use_sliced_prefill(prefill_slice: float) -> None:
    """Make mlx-lm's generation loop, which builds its batch generator by the module-level name
    `mlx_lm.server.BatchGenerator`, build a SlicedBatchGenerator with this slice (seconds)."""
    SlicedBatchGenerator.prefill_slice = prefill_slice
    server.BatchGenerator = SlicedBatchGenerator


make_sampler = server._make_sampler  # mlx-lm's, before use_dspark


def use_dspark(generator: ResponseGenerator) -> None:
    """Make mlx-lm's generation loop, which makes a request's sampler by the module-level name
    `mlx_lm.server._make_sampler` and hands it to the batch generator, hand over how the request
    drafts with it (`generator.make_sampler`)."""
    server._make_sampler = generator.make_sampler


class RequestQueue(Queue):
    """The request queue, remembering each request's response queue while it is alive."""

    def __init__(self):
        super().__init__()
        self.response_queues = weakref.WeakSet()

    def put(self, item, *args, **kwargs):
        self.response_queues.add(item[0])
        super().put(item, *args, **kwargs)


class ResponseGenerator(server.ResponseGenerator):
    def __init__(self, model_provider, prompt_cache):
        self.stopped_by_disconnect = 0
        self.restarts = 0
        self.dspark = DraftStats()  # over every drafting request
        super().__init__(model_provider, prompt_cache)

    # ---------------------------------------------------------------- DSpark

    def draft_request(self, args) -> DraftRequest | None:
        """How this request drafts, or None: the model drafts, the request did not turn it off, and
        nothing in it changes the logits (those stay on mlx-lm's path)."""
        model = self.model_provider.model
        if (
            not getattr(model, "mtp", None)
            or args.num_draft_tokens == 0
            or server._make_logits_processors(args)
            or args.sampling.xtc_probability > 0
        ):
            return None
        # a request without num_draft_tokens gets the server's, which stands for --draft (auto included)
        draft = (
            self.cli_args.dspark_draft
            if args.num_draft_tokens == self.cli_args.num_draft_tokens
            else min(args.num_draft_tokens, model.args.dspark_block_size)
        )
        sampling = Sampling(args.sampling.temperature, args.sampling.top_p, args.sampling.top_k, args.sampling.min_p)
        return DraftRequest(draft, sampling, self.dspark)

    def make_sampler(self, args, tokenizer) -> RequestSampler:
        """mlx-lm's `_make_sampler`, its sampler carrying how the request drafts (use_dspark)."""
        return RequestSampler(make_sampler(args, tokenizer), self.draft_request(args))

    def _serve_single(self, request, stream):
        """mlx-lm serves a seeded request alone (the batch shares one random stream); drafting, with
        our speculative generator."""
        rqueue, request, args = request
        if self.draft_request(args) is None:
            return super()._serve_single((rqueue, request, args), stream)
        try:
            self._serve_dspark(rqueue, request, args)
        except Exception as e:
            rqueue.put(e)

    def _serve_dspark(self, rqueue, request, args):
        """One request with DSpark: mlx-lm's single-request protocol (context, then progress and
        Responses, then None) and prompt cache, our speculative generator."""
        provider = self.model_provider
        model, tokenizer = provider.model, provider.tokenizer
        prompt, _, _, initial_state, _ = self._tokenize(tokenizer, request, args)
        stop_sequences, text_sm = self._make_state_machine(provider.model_key, tokenizer, args.stop_words)
        ctx = server.GenerationContext(
            has_thinking=tokenizer.has_thinking,
            has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=initial_state,
            prompt=prompt,
        )
        rqueue.put(ctx)
        if args.seed is not None:
            mx.random.seed(args.seed)
        cache, rest = self.prompt_cache.fetch_nearest_cache(provider.model_key, prompt)  # our entries (_tokenize)
        ctx.prompt_cache_count = len(prompt) - len(rest)
        if cache is None:
            cache = model.make_cache() + [model.make_draft_cache()]
        dspark = self.draft_request(args)
        seen, matcher = list(prompt), stop_sequences.matcher()
        for gen in stream_generate(
            model,
            tokenizer,
            rest,
            args.max_tokens,
            draft=dspark.draft,
            sampling=dspark.sampling,
            prompt_cache=cache[:-1],
            draft_cache=cache[-1],
            stats=dspark.stats,
            prefill_step_size=self.cli_args.prefill_step_size,
            prompt_progress_callback=lambda done, total: rqueue.put((done, total)),
        ):
            finish = "stop" if matcher.advance(gen.token) else gen.finish_reason
            top = server._format_top_logprobs(gen.logprobs, args.top_logprobs, tokenizer)
            rqueue.put(server.Response(gen.text, gen.token, gen.logprobs[gen.token].item(), finish, top))
            seen.append(gen.token)
            if ctx._should_stop or finish is not None:
                break
        rqueue.put(None)
        # The cache must hold exactly the tokens of its key: a round may have run past the last
        # token sent (trim it back), and the last token sent is not run yet (leave it out).
        extra = cache[0].offset - len(seen)
        if extra > min(c.max_trim() for c in cache):
            return
        for c in cache:
            c.trim(max(extra, 0))
        self.prompt_cache.insert_cache(provider.model_key, seen[: cache[0].offset], cache)

    # ---------------------------------------------------------------- the generation thread

    @property
    def requests(self):
        return self._requests

    @requests.setter
    def requests(self, queue):  # mlx-lm's __init__ sets a plain Queue: keep track of requests
        self._requests = queue if isinstance(queue, RequestQueue) else RequestQueue()

    def _run_generate(self):
        while True:
            try:
                self._generate()
                return
            except Exception as e:
                logging.exception(f"generation thread failed, restarting: {e}")
                self.restarts += 1
                for rq in list(self.requests.response_queues):
                    rq.put(RuntimeError(f"generation failed: {e}"))
                if self._stop:
                    return

    def _tokenize(self, tokenizer, request, args):
        # mlx-lm fetches the request's prompt cache right after this, by the model's key alone.
        self.prompt_cache.drafting = self.draft_request(args) is not None
        if request.request_type != "chat":
            return super()._tokenize(tokenizer, request, args)
        options = dict(args.chat_template_kwargs or {})
        messages, tools = request.messages, request.tools
        prompt = chat.encode(tokenizer, messages, tools=tools, **options)
        # Segments let mlx-lm cache the system prefix and the conversation before the header.
        segments, kinds = [], []
        lead = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        start = 0
        if 0 < lead < len(messages):
            system = chat.encode(tokenizer, messages[:lead], tools=tools, add_generation_prompt=False, **options)
            if prompt[: len(system)] == system and len(system) < len(prompt):
                segments.append(system)
                kinds.append("system")
                start = len(system)
        ids = chat.control_token_ids(tokenizer)
        opening = [ids[chat.ASSISTANT], ids[chat.THINK if options["thinking"] else chat.END_THINK]]
        header = 2 if prompt[-2:] == opening else 0
        if len(prompt) - header > start:
            segments.append(prompt[start : len(prompt) - header])
            kinds.append("user")
        if header:
            segments.append(prompt[len(prompt) - header :])
            kinds.append("assistant")
        return prompt, segments, kinds, "reasoning" if options["thinking"] else "normal", None
