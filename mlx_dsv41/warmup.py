"""`python -m mlx_dsv41.warmup --model DIR` (or `--demo`): build the kernels a first request needs, ahead
of it, and say how long that took.

MLX compiles each custom kernel and each fused graph the first time a shape needs it. On CUDA,
MLX keeps its own fused kernels on disk (`MLX_PTX_CACHE_DIR`, by default
`<tmp>/mlx/<version>/ptx`) but compiles custom kernels, this package's, again in every process
(NVRTC; MLX's `custom_kernel.cpp` asks its JIT module for no disk cache): on the H200 the demo's
first token took 156 s in a new process, the Flash-shaped model's first prefill 46 s
(docs/benchmarks.md#first-run-cost). So on CUDA a separate warm-up process saves only MLX's part;
a server warms itself up with `mlx_dsv41.server --warmup N`, which runs this same generation
before it listens. The warm-up generates from a random prompt of
`--tokens` tokens: full and partial prefill chunks, decode steps at both compressor parities, and
with DSpark its verify and draft shapes. It reports both passes, each with its time to the first
token; the second pass's is what a request sees in a warm process. Prompts longer than `--tokens` may meet shapes it did
not (a larger compressed-cache capacity), so give the longest prompt you expect.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import typer

from mlx_dsv41.generate import ENGRAM_MODE, CLIError, load_for_generation, parse_draft, resolve_model, run

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0], context_settings={"max_content_width": 80})


def kernel_cache() -> str:
    """Where this backend keeps compiled kernels between processes."""
    import mlx.core as mx

    if hasattr(mx, "cuda") and mx.cuda.is_available():
        default = Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"  # MLX's own default
        where = os.environ.get("MLX_PTX_CACHE_DIR") or str(default)
        return f"{where} (MLX's own; this package's kernels compile in each process: server --warmup)"
    if mx.metal.is_available():
        return "Metal's own shader cache"
    return "none (the CPU runs the plain-MLX reference; nothing is compiled)"


def warm_up(model, tokenizer, tokens: int, step: int, draft) -> tuple[float, float]:
    """(seconds to the first token, seconds to generate 8 tokens) after a random `tokens`-token
    prompt, output discarded."""
    import numpy as np

    from mlx_dsv41.speculative import Sampling

    prompt = np.random.default_rng(0).integers(3, model.args.vocab_size - 300, tokens).tolist()
    first: list[float] = []
    t0 = time.perf_counter()

    def write(text, token):
        if not first:
            first.append(time.perf_counter() - t0)

    run(model, tokenizer, prompt, max_tokens=8, sampling=Sampling(0.0, 1.0, 0, 0.0), write=write,
        draft=draft, prefill_step_size=step)  # fmt: skip
    total = time.perf_counter() - t0
    return (first[0] if first else total), total


@app.command()
def warmup(
    model: str = typer.Option(None, "--model", "-m", help="Converted checkpoint directory (or an HF repo id)."),
    demo: bool = typer.Option(False, "--demo", help="The built-in demo checkpoint."),
    tokens: int = typer.Option(4096, "--tokens", min=2, help="Prompt tokens to warm up for."),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", min=1, help="As generate's."),
    draft: str = typer.Option(None, "--draft", help="As generate's: the DSpark shapes to build (0: none)."),
    engram_mode: str = ENGRAM_MODE,
):
    from mlx_dsv41.demo import DemoError

    try:
        draft_value = parse_draft(draft)
        path = resolve_model(model, demo, None, None, interactive=False)
        model_obj, tokenizer, _ = load_for_generation(
            path, engram_mode=engram_mode, draft=draft_value, show_progress=sys.stderr.isatty()
        )
        first = warm_up(model_obj, tokenizer, tokens, prefill_step_size, draft_value)
        again = warm_up(model_obj, tokenizer, tokens, prefill_step_size, draft_value)
    except (CLIError, DemoError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"Warmed up {path} for prompts of {tokens} tokens: first pass {first[1]:.1f} s (first token "
        f"after {first[0]:.2f} s), then {again[1]:.1f} s (first token after {again[0]:.2f} s: a warm "
        f"process's time to first token). Compiled kernels are kept in: {kernel_cache()}"
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
