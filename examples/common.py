"""Shared by the example scripts: load a converted checkpoint (default: the demo) and watch calls."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.nn as nn


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="a converted checkpoint directory (default: the demo checkpoint, "
                                   "built on first use; its weights are synthetic)")
    return p


def load(model_dir: str | None):
    """(model, tokenizer) of `model_dir`, or of the demo checkpoint."""
    import mlx_dsv41
    from mlx_dsv41.demo import ensure_demo

    if model_dir is None:
        path = ensure_demo()
        print(f"note: using the demo checkpoint {path}: SYNTHETIC weights, so the numbers below show "
              f"the machinery, not a trained model", file=sys.stderr)
    else:
        path = Path(model_dir)
    return mlx_dsv41.load(path)


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
