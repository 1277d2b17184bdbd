"""The server's generation side: subclasses of mlx-lm's server classes (mlx_lm.server,
mlx_lm.generate.BatchGenerator) for our model. Imported by `mlx_dsv41.server` when it serves
(importing mlx-lm is slow).

- `ModelProvider`: the one model, loaded and checked before the server starts.
- `ResponseGenerator`: chat prompts in the DeepSeek-V4.1 encoding, token by token, with segments
  (system prefix, conversation, answer header) mlx-lm caches separately; a generation thread that
  fails its pending requests and restarts instead of dying.
- `PromptCache`: mlx-lm's LRU prompt cache, never handing back an empty remainder (an exact hit
  used to kill the generation thread: "Sequence N has an empty prompt") nor trimming our caches
  further than they trim exactly (`LayerCache.max_trim`).
- `SlicedBatchGenerator`: mlx-lm's continuous batching interleaves one decode step of the running
  requests with one prefill chunk of the waiting prompts, but a chunk is `prefill_step_size`
  tokens (2048): tens of seconds on a CPU, during which every other request waits. Here a chunk
  is also bounded in time (`prefill_slice` seconds, from the measured prefill rate), so decode
  steps, new requests and the removal of abandoned ones come at least that often.
"""

from __future__ import annotations

import logging
import weakref
from queue import Queue

from mlx_lm import server
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from . import chat

FIRST_STEP = 128  # prompt tokens of the first chunk, before any rate is known
MIN_STEP = 16  # below this, per-call overhead dominates


class PromptCache(LRUPromptCache):
    """mlx-lm's LRU prompt cache, safe for our caches and for exact hits."""

    def fetch_nearest_cache(self, model, tokens):
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
        if self.prefill_slice > 0:
            self.prefill_step_size = min(self.max_step, FIRST_STEP)

    def _next(self):
        with self.stats() as done:
            out = super()._next()
        if self.prefill_slice > 0 and done.prompt_tokens > 0 and done.prompt_time > 0:
            prompts = max(1, len(self._currently_processing))  # each got a chunk in this call
            self.record(done.prompt_tokens / prompts, done.prompt_time / prompts)
            self.prefill_step_size = self._step(prompts)
        return out

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
        super().__init__(model_provider, prompt_cache)

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
            system = chat.encode(tokenizer, messages[:lead], tools=tools, add_generation_prompt=False,
                                 **options)
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
