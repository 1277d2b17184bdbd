"""`python -m mlx_dsv41.generate`: stream text from DeepSeek-V4.1 (a converted checkpoint, an HF
repo, an EXL3 / official directory it offers to convert, or the built-in `--demo`).

    python -m mlx_dsv41.generate --demo --prompt "Hello"
    python -m mlx_dsv41.generate --model ~/models/dsv41-mlx --chat --effort max --prompt "Why?"
    echo "text" | python -m mlx_dsv41.generate --model ~/models/dsv41-mlx

When the checkpoint has the DSpark draft head, decoding is speculative (mlx_dsv41.speculative:
the same tokens as plain greedy decoding, or the same distribution when sampling); `--draft 0`
turns it off, `--draft N` verifies N drafts per main forward, `--draft auto` lets the confidence
head choose. Otherwise the loop is mlx-lm's `stream_generate` with its samplers (our model follows
the mlx-lm model contract). Either stops at the end-of-sentence token or after --max-tokens. Text
goes to stdout as it is generated (on a terminal, control characters are escaped and special
tokens dimmed: mlx_dsv41.terminal); notes, the loading bar, a progress line while a long prompt
is prefilled and the end statistics go to stderr. A bad model path, a broken checkpoint or a bad
option is one line on stderr and exit code 1.

`--prompt-cache-file F` saves the prompt's caches to F, or, when F exists, continues the prompt
saved there with this run's prompt (mlx_dsv41.prompt_cache; mlx-lm's file format). A drafting run
saves the draft head's state beside F, and a run continuing F drafts from it; without it (a file
of mlx-lm's `cache_prompt`, or saved with --draft 0) the continuation decodes without drafting
(the same tokens), and says so once.

Under `mlx.launch` (two or more processes), `--moe-partition` splits the routed experts between
the ranks (mlx_dsv41.distributed); every rank computes the same tokens and rank 0 prints.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import typer

from mlx_dsv41 import chat

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Generate text with DeepSeek-V4.1 on MLX.",
)

DEFAULT_MAX_TOKENS = 256
DEMO_MAX_TOKENS = 32  # the demo's text is meaningless: a short first run
LONG_PROMPT = 256  # prompts of at least this many tokens get a prefill progress line


# Sampling options (mlx-lm's samplers), shared by the generate and chat command lines.
TEMP = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0: greedy).")
TOP_P = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling (1: off).")
TOP_K = typer.Option(0, "--top-k", min=0, help="Top-k sampling (0: off).")
MIN_P = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Min-p sampling (0: off).")
SEED = typer.Option(None, "--seed", help="Random seed for sampling.")
ENGRAM_MODE = typer.Option(None, "--engram-mode", help="Engram row reads: pread, mmap, ram or auto (default).")


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


class Attention(str, Enum):
    serial = "serial"
    parallel = "parallel"
    rows = "rows"  # tensor cores, many rows (CUDA, bf16); other calls run serial
    auto = "auto"


class Partition(str, Enum):
    experts = "experts"
    slots = "slots"


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the model


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def fetch_repo(repo_id: str) -> Path:
    """A Hugging Face repo id -> its local snapshot (downloaded when online)."""
    from huggingface_hub import snapshot_download

    _note(f"Fetching {repo_id} from the Hugging Face Hub ...")
    try:
        return Path(snapshot_download(repo_id))
    except Exception as e:  # offline, unknown repo, gated repo, network error: all one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(
            f"cannot fetch {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: "
            f"{reason}); if you are offline, pass a local directory to --model"
        ) from None


def convert_source(
    src: Path,
    kind: str,
    convert_to: Path | None,
    engram_from: Path | None,
    interactive: bool,
    dspark_from: Path | None = None,
) -> Path:
    """An EXL3 / official checkpoint -> a converted directory (after the user agrees)."""
    from mlx_dsv41.convert import convert_checkpoint

    how = f"python -m mlx_dsv41.convert {src} OUT" + (
        " --engram-from OFFICIAL_DIR" if kind == "exl3" and engram_from is None else ""
    )
    if convert_to is None:
        if not interactive:
            raise CLIError(
                f"{src} is an {kind} checkpoint, not a converted one: convert it first ({how}) or pass --convert-to OUT"
            )
        convert_to = src.with_name(src.name + "-mlx")
        if not typer.confirm(
            f"{src} is an {kind} checkpoint. Convert it to {convert_to} now?", default=False, err=True
        ):
            raise CLIError(f"not converted; convert it with: {how}")
    _note(f"Converting {src} -> {convert_to} ...")
    return Path(convert_checkpoint(src, convert_to, engram_from=engram_from, progress=True, dspark_from=dspark_from))


def resolve_model(
    model: str | None,
    demo: bool,
    convert_to: Path | None = None,
    engram_from: Path | None = None,
    interactive: bool = False,
    dspark_from: Path | None = None,
) -> Path:
    """The converted directory to load for these options."""
    from mlx_dsv41.loading import checkpoint_kind

    if demo and model:
        raise CLIError("give either --model or --demo, not both")
    if demo:
        from mlx_dsv41.demo import ensure_demo

        return ensure_demo(progress=True)
    if not model:
        raise CLIError(
            "no model: pass --model DIR (a converted checkpoint) or --demo "
            "(a small synthetic checkpoint built on first use)"
        )
    path = Path(model).expanduser()
    if not path.exists():
        if _REPO_ID.fullmatch(model) and not model.startswith((".", "/", "~")):
            path = fetch_repo(model)
        else:
            raise CLIError(f"--model {model}: no such directory")
    if not path.is_dir():
        raise CLIError(f"--model {model}: not a directory")
    kind = checkpoint_kind(path)
    if kind == "converted":
        return path
    return convert_source(path, kind, convert_to, engram_from, interactive, dspark_from)


def materialize(model, show: bool) -> None:
    """Read every weight now, layer by layer, with a progress bar (the load itself is lazy)."""
    import mlx.core as mx

    if not show:
        mx.eval(model.parameters())
        return
    parts = [model.embed, *model.layers, *model.mtp, model.norm, model.head]
    with typer.progressbar(parts, label="Loading weights", file=sys.stderr, show_eta=False) as bar:
        for part in bar:
            mx.eval(part.parameters())


def load_for_generation(
    path: Path,
    *,
    partition: str = "experts",
    engram_mode: str | None = None,
    show_progress: bool = True,
    draft: int | str | None = None,
):
    """(model, tokenizer, cluster): under mlx.launch with several ranks, only this rank's experts
    are loaded (cluster None in one process); with draft 0 the DSpark head is not loaded. Any
    failure is one CLIError line."""
    import mlx_dsv41
    from mlx_dsv41 import distributed
    from mlx_dsv41.config import ModelArgs

    try:
        cluster = distributed.init(partition)
        expert_range = None
        if cluster is not None:
            n_experts = ModelArgs.from_file(path / "config.json").n_routed_experts
            expert_range = distributed.expert_range(cluster, n_experts)
        model, tokenizer = mlx_dsv41.load(path, lazy=True, engram_mode=engram_mode, expert_range=expert_range)
        if draft == 0 and model.mtp:
            model.drop_dspark("turned off (--draft 0)")
        materialize(model, show_progress and (cluster is None or cluster.rank == 0))
        distributed.apply(model, cluster)
        tokenizer.add_eos_token(chat.EOS)  # stop at the end-of-sentence token whatever the files say
    except Exception as e:  # a broken checkpoint: one line, whatever raised it
        raise CLIError(f"cannot load {path}: {' '.join(str(e).split())}") from None
    return model, tokenizer, cluster


# ------------------------------------------------------------------------------ the prompt


def read_prompt(prompt: str | None, prompt_file: Path | None) -> tuple[str, bool]:
    """(prompt text, whether it came from stdin)."""
    if prompt is not None and prompt_file is not None:
        raise CLIError("give either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8"), False
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--prompt-file {prompt_file}: {e}") from None
    if prompt is not None and prompt != "-":
        return prompt, False
    if prompt is None and sys.stdin.isatty():
        raise CLIError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe text on stdin")
    return sys.stdin.read(), True


def chat_settings(chat_mode: bool, thinking: bool | None, effort: str | None, system: str | None) -> tuple[bool, int]:
    """(thinking, effort) of a --chat prompt; the chat-only options without --chat are errors."""
    if not chat_mode:
        for given, name in ((system, "--system"), (effort, "--effort"), (thinking, "--thinking/--no-thinking")):
            if given is not None:
                raise CLIError(f"{name} needs --chat")
        return True, chat.parse_effort(chat.DEFAULT_EFFORT)
    if thinking is False and effort is not None:
        raise CLIError("--effort needs thinking mode (chat mode renders no effort): drop --no-thinking")
    return thinking is not False, chat.parse_effort(chat.DEFAULT_EFFORT if effort is None else effort)


def prompt_tokens(
    tokenizer, text: str, *, chat_mode: bool, thinking: bool, effort: int | str, system: str | None
) -> list[int]:
    """Chat: the official encoding of [system], user. Plain: the text as mlx-lm tokenizes it."""
    if chat_mode:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return chat.encode(tokenizer, messages, thinking=thinking, effort=effort)
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))


class PrefillProgress:
    """mlx-lm's prompt-progress callback: `Prefilling N tokens: k/N` on stderr for a prompt of at
    least LONG_PROMPT tokens (rewritten in place on a terminal, a line per chunk otherwise)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if total < LONG_PROMPT or (done == total and not self.tty):
            return
        start, end = ("\r", "\n" if done == total else "") if self.tty else ("", "\n")
        self.stream.write(f"{start}Prefilling {total} tokens: {done}/{total}{end}")
        self.stream.flush()


