"""`python -m mlx_dsv41.chat`: a multi-turn chat with DeepSeek-V4.1 in the terminal.

    python -m mlx_dsv41.chat --demo
    python -m mlx_dsv41.chat --model ~/models/dsv41-mlx --effort max --system "Be brief."

Every turn renders the whole conversation with the official encoding (mlx_dsv41.chat.encoding)
and prefills only what the previous turn's prompt did not contain. The conversation's caches are
kept as they were just before the previous answer's header token (`<think>` / `</think>`): from
there on the next rendering differs (drop_thinking leaves the previous reasoning out of the
history, so the previous answer is read again after `</think>`). A change of effort or thinking
mode changes the first message, so the next turn is prefilled from the start.

Reasoning is shown dimmed on a terminal (between `<think>` and `</think>` otherwise), or hidden
with --hide-thinking. Commands: /reset, /effort VALUE, /thinking on|off, /help, /quit (or EOF).
Per-turn statistics go to stderr.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import typer

from mlx_dsv41.chat import encoding as chat
from mlx_dsv41.generate import (
    DEMO_MAX_TOKENS,
    ENGRAM_MODE,
    MIN_P,
    SEED,
    TEMP,
    TOP_K,
    TOP_P,
    CLIError,
    PrefillProgress,
    load_for_generation,
    resolve_model,
)
from mlx_dsv41.terminal import TokenWriter, dim

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Chat with DeepSeek-V4.1 in the terminal.",
)

DEFAULT_MAX_TOKENS = 1024
HELP = """commands:
  /reset            forget the conversation (the system message stays)
  /effort VALUE     reasoning effort 1..100 or minimal, low, medium, high, max
  /thinking on|off  thinking mode or chat mode
  /help             this text
  /quit             leave (so does end of input)"""


class Conversation:
    """The messages so far and the caches of the previous prompt's stable part."""

    def __init__(self, system: str | None, thinking: bool, effort: int):
        self.system, self.thinking, self.effort = system, thinking, effort
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.saved_cache, self.saved_tokens = None, []

    def prompt(self, tokenizer) -> list[int]:
        return chat.encode(tokenizer, self.messages, thinking=self.thinking, effort=self.effort)

    def cache_for(self, model, prompt: list[int]) -> tuple[list, int]:
        """(cache, tokens it holds): the saved caches when they hold a prefix of `prompt`."""
        n = len(self.saved_tokens)
        if self.saved_cache is not None and n < len(prompt) and prompt[:n] == self.saved_tokens:
            return self.saved_cache, n
        return model.make_cache(), 0


class Turn:
    """One reply, streamed: reasoning until `</think>`, then the answer, until EOS or max_tokens."""

    def __init__(self, tokenizer, writer: TokenWriter, thinking: bool, hide_thinking: bool):
        self.ids = chat.control_token_ids(tokenizer)
        self.writer, self.hide = writer, hide_thinking
        self.detokenizers = {"reasoning": tokenizer.detokenizer, "answer": tokenizer.detokenizer}
        self.channel = "reasoning" if thinking else "answer"
        self.generated = 0
        if self.channel == "reasoning":
            self._open_reasoning()

    def _open_reasoning(self) -> None:
        if self.hide:
            return
        self.writer.dimmed = self.writer.tty
        if not self.writer.tty:
            self.writer.write(chat.THINK)

    def _show(self, text: str) -> None:
        if text and not (self.hide and self.channel == "reasoning"):
            self.writer.write(text)

    def add(self, token: int) -> None:
        self.generated += 1
        if token == self.ids[chat.EOS]:
            return
        if token == self.ids[chat.END_THINK] and self.channel == "reasoning":
            self.finish_channel()
            if not self.hide:
                self.writer.dimmed = False
                self.writer.write("\n" if self.writer.tty else chat.END_THINK + "\n")
            self.channel = "answer"
            return
        detok = self.detokenizers[self.channel]
        detok.add_token(token)
        self._show(detok.last_segment)

    def finish_channel(self) -> None:
        detok = self.detokenizers[self.channel]
        detok.finalize()
        self._show(detok.last_segment)

    def message(self) -> dict:
        return {
            "role": "assistant",
            "content": self.detokenizers["answer"].text,
            "reasoning_content": self.detokenizers["reasoning"].text,
        }


