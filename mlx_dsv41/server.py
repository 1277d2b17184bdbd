"""`python -m mlx_dsv41.server`: mlx-lm's OpenAI-compatible HTTP server, serving our model.

    python -m mlx_dsv41.server --demo                      # http://127.0.0.1:8080
    python -m mlx_dsv41.server --model ~/models/dsv41-mlx --port 8000 --effort max

Endpoints are mlx-lm's (`POST /v1/chat/completions`, `POST /v1/completions`, `GET /health`,
`GET /v1/models`), plus `GET /v1/stats` (Engram reads, attention calls, generations stopped by a
client disconnect). What this module changes, by subclassing mlx-lm's classes:

- Chat prompts use the DeepSeek-V4.1 encoding (mlx_dsv41.chat), token by token: thinking mode
  and effort per request (`reasoning_effort`: low | high | max | 1..100, or `chat_template_kwargs`
  `{"thinking": bool, "reasoning_effort": ...}`), server defaults from --thinking / --effort.
  Reasoning comes back in the `reasoning` field, the answer in `content`.
- One model: it is loaded (and checked) before the server starts; a request's "model" field only
  names it, it never makes the server load another path (mlx-lm would load any path or repo).
- Malformed requests (bad JSON, bad messages, roles, content, tools, effort, logit_bias ids
  outside the vocabulary, adapters) get a 400 JSON error before anything is queued.
- A client that disconnects mid-generation stops its generation: the connection is checked
  before every token is sent (mlx-lm only notices a failed write, and never in non-streaming
  mode).
- DSpark speculative decoding (mlx_dsv41.speculative) per request when the checkpoint has the
  draft head: a request's `num_draft_tokens` (mlx-lm's field; default --draft, the whole block)
  sets the drafts verified per main forward, 0 turns it off. Drafting requests are decoded one at
  a time (speculation is batch-1); the others, and those with logits processors or XTC, take
  mlx-lm's batched path. Greedy replies are the same either way.
- The prompt cache never hands mlx-lm an empty remainder (an exact cache hit used to kill the
  generation thread: "Sequence N has an empty prompt") and never trims our caches further than
  they can be trimmed exactly (`LayerCache.max_trim`).
- If the generation thread still fails, the requests it held get an error and it restarts.
It binds 127.0.0.1 unless --host says otherwise; like mlx-lm's, it is not hardened for the open
internet.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import sys
import weakref
from pathlib import Path
from queue import Queue

import typer

from . import chat
from .generate import (Attention, CLIError, check_draft, engram_totals, load_for_generation, parse_draft,
                       resolve_model)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Serve DeepSeek-V4.1 over mlx-lm's OpenAI-compatible HTTP API.")


def _mlx_lm_server():
    from mlx_lm import server

    return server


class ClientGone(Exception):
    """The client closed its connection; its generation has been told to stop."""


def _make_classes():
    """Subclasses of mlx-lm's server classes (built on first use: importing mlx-lm is slow)."""
    server = _mlx_lm_server()
    from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

    import mlx.core as mx

    from .speculative import DraftStats, Sampling, stream_generate

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

        def _drafts(self, args) -> bool:
            """Whether this request decodes with DSpark: the model drafts, the request did not turn
            it off, and nothing in it changes the logits (those stay on mlx-lm's path)."""
            return (bool(getattr(self.model_provider.model, "mtp", None)) and args.num_draft_tokens != 0
                    and not server._make_logits_processors(args) and args.sampling.xtc_probability <= 0)

        def _is_batchable(self, args):
            return super()._is_batchable(args) and not self._drafts(args)

        def _serve_single(self, request, stream):
            if not self._drafts(request[2]):
                return super()._serve_single(request, stream)
            rqueue, request, args = request
            try:
                self._serve_dspark(rqueue, request, args)
            except Exception as e:
                rqueue.put(e)

        def _serve_dspark(self, rqueue, request, args):
            """One request with DSpark: mlx-lm's single-request protocol (context, then Responses,
            then None) and prompt cache, our speculative generator."""
            provider = self.model_provider
            model, tokenizer = provider.model, provider.tokenizer
            prompt, _, _, initial_state, _ = self._tokenize(tokenizer, request, args)
            stop_sequences, text_sm = self._make_state_machine(provider.model_key, tokenizer, args.stop_words)
            ctx = server.GenerationContext(
                has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
                tool_parser=tokenizer.tool_parser, text_sm=text_sm, initial_state=initial_state, prompt=prompt)
            rqueue.put(ctx)
            if args.seed is not None:
                mx.random.seed(args.seed)
            key = (*provider.model_key, "dspark")  # entries with a DraftCache, apart from the batched ones
            cache, rest = self.prompt_cache.fetch_nearest_cache(key, prompt)
            ctx.prompt_cache_count = len(prompt) - len(rest)
            if cache is None:
                cache = model.make_cache() + [model.make_draft_cache()]
            sampling = Sampling(args.sampling.temperature, args.sampling.top_p, args.sampling.top_k,
                                args.sampling.min_p)
            draft = self.cli_args.dspark_draft if args.num_draft_tokens == self.cli_args.num_draft_tokens \
                else min(args.num_draft_tokens, model.args.dspark_block_size)
            seen, matcher = list(prompt), stop_sequences.matcher()
            for gen in stream_generate(model, tokenizer, rest, args.max_tokens, draft=draft, sampling=sampling,
                                       prompt_cache=cache[:-1], draft_cache=cache[-1], stats=self.dspark,
                                       prefill_step_size=self.cli_args.prefill_step_size):
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
            self.prompt_cache.insert_cache(key, seen[: cache[0].offset], cache)

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

    class APIHandler(server.APIHandler):
        defaults: dict = {}

        # ---------------------------------------------------------------- requests

        def handle_chat_completions(self):
            body = self.body
            messages, tools = body.get("messages"), body.get("tools") or None
            options = self._chat_options(body)
            chat.render_pieces(messages, tools=tools, **options)  # ChatError -> 400 (do_POST)
            self.chat_template_kwargs = options
            self._one_model()
            return super().handle_chat_completions()

        def handle_text_completions(self):
            if not isinstance(self.body.get("prompt"), str):
                raise ValueError("prompt must be a string")
            self._one_model()
            return super().handle_text_completions()

        def _chat_options(self, body) -> dict:
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ValueError("chat_template_kwargs must be an object")
            thinking = kwargs.get("thinking", kwargs.get("enable_thinking", self.defaults["thinking"]))
            if not isinstance(thinking, bool):
                raise ValueError("thinking must be true or false")
            effort = body.get("reasoning_effort", kwargs.get("reasoning_effort", self.defaults["effort"]))
            return {"thinking": thinking, "effort": chat.parse_effort(effort)}

        def _one_model(self):
            if self.adapter is not None:
                raise ValueError("adapters are not supported by this server")
            provider = self.response_generator.model_provider
            self.requested_model = provider.served_name
            self.requested_draft_model = "default_model"

        def validate_model_parameters(self):
            super().validate_model_parameters()
            vocab = len(self.response_generator.model_provider.tokenizer)
            for token in self.logit_bias or {}:
                if not 0 <= token < vocab:
                    raise ValueError(f"logit_bias token id {token} is outside the vocabulary (0..{vocab - 1})")

        # ---------------------------------------------------------------- disconnects

        def _client_gone(self) -> bool:
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def handle_completion(self, request, stop_words):
            generator = self.response_generator
            handler = self

            class Watched:
                """The response generator, with every token checked against the connection."""

                def __getattr__(self, name):
                    return getattr(generator, name)

                def generate(self, *args, **kwargs):
                    ctx, responses = generator.generate(*args, **kwargs)

                    def watched():
                        for response in responses:
                            if handler._client_gone():
                                ctx.stop()
                                raise ClientGone()
                            yield response

                    return ctx, watched()

            self.response_generator = Watched()
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                generator.stopped_by_disconnect += 1
                logging.info(f"{getattr(self, 'request_id', 'request')}: client disconnected; "
                             f"generation stopped")
                self.close_connection = True
            finally:
                self.response_generator = generator

        # ---------------------------------------------------------------- GET

        def do_GET(self):
            if self.path == "/v1/stats":
                return self._json(200, self._stats())
            if self.path.startswith("/v1/models"):
                return self._json(200, {"object": "list", "data": [
                    {"id": self.response_generator.model_provider.served_name, "object": "model",
                     "created": self.created, "owned_by": "mlx_dsv41"}]})
            return super().do_GET()

        def _stats(self) -> dict:
            from .kernels import sparse_attention

            rows, nbytes = engram_totals(self.response_generator.model_provider.model)
            dspark = self.response_generator.dspark
            return {"engram_rows_read": rows, "engram_bytes_read": nbytes,
                    "attention_calls": sparse_attention.variant_counts(),
                    "dspark": {"main_forwards": dspark.forwards, "tokens": dspark.emitted,
                               "acceptance_by_position": dspark.rates()},
                    "stopped_by_disconnect": self.response_generator.stopped_by_disconnect,
                    "generation_restarts": self.response_generator.restarts}

        def _json(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):
            logging.debug(format % args)

    class HTTPServer(server.ThreadingHTTPServer):
        def server_bind(self):
            super().server_bind()
            host, port = self.server_address[:2]
            print(f"Serving on http://{host}:{port}", file=sys.stderr, flush=True)

    return PromptCache, ModelProvider, ResponseGenerator, APIHandler, HTTPServer