# ------------------------------------------------------------------------------ prompt-cache files


@dataclass
class PromptStart:
    """Where generation starts: the tokens still to feed, after the `cached` ones that `cache` (and,
    when drafting, `draft_cache`) hold already; `drafts` says whether this run may draft."""

    tokens: list[int]
    drafts: bool
    cache: list | None = None
    draft_cache: object | None = None
    cached: int = 0


def start_cache_file(
    model,
    path: Path,
    file: Path,
    tokens: list[int],
    *,
    chat_mode: bool,
    thinking: bool,
    effort: int,
    step: int,
    drafts: bool,
) -> PromptStart:
    """Prefill the prompt's reusable part (a chat prompt less its answer header), save its caches to
    `file` (drafting, the draft head's state too, beside it)."""
    from mlx_dsv41 import prompt_cache
    from mlx_dsv41.speculative import feed

    prefix = tokens[:-2] if chat_mode else tokens
    cache = model.make_cache()
    draft_cache = model.make_draft_cache() if drafts else None
    held = prefix[:-1]  # the last token is fed by the generation, which needs one
    progress = PrefillProgress()
    feed(model, cache, held, draft_cache=draft_cache, step=step, progress=lambda done: progress(done, len(held)))
    prompt_cache.save(
        file, cache, prefix, path, {"thinking": thinking, "effort": effort} if chat_mode else None, draft_cache
    )
    _note(f"Saved the prompt's cache ({len(prefix)} tokens) to {file}")
    return PromptStart(tokens[len(held) :], drafts, cache, draft_cache, len(held))


