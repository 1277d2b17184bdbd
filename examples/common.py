"""Shared by the example scripts: load a converted checkpoint (default: the demo), watch calls,
line text up in columns, and write pictures (matplotlib, optional)."""

from __future__ import annotations

import argparse
import sys
import unicodedata
from pathlib import Path

import mlx.nn as nn

NO_MATPLOTLIB = (
    "error: --png needs matplotlib: pip install matplotlib (or, in the mlx_dsv41 checkout, pip install -e '.[plot]')"
)


def parser(description: str, picture: str | None = None) -> argparse.ArgumentParser:
    """The examples' options; `picture` says what --png draws (no --png without it)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--model",
        help="a converted checkpoint directory (default: the demo checkpoint, "
        "built on first use; its weights are synthetic)",
    )
    if picture:
        p.add_argument("--png", type=Path, help=f"also draw {picture} into this PNG file (needs matplotlib)")
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed options; with --png, matplotlib is checked now, before any work."""
    args = p.parse_args()
    if getattr(args, "png", None):
        pyplot()
    return args


def load(model_dir: str | None):
    """(model, tokenizer) of `model_dir`, or of the demo checkpoint; a bad directory is a one-line
    error and exit status 1."""
    import mlx_dsv41
    from mlx_dsv41.demo import DemoError, ensure_demo
    from mlx_dsv41.loading import LoadError

    try:
        if model_dir is None:
            path = ensure_demo()
            print(
                f"note: using the demo checkpoint {path}: SYNTHETIC weights, so the numbers below show "
                f"the machinery, not a trained model",
                file=sys.stderr,
            )
        else:
            path = Path(model_dir)
        return mlx_dsv41.load(path)
    except (LoadError, DemoError) as e:
        raise SystemExit(f"error: {e}") from None


def pyplot():
    """matplotlib.pyplot drawing into files only, or a one-line error when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(NO_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> None:
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)


def width(text: str) -> int:
    """Columns `text` takes on a terminal (East Asian wide and fullwidth characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text: str, columns: int) -> str:
    return text + " " * max(0, columns - width(text))


def record_calls(parent: nn.Module, name: str, record) -> None:
    """Replace `parent.<name>` by a module that calls it and then `record(inner, args, output)`."""
    inner = getattr(parent, name)

    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def __call__(self, *args):
            out = self.inner(*args)
            record(self.inner, args, out)
            return out

    setattr(parent, name, Recording())