def server_args(**overrides) -> argparse.Namespace:
    """The settings mlx-lm's server classes read (their defaults), with ours on top."""
    args = dict(
        model=None, adapter_path=None, draft_model=None, num_draft_tokens=3, trust_remote_code=False,
        chat_template="", use_default_chat_template=False, chat_template_args={}, allowed_origins=["*"],
        temp=0.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=512, decode_concurrency=32,
        prompt_concurrency=8, prefill_step_size=2048, prompt_cache_size=10, prompt_cache_bytes=None,
        kv_bits=None, kv_group_size=64, quantized_kv_start=5000, pipeline=False,
        dspark_draft=None,  # ours: --draft for requests that do not set num_draft_tokens
    )
    unknown = set(overrides) - set(args)
    if unknown:
        raise TypeError(f"server_args: unknown settings {sorted(unknown)}")
    return argparse.Namespace(**{**args, **overrides})


def serve(model, tokenizer, name: str, cli_args: argparse.Namespace, host: str, port: int,
          thinking: bool = True, effort: int = chat.EFFORT_ALIASES[chat.DEFAULT_EFFORT]) -> None:
    """Serve until interrupted (blocks)."""
    PromptCache, ModelProvider, ResponseGenerator, APIHandler, HTTPServer = _make_classes()
    server = _mlx_lm_server()
    APIHandler.defaults = {"thinking": thinking, "effort": effort}
    provider = ModelProvider(cli_args, model, tokenizer, name)
    generator = ResponseGenerator(provider, PromptCache(cli_args.prompt_cache_size))
    server._run_http_server(host, port, generator, server_class=HTTPServer, handler_class=APIHandler)


