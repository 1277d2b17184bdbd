"""`python -m mlx_dsv41.server`: mlx-lm's OpenAI-compatible HTTP server, serving our model.

    python -m mlx_dsv41.server --demo                      # http://127.0.0.1:8080
    python -m mlx_dsv41.server --model ~/models/dsv41-mlx --port 8000 --thinking --effort max

Endpoints are mlx-lm's (`POST /v1/chat/completions`, `POST /v1/completions`, `GET /health`,
`GET /v1/models`), plus `GET /v1/stats` (Engram reads, attention calls, DSpark forwards and
acceptance, generations stopped by a client disconnect). What changes, by subclassing mlx-lm's
classes: the HTTP side in `server_http.py` (OpenAI's error shape, whole-request checks, chat
options, disconnects), the generation side in `server_generation.py` (our chat encoding, one
preloaded model, a safe prompt cache, time-sliced prefill, DSpark drafting beside the batch in
`server_dspark.py`, a generation thread that restarts).

- Chat mode by default, so OpenAI clients get the answer in `content`; a request's
  `reasoning_effort` (minimal / low / medium / high / max / 1..100; "none": chat mode) turns
  thinking mode on, with the reasoning in the `reasoning` field; `chat_template_kwargs:
  {"thinking": bool}` chooses explicitly; --thinking / --effort set the server's defaults.
- One model: loaded (and checked) before the server starts; a request's "model" must name it
  (mlx-lm would load any path or repo).
- DSpark speculative decoding (mlx_dsv41.speculative) per request when the checkpoint has the
  draft head: a request's `num_draft_tokens` (mlx-lm's field; default --draft, the whole block)
  sets the drafts verified per main forward, 0 turns it off. Speculation is batch-1: drafting
  requests run one sequence at a time beside mlx-lm's batch, a unit (a prefill chunk or a
  draft-and-verify round) each in turn between the batch's steps; the others, and those with
  logits processors or XTC, are batched by mlx-lm. Greedy replies are the same either way.
- Long prompts do not block: prefill runs in chunks of at most --prefill-slice seconds between the
  other requests' decode steps (drafting or not), and a client that goes away stops its request,
  also mid-prefill.
It binds 127.0.0.1 unless --host says otherwise; like mlx-lm's, it is not hardened for the open
internet.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import typer

from mlx_dsv41 import chat
from mlx_dsv41.generate import (
    DEMO_MAX_TOKENS,
    ENGRAM_MODE,
    Attention,
    CLIError,
    check_draft,
    load_for_generation,
    parse_draft,
    resolve_model,
)

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Serve DeepSeek-V4.1 over mlx-lm's OpenAI-compatible HTTP API.",
)

PREFILL_SLICE_S = 0.5  # seconds (server_generation.SlicedBatchGenerator)
DEFAULT_MAX_TOKENS = 512


def server_args(**overrides) -> argparse.Namespace:
    """The settings mlx-lm's server classes read (their defaults), with ours on top."""
    args = dict(
        model=None,
        adapter_path=None,
        draft_model=None,
        num_draft_tokens=3,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        chat_template_args={},
        allowed_origins=["*"],
        temp=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=512,
        decode_concurrency=32,
        prompt_concurrency=8,
        prefill_step_size=2048,
        prompt_cache_size=10,
        prompt_cache_bytes=None,
        kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=5000,
        pipeline=False,
        dspark_draft=None,  # ours: --draft for requests that do not set num_draft_tokens
    )
    unknown = set(overrides) - set(args)
    if unknown:
        raise TypeError(f"server_args: unknown settings {sorted(unknown)}")
    return argparse.Namespace(**{**args, **overrides})


def serve(
    model,
    tokenizer,
    name: str,
    cli_args: argparse.Namespace,
    host: str,
    port: int,
    thinking: bool = False,
    effort: int = chat.EFFORT_NAMES[chat.DEFAULT_EFFORT],
    prefill_slice: float = PREFILL_SLICE_S,
    also_named: tuple = (),
) -> None:
    """Serve until interrupted (blocks). Requests may name the model `name`, its path
    (cli_args.model) or any of `also_named`."""
    from mlx_lm import server

    from mlx_dsv41.server_generation import (
        ModelProvider,
        PromptCache,
        ResponseGenerator,
        use_dspark,
        use_sliced_prefill,
    )
    from mlx_dsv41.server_http import APIHandler, HTTPServer

    APIHandler.defaults = {"thinking": thinking, "effort": effort}
    APIHandler.model_names = (*also_named, *([cli_args.model] if cli_args.model else []))
    use_sliced_prefill(prefill_slice)
    provider = ModelProvider(cli_args, model, tokenizer, name)
    generator = ResponseGenerator(provider, PromptCache(cli_args.prompt_cache_size))
    use_dspark(generator)
    server._run_http_server(host, port, generator, server_class=HTTPServer, handler_class=APIHandler)