def check_saved_prompt(
    saved, file: Path, *, chat_mode: bool, thinking: bool | None, effort: str | None, system: str | None
) -> None:
    """This run's options must fit the prompt saved in `file` (checked before the model loads)."""
    if system is not None:
        raise CLIError(f"--system: the prompt saved in {file} already has its start; drop --system")
    if saved.tokens is not None and chat_mode != (saved.chat is not None):
        raise CLIError(
            f"{file} holds a {'chat' if saved.chat else 'plain'} prompt: {'add' if saved.chat else 'drop'} --chat"
        )
    mode = (saved.chat or {}) if chat_mode else {}
    if thinking is not None and "thinking" in mode and thinking != mode["thinking"]:
        raise CLIError(
            f"{file} holds a prompt in {'thinking' if mode['thinking'] else 'chat'} mode; drop --thinking/--no-thinking"
        )
    if effort is not None and "effort" in mode and chat.parse_effort(effort) != mode["effort"]:
        raise CLIError(f"{file} holds a prompt with reasoning effort {mode['effort']}; drop --effort")


def continue_saved_prompt(
    saved, tokenizer, file: Path, text: str, *, chat_mode: bool, thinking: bool | None, drafts: bool
) -> PromptStart:
    """The saved prompt continued with `text` (a chat prompt's open user turn, or plain text);
    drafting needs the draft head's state saved beside the file (else a note, and no drafting)."""
    if chat_mode:
        on = (saved.chat or {}).get("thinking", thinking is not False)
        new = chat.encode_continuation(tokenizer, text, thinking=on)
    else:
        new = tokenizer.encode(text, add_special_tokens=False)
    feed = saved.pending() + new
    if not feed:
        raise CLIError("the prompt is empty: nothing to continue the saved prompt with")
    _note(f"Continuing the {saved.cached + len(saved.pending())}-token prompt saved in {file}")
    if drafts and saved.draft_cache is None:
        from mlx_dsv41.prompt_cache import draft_file

        _note(
            f"NOTE: no DSpark speculative decoding for this prompt: there is no {draft_file(file).name} "
            f"beside {file.name} (the draft head's state, saved by a drafting run); the tokens are the same"
        )
        drafts = False
    return PromptStart(feed, drafts, saved.cache, saved.draft_cache if drafts else None, saved.cached)