@app.command()
def main_command(
    model: str = typer.Option(None, "--model", "-m", help="Converted checkpoint directory or HF repo id."),
    demo: bool = typer.Option(False, "--demo", help="Serve the built-in demo checkpoint (synthetic weights)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: local only)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port (0: any free port)."),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1, help="Default max tokens per request."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Default sampling temperature."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Default nucleus sampling."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Default top-k sampling."),
    min_p: float = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Default min-p sampling."),
    thinking: bool = typer.Option(True, "--thinking/--no-thinking", help="Default chat mode."),
    effort: str = typer.Option(chat.DEFAULT_EFFORT, "--effort", help="Default reasoning effort."),
    decode_concurrency: int = typer.Option(32, "--decode-concurrency", min=1, help="Requests decoded together."),
    prompt_concurrency: int = typer.Option(8, "--prompt-concurrency", min=1, help="Prompts prefilled together."),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", min=1, help="Prefill chunk size."),
    prompt_cache_size: int = typer.Option(10, "--prompt-cache-size", min=0, help="Cached conversations."),
    attention: Attention = typer.Option(Attention.auto, "--attention", help="Sparse-attention variant (GPU)."),
    engram_mode: str = typer.Option(None, "--engram-mode", help="Engram row reads: pread, mmap, ram, auto."),
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
    draft: str = typer.Option(None, "--draft", help="DSpark drafts per main forward for requests "
                              "without num_draft_tokens: default the whole block, 'auto', or 0 (off)."),
):
    from .demo import DemoError
    from .kernels import sparse_attention

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        sparse_attention.set_default_variant(attention.value)
        effort_value = chat.parse_effort(effort)
        draft_value = parse_draft(draft)
        path = resolve_model(model, demo)
        if demo:
            print(f"NOTE: serving the demo checkpoint ({path}): SYNTHETIC RANDOM WEIGHTS, meaningless text.",
                  file=sys.stderr, flush=True)
        loaded, tokenizer, cluster = load_for_generation(path, engram_mode=engram_mode, draft=draft_value)
        if cluster is not None:
            raise CLIError("the server runs as one process; use mlx_dsv41.generate under mlx.launch")
        check_draft(loaded, draft_value)
        if not loaded.mtp and draft_value != 0:
            print(f"NOTE: no DSpark speculative decoding: {loaded.dspark_unavailable}", file=sys.stderr,
                  flush=True)
    except (CLIError, DemoError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1)
    name = "mlx_dsv41-demo" if demo else Path(path).name
    # A request without num_draft_tokens gets this default, which stands for --draft (auto included).
    block = loaded.args.dspark_block_size if loaded.mtp else 0
    default = block if draft_value in (None, "auto") else draft_value
    cli_args = server_args(model=str(path), temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                           max_tokens=max_tokens, decode_concurrency=decode_concurrency,
                           prompt_concurrency=prompt_concurrency, prefill_step_size=prefill_step_size,
                           prompt_cache_size=prompt_cache_size, num_draft_tokens=default,
                           dspark_draft=draft_value)
    serve(loaded, tokenizer, name, cli_args, host, port, thinking=thinking, effort=effort_value)


def main() -> None:
    # transformers warns that a tokenizer-only load sees a "deepseek_v41" config: noise here.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    app()


if __name__ == "__main__":
    main()