# long: a typer command: its signature is the server's option table
@app.command()
def main_command(
    model: str = typer.Option(None, "--model", "-m", help="Converted checkpoint directory or HF repo id."),
    demo: bool = typer.Option(False, "--demo", help="Serve the built-in demo checkpoint (synthetic weights)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: local only)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port (0: any free port)."),
    max_tokens: int = typer.Option(
        None,
        "--max-tokens",
        min=1,
        help=f"Default max tokens per request ({DEFAULT_MAX_TOKENS}; with --demo {DEMO_MAX_TOKENS}).",
    ),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Default sampling temperature."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Default nucleus sampling."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Default top-k sampling."),
    min_p: float = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Default min-p sampling."),
    thinking: bool = typer.Option(
        False,
        "--thinking/--no-thinking",
        help="Thinking mode for requests that do not choose (default: chat mode; reasoning_effort asks for thinking).",
    ),
    effort: str = typer.Option(
        chat.DEFAULT_EFFORT,
        "--effort",
        help="Reasoning effort for thinking-mode "
        "requests that do not give one: 1..100 or minimal, low, medium, high, max.",
    ),
    decode_concurrency: int = typer.Option(32, "--decode-concurrency", min=1, help="Requests decoded together."),
    prompt_concurrency: int = typer.Option(8, "--prompt-concurrency", min=1, help="Prompts prefilled together."),
    prefill_step_size: int = typer.Option(
        2048, "--prefill-step-size", min=1, help="Most prompt tokens per prefill chunk."
    ),
    prefill_slice: float = typer.Option(
        PREFILL_SLICE_S,
        "--prefill-slice",
        min=0.0,
        help="Prefill chunks also take at most about this many seconds (0: tokens only).",
    ),
    prompt_cache_size: int = typer.Option(10, "--prompt-cache-size", min=0, help="Cached conversations."),
    attention: Attention = typer.Option(Attention.auto, "--attention", help="Sparse-attention variant (GPU)."),
    engram_mode: str = ENGRAM_MODE,
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
    draft: str = typer.Option(
        None,
        "--draft",
        help="DSpark drafts per main forward for requests "
        "without num_draft_tokens: default the whole block, 'auto', or 0 (off).",
    ),
    warmup: int = typer.Option(
        0,
        "--warmup",
        min=0,
        help="Before listening, generate once from a random prompt of this many tokens, so that the "
        "first request does not wait for kernel compiles (0: off; see mlx_dsv41.warmup).",
    ),
):
    from mlx_dsv41.demo import DemoError
    from mlx_dsv41.kernels import sparse_attention

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO), format="%(asctime)s - %(levelname)s - %(message)s"
    )
    try:
        sparse_attention.set_default_variant(attention.value)
        effort_value = chat.parse_effort(effort)
        draft_value = parse_draft(draft)
        path = resolve_model(model, demo)
        if demo:
            print(
                f"NOTE: serving the demo checkpoint ({path}): SYNTHETIC RANDOM WEIGHTS, meaningless text.",
                file=sys.stderr,
                flush=True,
            )
        loaded, tokenizer, cluster = load_for_generation(path, engram_mode=engram_mode, draft=draft_value)
        if cluster is not None:
            raise CLIError("the server runs as one process; use mlx_dsv41.generate under mlx.launch")
        check_draft(loaded, draft_value)
        if not loaded.mtp and draft_value != 0:
            print(f"NOTE: no DSpark speculative decoding: {loaded.dspark_unavailable}", file=sys.stderr, flush=True)
        if warmup:
            from mlx_dsv41.warmup import warm_up

            first, total = warm_up(loaded, tokenizer, warmup, prefill_step_size, draft_value)
            print(
                f"Warmed up for prompts of {warmup} tokens in {total:.1f} s (first token after {first:.2f} s)",
                file=sys.stderr,
                flush=True,
            )
    except (CLIError, DemoError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    name = "mlx_dsv41-demo" if demo else Path(path).name
    # A request without num_draft_tokens gets this default, which stands for --draft (auto included).
    block = loaded.args.dspark_block_size if loaded.mtp else 0
    default_draft = block if draft_value in (None, "auto") else draft_value
    cli_args = server_args(
        model=str(path),
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens or (DEMO_MAX_TOKENS if demo else DEFAULT_MAX_TOKENS),
        decode_concurrency=decode_concurrency,
        prompt_concurrency=prompt_concurrency,
        prefill_step_size=prefill_step_size,
        prompt_cache_size=prompt_cache_size,
        num_draft_tokens=default_draft,
        dspark_draft=draft_value,
    )
    serve(
        loaded,
        tokenizer,
        name,
        cli_args,
        host,
        port,
        thinking=thinking,
        effort=effort_value,
        prefill_slice=prefill_slice,
        also_named=(model,) if model else (),
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
