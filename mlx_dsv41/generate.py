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
goes to stdout as it is generated; notes, the loading bar and the end statistics go to stderr. A
bad model path, a broken checkpoint or a bad option is one line on stderr and exit code 1.

Under `mlx.launch` (two or more processes), `--moe-partition` splits the routed experts between
the ranks (mlx_dsv41.distributed); every rank computes the same tokens and rank 0 prints.
"""

from __future__ import annotations

import os
import re
import sys
from enum import Enum
from pathlib import Path

import typer

from . import chat

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Generate text with DeepSeek-V4.1 on MLX.")


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


class Attention(str, Enum):
    serial = "serial"
    parallel = "parallel"
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
        raise CLIError(f"cannot fetch {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: "
                       f"{reason}); if you are offline, pass a local directory to --model") from None


def convert_source(src: Path, kind: str, convert_to: Path | None, engram_from: Path | None,
                   interactive: bool, dspark_from: Path | None = None) -> Path:
    """An EXL3 / official checkpoint -> a converted directory (after the user agrees)."""
    from convert import convert_checkpoint

    how = (f"python -m mlx_dsv41.convert {src} OUT"
           + (" --engram-from OFFICIAL_DIR" if kind == "exl3" and engram_from is None else ""))
    if convert_to is None:
        if not interactive:
            raise CLIError(f"{src} is an {kind} checkpoint, not a converted one: convert it first "
                           f"({how}) or pass --convert-to OUT")
        convert_to = src.with_name(src.name + "-mlx")
        if not typer.confirm(f"{src} is an {kind} checkpoint. Convert it to {convert_to} now?",
                             default=False, err=True):
            raise CLIError(f"not converted; convert it with: {how}")
    _note(f"Converting {src} -> {convert_to} ...")
    return Path(convert_checkpoint(src, convert_to, engram_from=engram_from, progress=True,
                                   dspark_from=dspark_from))


def resolve_model(model: str | None, demo: bool, convert_to: Path | None = None,
                  engram_from: Path | None = None, interactive: bool = False,
                  dspark_from: Path | None = None) -> Path:
    """The converted directory to load for these options."""
    from .loading import checkpoint_kind

    if demo and model:
        raise CLIError("give either --model or --demo, not both")
    if demo:
        from .demo import ensure_demo

        return ensure_demo(progress=True)
    if not model:
        raise CLIError("no model: pass --model DIR (a converted checkpoint) or --demo "
                       "(a small synthetic checkpoint built on first use)")
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


def load_for_generation(path: Path, *, partition: str = "experts", engram_mode: str | None = None,
                        show_progress: bool = True, draft: int | str | None = None):
    """(model, tokenizer, cluster): under mlx.launch with several ranks, only this rank's experts
    are loaded (cluster None in one process); with draft 0 the DSpark head is not loaded. Any
    failure is one CLIError line."""
    import mlx_dsv41
    from . import distributed
    from .config import ModelArgs

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


def prompt_tokens(tokenizer, text: str, *, chat_mode: bool, thinking: bool, effort: int | str,
                  system: str | None) -> list[int]:
    """Chat: the official encoding of [system], user. Plain: the text as mlx-lm tokenizes it."""
    if chat_mode:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        return chat.encode(tokenizer, messages, thinking=thinking, effort=effort)
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))


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


def statistics(last, engram: tuple[int, int], attention: dict[str, int], dspark: str | None = None) -> str:
    rows, nbytes = engram
    ran = ", ".join(f"{k} {v}" for k, v in attention.items() if v) or "none"
    return "\n".join([
        "=" * 10,
        f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
        f"Peak memory: {last.peak_memory:.3f} GB",
        f"Engram: {rows} rows, {_bytes(nbytes)} read",
        f"Attention: {ran} calls",
    ] + ([dspark] if dspark else []))


def parse_draft(value: str | None) -> int | str | None:
    """--draft: None (whole blocks), 0 (off), a number of drafts, or "auto"."""
    from .speculative import AUTO

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


def run(model, tokenizer, tokens: list[int], *, max_tokens: int, temp: float, top_p: float,
        top_k: int, min_p: float, write, draft: int | str | None = None, stats=None) -> object:
    """Stream the completion through `write(text)`; returns the last GenerationResponse. DSpark
    drafts when the model has its weights and draft is not 0 (`stats`: a DraftStats to fill)."""
    from .speculative import Sampling, stream_generate

    last = None
    for last in stream_generate(model, tokenizer, tokens, max_tokens, draft=draft, stats=stats,
                                sampling=Sampling(temp, top_p, top_k, min_p)):
        write(last.text)
    return last


@app.command()
def generate(
    model: str = typer.Option(None, "--model", "-m", help="Converted checkpoint directory, an HF repo "
                              "id, or an EXL3 / official directory (offered for conversion)."),
    demo: bool = typer.Option(False, "--demo", help="Use the built-in demo checkpoint (synthetic "
                              "weights, real formats; built on first use)."),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text ('-': read stdin)."),
    prompt_file: Path = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    chat_mode: bool = typer.Option(False, "--chat", help="Wrap the prompt in the DeepSeek-V4.1 chat "
                                   "encoding (one user turn)."),
    thinking: bool = typer.Option(True, "--thinking/--no-thinking", help="Chat: thinking or chat mode."),
    effort: str = typer.Option(chat.DEFAULT_EFFORT, "--effort", help="Chat, thinking mode: reasoning "
                               "effort low (50), high (75), max (100) or 1..100."),
    system: str = typer.Option(None, "--system", help="Chat: a system message."),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Most tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling (1: off)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Top-k sampling (0: off)."),
    min_p: float = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Min-p sampling (0: off)."),
    seed: int = typer.Option(None, "--seed", help="Random seed for sampling."),
    attention: Attention = typer.Option(Attention.auto, "--attention", help="Sparse-attention kernel "
                                        "variant on a GPU (the CPU runs the reference)."),
    moe_partition: Partition = typer.Option(Partition.experts, "--moe-partition", help="Under "
                                            "mlx.launch: split routed experts by range or by slot."),
    engram_mode: str = typer.Option(None, "--engram-mode", help="Engram row reads: pread, mmap, ram "
                                    "or auto (default)."),
    convert_to: Path = typer.Option(None, "--convert-to", help="Convert an EXL3 / official --model "
                                    "into this directory without asking."),
    engram_from: Path = typer.Option(None, "--engram-from", help="With a conversion: the official "
                                     "release directory holding the Engram tables."),
    dspark_from: Path = typer.Option(None, "--dspark-from", help="With a conversion: the official "
                                     "release directory holding the DSpark draft head (mtp.*)."),
    draft: str = typer.Option(None, "--draft", help="DSpark speculative decoding: drafts verified per "
                              "main forward (default: the whole block), 'auto' (the confidence head "
                              "chooses) or 0 (off)."),
):
    import mlx.core as mx

    from .demo import DemoError
    from .kernels import sparse_attention

    try:
        sparse_attention.set_default_variant(attention.value)
        if system is not None and not chat_mode:
            raise CLIError("--system needs --chat")
        text, from_stdin = read_prompt(prompt, prompt_file)
        effort_value = chat.parse_effort(effort)
        draft_value = parse_draft(draft)
        path = resolve_model(model, demo, convert_to, engram_from,
                             interactive=sys.stdin.isatty() and not from_stdin, dspark_from=dspark_from)
        model_obj, tokenizer, cluster = load_for_generation(path, partition=moe_partition.value,
                                                            engram_mode=engram_mode, draft=draft_value)
        check_draft(model_obj, draft_value)
        tokens = prompt_tokens(tokenizer, text, chat_mode=chat_mode, thinking=thinking,
                               effort=effort_value, system=system)
    except (CLIError, DemoError, ValueError) as e:
        _note(f"error: {e}")
        raise typer.Exit(1)

    rank0 = cluster is None or cluster.rank == 0
    if demo and rank0:
        _note(f"NOTE: --demo uses a small checkpoint with SYNTHETIC RANDOM WEIGHTS ({path}): it runs "
              f"the real path (EXL3 + Engram formats, convert, lazy load, SSD Engram), but its text "
              f"is meaningless.")
    if rank0 and not model_obj.mtp and draft_value != 0:
        _note(f"NOTE: no DSpark speculative decoding: {model_obj.dspark_unavailable}")
    if seed is not None:
        mx.random.seed(seed)
    elif cluster is not None:  # every rank must draw the same samples
        mx.random.seed(mx.distributed.all_sum(mx.random.state[0], group=cluster.group).view(mx.uint64).item())
    sparse_attention.reset_variant_counts()

    def write(piece: str) -> None:
        if rank0:
            print(piece, end="", flush=True)

    from .speculative import DraftStats

    stats = DraftStats() if model_obj.mtp else None
    last = run(model_obj, tokenizer, tokens, max_tokens=max_tokens, temp=temp, top_p=top_p,
               top_k=top_k, min_p=min_p, write=write, draft=draft_value, stats=stats)
    if rank0:
        print(flush=True)
        dspark = None if stats is None else stats.line() + (" (meaningless: synthetic weights)" if demo else "")
        _note(statistics(last, engram_totals(model_obj), sparse_attention.variant_counts(), dspark))
        if demo:
            _note("NOTE: the demo's weights are synthetic: the text above is meaningless by design"
                  + (", and so is the DSpark acceptance rate." if stats is not None else "."))


def main() -> None:
    # transformers warns that a tokenizer-only load sees a "deepseek_v41" config: noise here.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    app()


if __name__ == "__main__":
    main()
