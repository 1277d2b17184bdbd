"""The server's HTTP side: a subclass of mlx-lm's request handler (mlx_lm.server.APIHandler).
Imported by `mlx_dsv41.server` when it serves (importing mlx-lm is slow).

- Every error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so OpenAI
  clients show the message (mlx-lm answers `{"error": "<text>"}`). Bad JSON, unknown paths and
  every refused request are answered here; failures inside mlx-lm's code are turned into
  `RequestError`s before mlx-lm would answer them.
- A request is checked whole before anything is queued: the messages and the chat options,
  `model` (only the served model), `n` (1), `response_format` (text), and `max_tokens` against the
  model's context; what the server cannot honour is a 400 naming the field.
- Chat options: `reasoning_effort` (OpenAI's minimal / low / medium / high or none, the official
  max, or 1..100) asks for thinking mode; `chat_template_kwargs: {"thinking": bool}` chooses it.
- A client that goes away stops its request, also while its prompt is prefilled (the connection
  is checked at every prefill chunk and before every token; mlx-lm only notices a failed write).
"""

from __future__ import annotations

import io
import json
import logging
import select
import socket
import sys

from mlx_lm import server

from mlx_dsv41 import chat
from mlx_dsv41.generate import engram_totals

POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 411: "invalid_request_error"}
# mlx-lm's validation messages start with its attribute's name; these differ from the request's key.
PARAM_OF_ATTRIBUTE = {"requested_model": "model", "adapter": "adapters"}


