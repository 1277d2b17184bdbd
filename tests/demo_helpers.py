"""The demo checkpoint for the CLI / drop-in / server / example tests: built once per test session
in the session's temp directory (never in ~/.cache), and the environment for subprocesses that
makes `--demo` find it there."""

from __future__ import annotations

import os
from pathlib import Path

from mlx_dsv41.demo import CACHE_ENV, DEMO_VERSION, ensure_demo

REPO = Path(__file__).resolve().parents[1]


def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "mlx_dsv41_cache"


def demo_checkpoint(tmp_path_factory) -> Path:
    """The converted demo directory (built on the first call of the session)."""
    return ensure_demo(cache_dir(tmp_path_factory) / f"demo-v{DEMO_VERSION}", progress=False)


def demo_env(tmp_path_factory) -> dict[str, str]:
    """os.environ for a subprocess whose `--demo` uses this session's demo checkpoint."""
    demo_checkpoint(tmp_path_factory)
    return {**os.environ, CACHE_ENV: str(cache_dir(tmp_path_factory)), "PYTHONUNBUFFERED": "1"}