def reply(
    model, tokenizer, conv: Conversation, *, max_tokens: int, sampler, writer: TokenWriter, hide_thinking: bool
) -> str:
    """Answer the conversation's last user message; returns the statistics line."""
    from mlx_lm import stream_generate

    prompt = conv.prompt(tokenizer)
    cache, reused = conv.cache_for(model, prompt)
    show_progress = PrefillProgress()

    def progress(done: int, total: int) -> None:
        show_progress(done, total)
        if done == total - 1:  # the cache holds prompt[:-1]: what the next turn can start from
            conv.saved_cache, conv.saved_tokens = copy.deepcopy(cache), prompt[:-1]

    turn = Turn(tokenizer, writer, conv.thinking, hide_thinking)
    start = time.perf_counter()
    for response in stream_generate(
        model,
        tokenizer,
        prompt[reused:],
        max_tokens=max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prompt_progress_callback=progress,
    ):
        turn.add(response.token)
    turn.finish_channel()
    writer.dimmed = False
    writer.write("\n")
    conv.messages.append(turn.message())
    seconds = time.perf_counter() - start
    return (
        f"[{len(prompt)} prompt tokens: {len(prompt) - reused} prefilled, {reused} reused; "
        f"{turn.generated} generated in {seconds:.1f} s]"
    )


def command(line: str, conv: Conversation) -> str | None:
    """Run a /command; returns what to print, or None to quit."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return None
    if name == "/help":
        return HELP
    if name == "/reset":
        conv.reset()
        return "(conversation cleared)"
    if name == "/effort":
        conv.effort = chat.parse_effort(arg)  # ChatError: printed by the loop
        note = "" if conv.thinking else "; it applies in thinking mode (/thinking on)"
        return f"(reasoning effort {conv.effort}{note})"
    if name == "/thinking" and arg in ("on", "off"):
        conv.thinking = arg == "on"
        return f"(thinking mode {arg})"
    return f"(unknown command {line!r}; /help lists them)"


def read_line(interactive: bool) -> str | None:
    try:
        line = input("> ") if interactive else sys.stdin.readline()
    except EOFError:
        return None
    if not interactive and not line:
        return None
    return line.strip()


def loop(model, tokenizer, conv: Conversation, *, max_tokens: int, sampler, hide_thinking: bool) -> None:
    interactive = sys.stdin.isatty()
    writer = TokenWriter(sys.stdout, chat.special_token_ids(tokenizer))
    while (line := read_line(interactive)) is not None:
        if not line:
            continue
        if line.startswith("/"):
            try:
                out = command(line, conv)
            except chat.ChatError as e:
                out = f"(error: {e})"
            if out is None:
                return
            print(dim(out) if writer.tty else out, flush=True)
            continue
        conv.messages.append({"role": "user", "content": line})
        stats = reply(
            model, tokenizer, conv, max_tokens=max_tokens, sampler=sampler, writer=writer, hide_thinking=hide_thinking
        )
        print(dim(stats) if sys.stderr.isatty() else stats, file=sys.stderr, flush=True)


@app.command()
def main_command(
    model: str = typer.Option(None, "--model", "-m", help="Converted checkpoint directory or HF repo id."),
    demo: bool = typer.Option(
        False, "--demo", help="Chat with the built-in demo checkpoint (synthetic weights: meaningless text)."
    ),
    system: str = typer.Option(None, "--system", help="A system message."),
    thinking: bool = typer.Option(True, "--thinking/--no-thinking", help="Thinking mode (the default) or chat mode."),
    effort: str = typer.Option(
        chat.DEFAULT_EFFORT, "--effort", help="Reasoning effort 1..100 or minimal, low, medium, high, max."
    ),
    hide_thinking: bool = typer.Option(False, "--hide-thinking", help="Do not show the reasoning."),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        min=1,
        help=f"Most tokens per reply (default {DEFAULT_MAX_TOKENS}, with --demo {DEMO_MAX_TOKENS}).",
    ),
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: int = SEED,
    engram_mode: str = ENGRAM_MODE,
):
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlx_dsv41.demo import DemoError

    try:
        conv = Conversation(system, thinking, chat.parse_effort(effort))
        path = resolve_model(model, demo)
        # The REPL decodes with mlx-lm's loop (its turns keep mlx-lm caches): the DSpark head stays unread.
        loaded, tokenizer, cluster = load_for_generation(Path(path), engram_mode=engram_mode, draft=0)
        if cluster is not None:
            raise CLIError("the chat runs as one process; use mlx_dsv41.generate under mlx.launch")
    except (CLIError, DemoError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    if demo:
        print(
            f"NOTE: the demo checkpoint ({path}) has SYNTHETIC RANDOM WEIGHTS: its replies are meaningless.",
            file=sys.stderr,
        )
    if seed is not None:
        mx.random.seed(seed)
    print("Chat with DeepSeek-V4.1 (/help for commands, /quit or Ctrl-D to leave).", file=sys.stderr, flush=True)
    try:
        loop(
            loaded,
            tokenizer,
            conv,
            max_tokens=max_tokens or (DEMO_MAX_TOKENS if demo else DEFAULT_MAX_TOKENS),
            sampler=make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k),
            hide_thinking=hide_thinking,
        )
    except KeyboardInterrupt:
        print(file=sys.stderr)


def main() -> None:
    app()