class RequestError(BaseException):
    """A request answered with an error. A BaseException, so that mlx-lm's `except Exception`
    handlers (which would answer `{"error": "<text>"}`) let it through to `APIHandler.do_POST`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


class ClientGone(Exception):
    """The client closed its connection; its generation has been told to stop."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class APIHandler(server.APIHandler):
    defaults: dict = {}  # {"thinking": bool, "effort": int}: the server's (set by serve)
    model_names: tuple = ()  # what a request's "model" may say besides the served name

    # ---------------------------------------------------------------- errors

    def do_POST(self):
        self._ended = False
        try:
            self._read_body()
            super().do_POST()
        except RequestError as e:
            self._send_error(e)

    def _read_body(self) -> None:
        """The checks mlx-lm's do_POST makes first, answered here; it then reads the body again."""
        if self.path not in POST_PATHS:
            raise RequestError(f"no such endpoint: POST {self.path}", 404)
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("Content-Length header is required", 411)
        try:
            raw = self.rfile.read(int(length))
        except ValueError:
            raise RequestError("Invalid Content-Length header") from None
        try:
            body = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"Invalid JSON in request body: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("Request should be a JSON dictionary")
        self.rfile = io.BytesIO(raw)

    def end_headers(self):
        self._ended = True
        super().end_headers()

    def _send_error(self, e: RequestError) -> None:
        body = error_body(e.status, e.message, e.param, e.code)
        logging.info(f"{self.command} {self.path}: {e.status} {e.message}")
        if self._ended:  # a stream already under way: end it with an error event
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.close_connection = True
            return
        self._headers_buffer = []  # drop a 200 status line mlx-lm may have prepared
        self._json(e.status, body)

    def _json(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # ---------------------------------------------------------------- checks

    def validate_model_parameters(self):
        try:
            super().validate_model_parameters()
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise RequestError(str(e), param=PARAM_OF_ATTRIBUTE.get(name, name)) from None
        body, provider = self.body, self.response_generator.model_provider
        if self.requested_model not in ("default_model", provider.served_name, *self.model_names):
            raise RequestError(
                f"model {self.requested_model!r} is not served here; this server serves "
                f"{provider.served_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if body.get("n") not in (None, 1):
            raise RequestError(
                f"n must be 1: this server returns one choice per request (got {body['n']!r}); send n requests instead",
                param="n",
            )
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise RequestError(
                f"response_format {kind!r} is not supported: the server cannot constrain "
                f"the output (only {{'type': 'text'}})",
                param="response_format",
            )
        if self.adapter is not None:
            raise RequestError("adapters are not supported by this server", param="adapters")
        vocab = len(provider.tokenizer)
        for token in self.logit_bias or {}:
            if not 0 <= token < vocab:
                raise RequestError(
                    f"logit_bias token id {token} is outside the vocabulary (0..{vocab - 1})", param="logit_bias"
                )
        self._check_context(self._prompt_length())

    def _prompt_length(self) -> int:
        """Tokens of the request's prompt (and, for chat, its options checked and kept)."""
        tokenizer = self.response_generator.model_provider.tokenizer
        if self.path == "/v1/completions":
            if not isinstance(self.body.get("prompt"), str):
                raise RequestError("prompt must be a string", param="prompt")
            return len(tokenizer.encode(self.body["prompt"]))
        if "messages" not in self.body:
            raise RequestError("Request did not contain messages", param="messages")
        self.chat_template_kwargs = self._chat_options(self.body)
        try:
            return len(
                chat.encode(
                    tokenizer, self.body["messages"], tools=self.body.get("tools") or None, **self.chat_template_kwargs
                )
            )
        except chat.ChatError as e:
            raise RequestError(str(e), param="messages") from None

    def _check_context(self, prompt: int) -> None:
        context = self.response_generator.model_provider.model.args.max_position_embeddings
        if prompt + self.max_tokens > context:
            raise RequestError(
                f"this model's context is {context} tokens; the request asks for "
                f"{prompt + self.max_tokens} ({prompt} in the prompt, max_tokens "
                f"{self.max_tokens})",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _chat_options(self, body) -> dict:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
        if thinking is not None and not isinstance(thinking, bool):
            raise RequestError("thinking must be true or false", param="chat_template_kwargs")
        effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
        if effort == "none":  # OpenAI's "no reasoning"
            if thinking:
                raise RequestError(
                    "reasoning_effort none asks for no reasoning, but thinking is true", param="reasoning_effort"
                )
            return {"thinking": False, "effort": self.defaults["effort"]}
        if thinking is None:
            thinking = effort is not None or self.defaults["thinking"]
        if not thinking and effort is not None:
            raise RequestError(
                "reasoning_effort needs thinking mode, and chat_template_kwargs says thinking: false",
                param="reasoning_effort",
            )
        try:
            return {
                "thinking": thinking,
                "effort": chat.parse_effort(self.defaults["effort"] if effort is None else effort),
            }
        except chat.ChatError as e:
            raise RequestError(str(e), param="reasoning_effort") from None

    def handle_chat_completions(self):
        self._one_model()
        return super().handle_chat_completions()

    def handle_text_completions(self):
        self._one_model()
        return super().handle_text_completions()

    def _one_model(self):
        """mlx-lm loads whatever "model" names; the request has been checked: ours it is."""
        self.requested_model = self.response_generator.model_provider.served_name
        self.requested_draft_model = "default_model"

    # ---------------------------------------------------------------- generation and disconnects

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def handle_completion(self, request, stop_words):
        generator = self.response_generator
        self.response_generator = WatchedGenerator(generator, self)
        try:
            super().handle_completion(request, stop_words)
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            generator.stopped_by_disconnect += 1
            logging.info(f"{getattr(self, 'request_id', 'request')}: client disconnected; generation stopped")
            self.close_connection = True
        finally:
            self.response_generator = generator

    # ---------------------------------------------------------------- GET

    def do_GET(self):
        self._ended = False
        if self.path == "/v1/stats":
            return self._json(200, self._stats())
        if self.path.startswith("/v1/models"):
            return self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.response_generator.model_provider.served_name,
                            "object": "model",
                            "created": self.created,
                            "owned_by": "mlx_dsv41",
                        }
                    ],
                },
            )
        if self.path == "/health":
            return super().do_GET()
        self._send_error(RequestError(f"no such endpoint: GET {self.path}", 404))

    def _stats(self) -> dict:
        from mlx_dsv41.kernels import sparse_attention

        rows, nbytes = engram_totals(self.response_generator.model_provider.model)
        dspark = self.response_generator.dspark
        return {
            "engram_rows_read": rows,
            "engram_bytes_read": nbytes,
            "attention_calls": sparse_attention.variant_counts(),
            "dspark": {
                "main_forwards": dspark.forwards,
                "tokens": dspark.emitted,
                "acceptance_by_position": dspark.rates(),
            },
            "stopped_by_disconnect": self.response_generator.stopped_by_disconnect,
            "generation_restarts": self.response_generator.restarts,
        }

    def log_message(self, format, *args):
        logging.debug(format % args)


class WatchedGenerator:
    """The response generator as one handler sees it: its connection is checked at every prefill
    progress report and before every token, and a failure becomes a RequestError."""

    def __init__(self, generator, handler: APIHandler):
        self.generator, self.handler = generator, handler

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def generate(self, request, args, progress_callback=None):
        started = {}

        def progress(done, total):  # runs in this handler's thread, after generate returned ctx
            if self.handler._client_gone():
                started["ctx"].stop()
                raise ClientGone()
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, responses = self.generator.generate(request, args, progress_callback=progress)
        except Exception as e:  # noqa: BLE001 (the generation thread's report on this request)
            raise RequestError(str(e), 400 if isinstance(e, ValueError) else 503) from None
        started["ctx"] = ctx
        return ctx, self._watched(ctx, responses)

    def _watched(self, ctx, responses):
        try:
            for response in responses:
                if self.handler._client_gone():
                    ctx.stop()
                    raise ClientGone()
                yield response
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 (the generation failed mid-request)
            raise RequestError(str(e), 500) from None


class HTTPServer(server.ThreadingHTTPServer):
    def server_bind(self):
        super().server_bind()
        host, port = self.server_address[:2]
        print(f"Serving on http://{host}:{port}", file=sys.stderr, flush=True)
