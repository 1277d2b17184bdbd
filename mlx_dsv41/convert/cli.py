"""`python -m mlx_dsv41.convert SRC OUT [--engram-from DIR] [--dspark-from DIR] [--dtype bf16]`

Converts an EXL3 (exllamav3) or official FP8/FP4 DeepSeek-V4.1-Flash checkpoint into the layout
`mlx_dsv41.load` and `mlx_lm.load(OUT, trust_remote_code=True)` read (`mlx_dsv41/layout.py`).
The work is done by `mlx_dsv41.convert.convert_checkpoint`; this is its command line: progress on
stderr, and every bad input a one-line `error: ...` with exit status 1 (no traceback).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command()
def convert(
    src: Path = typer.Argument(
        ..., help="The checkpoint to convert: an EXL3 (exllamav3) or the official FP8/FP4 DeepSeek-V4.1 directory."
    ),
    out: Path = typer.Argument(..., help="The output directory (must not exist, or be empty)."),
    engram_from: Path | None = typer.Option(
        None,
        "--engram-from",
        help="A directory with the official Engram tables: the official "
        "release's shards model-00047-of-00048 and model-00048-of-00048 (EXL3 packs have none).",
    ),
    dspark_from: Path | None = typer.Option(
        None,
        "--dspark-from",
        help="A directory with the official release's DSpark draft head "
        "(mtp.*), for sources without it (only the shards holding it are read).",
    ),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="bf16: dequantize official FP8/FP4 weights (exact) instead of re-laying them as MLX mxfp8 / mxfp4.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Convert a DeepSeek-V4.1 checkpoint (+ its Engram tables) for MLX."""
    from mlx_dsv41.convert.checkpoint import convert_checkpoint
    from mlx_dsv41.convert.source import ConvertError

    try:
        convert_checkpoint(src, out, engram_from=engram_from, dtype=dtype, progress=not quiet, dspark_from=dspark_from)
    except ConvertError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted; run the same command again to resume", err=True)
        raise typer.Exit(130) from None


def main() -> None:
    app()