# ------------------------------------------------------------------------------ generation


def engram_totals(model) -> tuple[int, int]:
    """(rows, bytes) read from the Engram row sources so far."""
    sources = getattr(model, "engram_sources", {}) or {}
    return (sum(s.stats.rows for s in sources.values()), sum(s.stats.bytes for s in sources.values()))


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def statistics(
    last, engram: tuple[int, int], attention: dict[str, int], cached: int = 0, dspark: str | None = None
) -> str:
    rows, nbytes = engram
    ran = ", ".join(f"{k} {v}" for k, v in attention.items() if v) or "none"
    reused = f" (after {cached} from the prompt cache)" if cached else ""
    return "\n".join(
        [
            "=" * 10,
            f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec{reused}",
            f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
            f"Peak memory: {last.peak_memory:.3f} GB",
            f"Engram: {rows} rows, {_bytes(nbytes)} read",
            f"Attention: {ran} calls",
        ]
        + ([dspark] if dspark else [])
    )


def parse_draft(value: str | None) -> int | str | None:
    """--draft: None (whole blocks), 0 (off), a number of drafts, or "auto"."""
    from mlx_dsv41.speculative import AUTO

    if value is None or value == AUTO:
        return value
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise CLIError(f"--draft {value}: expected a number of drafts (0: off) or {AUTO!r}")
    return number


def check_draft(model, draft: int | str | None) -> None:
    block = model.args.dspark_block_size
    if model.mtp and isinstance(draft, int) and draft > block:
        raise CLIError(f"--draft {draft}: this checkpoint drafts at most {block} tokens (dspark_block_size)")


def run(
    model,
    tokenizer,
    tokens: list[int],
    *,
    max_tokens: int,
    sampling,
    write,
    draft: int | str | None = None,
    stats=None,
    prompt_cache=None,
    draft_cache=None,
    prefill_step_size: int = 2048,
) -> object:
    """Stream the completion through `write(text, token)`; returns the last GenerationResponse.
    DSpark drafts when the model has its weights and draft is not 0 (`stats`: a DraftStats to
    fill); `prompt_cache` (and `draft_cache`) may hold the prompt's start; long prompts report
    their prefill."""
    from mlx_dsv41.speculative import stream_generate

    last = None
    for last in stream_generate(
        model,
        tokenizer,
        tokens,
        max_tokens,
        draft=draft,
        sampling=sampling,
        stats=stats,
        prompt_cache=prompt_cache,
        draft_cache=draft_cache,
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=PrefillProgress(),
    ):
        write(last.text, last.token)
    return last


