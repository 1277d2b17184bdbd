"""Where mlx_dsv41 keeps what it makes once per machine: `$MLX_DSV41_CACHE`, by default
`~/.cache/mlx_dsv41` (the demo checkpoint, CUDA kernel headers)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MLX_DSV41_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx_dsv41").expanduser()