def context_limit(max_tokens: int, context: int, max_kv_size: int | None) -> int:
    """--max-tokens within --max-kv-size: our caches cannot rotate (dropping old entries would change
    what the model computes), so --max-kv-size bounds the context (prompt + generated) instead."""
    if max_kv_size is None:
        return max_tokens
    if context >= max_kv_size:
        raise CLIError(f"--max-kv-size {max_kv_size}: the prompt alone is {context} tokens")
    if context + max_tokens > max_kv_size:
        _note(f"NOTE: generating at most {max_kv_size - context} tokens (--max-kv-size {max_kv_size})")
    return min(max_tokens, max_kv_size - context)


# long: a typer command: its signature is the option table; its body reads setup, one run, the report
@app.command()
def generate(
    model: str = typer.Option(
        None,
        "--model",
        "-m",
        help="Converted checkpoint directory, an HF repo id, or an EXL3 / official directory (offered for conversion).",
    ),
    demo: bool = typer.Option(
        False, "--demo", help="Use the built-in demo checkpoint (synthetic weights, real formats; built on first use)."
    ),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text ('-': read stdin)."),
    prompt_file: Path = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    chat_mode: bool = typer.Option(
        False, "--chat", help="Wrap the prompt in the DeepSeek-V4.1 chat encoding (one user turn)."
    ),
    thinking: bool | None = typer.Option(
        None, "--thinking/--no-thinking", help="Chat: thinking mode (the default) or chat mode."
    ),
    effort: str = typer.Option(
        None,
        "--effort",
        help="Chat, thinking mode: reasoning effort 1..100 or "
        "minimal (25), low (50), medium (62), high (75, the default), max (100).",
    ),
    system: str = typer.Option(None, "--system", help="Chat: a system message."),
    max_tokens: int = typer.Option(
        None,
        "--max-tokens",
        min=1,
        help=f"Most tokens to generate (default {DEFAULT_MAX_TOKENS}, with --demo {DEMO_MAX_TOKENS}).",
    ),
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: int = SEED,
    prompt_cache_file: Path = typer.Option(
        None,
        "--prompt-cache-file",
        help="Save the prompt's caches here; if the file exists, continue the prompt saved in it.",
    ),
    max_kv_size: int = typer.Option(
        None,
        "--max-kv-size",
        min=1,
        help="Most tokens the caches may hold (prompt + generated); generation stops there.",
    ),
    prefill_step_size: int = typer.Option(
        2048, "--prefill-step-size", min=1, help="Prompt tokens per forward pass while prefilling."
    ),
    attention: Attention = typer.Option(
        Attention.auto, "--attention", help="Sparse-attention kernel variant on a GPU (the CPU runs the reference)."
    ),
    moe_partition: Partition = typer.Option(
        Partition.experts, "--moe-partition", help="Under mlx.launch: split routed experts by range or by slot."
    ),
    engram_mode: str = ENGRAM_MODE,
    convert_to: Path = typer.Option(
        None, "--convert-to", help="Convert an EXL3 / official --model into this directory without asking."
    ),
    engram_from: Path = typer.Option(
        None, "--engram-from", help="With a conversion: the official release directory holding the Engram tables."
    ),
    dspark_from: Path = typer.Option(
        None,
        "--dspark-from",
        help="With a conversion: the official release directory holding the DSpark draft head (mtp.*).",
    ),
    draft: str = typer.Option(
        None,
        "--draft",
        help="DSpark speculative decoding: drafts verified per "
        "main forward (default: the whole block), 'auto' (the confidence head "
        "chooses) or 0 (off).",
    ),
):
    import mlx.core as mx

    from mlx_dsv41 import prompt_cache
    from mlx_dsv41.demo import DemoError
    from mlx_dsv41.kernels import sparse_attention
    from mlx_dsv41.speculative import DraftStats, Sampling
    from mlx_dsv41.terminal import TokenWriter

    try:
        sparse_attention.set_default_variant(attention.value)
        thinking_on, effort_value = chat_settings(chat_mode, thinking, effort, system)
        text, from_stdin = read_prompt(prompt, prompt_file)
        draft_value = parse_draft(draft)
        path = resolve_model(
            model,
            demo,
            convert_to,
            engram_from,
            interactive=sys.stdin.isatty() and not from_stdin,
            dspark_from=dspark_from,
        )
        saved = None
        if prompt_cache_file is not None and prompt_cache_file.exists():
            saved = prompt_cache.read(prompt_cache_file, path)
            check_saved_prompt(
                saved, prompt_cache_file, chat_mode=chat_mode, thinking=thinking, effort=effort, system=system
            )
        model_obj, tokenizer, cluster = load_for_generation(
            path, partition=moe_partition.value, engram_mode=engram_mode, draft=draft_value
        )
        check_draft(model_obj, draft_value)
        if cluster is not None and prompt_cache_file is not None:
            raise CLIError("--prompt-cache-file: not under mlx.launch (each rank holds other experts)")
        drafts = bool(model_obj.mtp) and draft_value != 0
        if saved is not None:
            prompt_cache.check_fits(saved, prompt_cache_file, model_obj)
            start = continue_saved_prompt(
                saved, tokenizer, prompt_cache_file, text, chat_mode=chat_mode, thinking=thinking, drafts=drafts
            )
        else:
            tokens = prompt_tokens(
                tokenizer, text, chat_mode=chat_mode, thinking=thinking_on, effort=effort_value, system=system
            )
            start = PromptStart(tokens, drafts)
            if prompt_cache_file is not None:
                start = start_cache_file(
                    model_obj,
                    path,
                    prompt_cache_file,
                    tokens,
                    chat_mode=chat_mode,
                    thinking=thinking_on,
                    effort=effort_value,
                    step=prefill_step_size,
                    drafts=drafts,
                )
        default_tokens = DEMO_MAX_TOKENS if demo else DEFAULT_MAX_TOKENS
        max_tokens = context_limit(max_tokens or default_tokens, start.cached + len(start.tokens), max_kv_size)
    except (CLIError, DemoError, prompt_cache.PromptCacheError, ValueError) as e:
        _note(f"error: {e}")
        raise typer.Exit(1) from None

    rank0 = cluster is None or cluster.rank == 0
    if demo and rank0:
        _note(
            f"NOTE: --demo uses a small checkpoint with SYNTHETIC RANDOM WEIGHTS ({path}): it runs "
            f"the real path (EXL3 + Engram formats, convert, lazy load, SSD Engram), but its text "
            f"is meaningless."
        )
    if rank0 and not model_obj.mtp and draft_value != 0:
        _note(f"NOTE: no DSpark speculative decoding: {model_obj.dspark_unavailable}")
    if seed is not None:
        mx.random.seed(seed)
    elif cluster is not None:  # every rank must draw the same samples
        mx.random.seed(mx.distributed.all_sum(mx.random.state[0], group=cluster.group).view(mx.uint64).item())
    sparse_attention.reset_variant_counts()

    writer = TokenWriter(sys.stdout, chat.special_token_ids(tokenizer))
    stats = DraftStats() if start.drafts else None
    last = run(
        model_obj,
        tokenizer,
        start.tokens,
        max_tokens=max_tokens,
        sampling=Sampling(temp, top_p, top_k, min_p),
        write=writer.write if rank0 else lambda text, token: None,
        draft=draft_value if start.drafts else 0,
        stats=stats,
        prompt_cache=start.cache,
        draft_cache=start.draft_cache,
        prefill_step_size=prefill_step_size,
    )
    if rank0:
        print(flush=True)
        dspark = None if stats is None else stats.line() + (" (meaningless: synthetic weights)" if demo else "")
        _note(statistics(last, engram_totals(model_obj), sparse_attention.variant_counts(), start.cached, dspark))
        if demo:
            _note(
                "NOTE: the demo's weights are synthetic: the text above is meaningless by design"
                + (", and so is the DSpark acceptance rate." if stats is not None else ".")
            )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
