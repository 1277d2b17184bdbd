"""Kernel sources shared by the Metal and CUDA backends.

Each kernel is one body file (``<name>.metal``: the body only, MLX writes the signature) plus any
number of shared ``.h`` helper files written against the ``KX_*`` macros; ``backend_metal.h`` and
``backend_cuda.h`` map those macros to each backend. ``mlx_dsv41.kernels`` assembles and registers
them; nothing here imports MLX.
"""

from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BACKEND_HEADERS = {"metal": "backend_metal.h", "cuda": "backend_cuda.h"}


@cache
def read(name: str) -> str:
    """The text of one source file in this folder (``name`` includes its suffix)."""
    path = ROOT / name
    if not path.is_file():
        raise FileNotFoundError(f"metal_ext has no source {name!r}")
    return path.read_text()


def header(backend: str, includes: tuple[str, ...] = ()) -> str:
    """Backend macro header followed by the shared helper headers, inlined in order.

    Inlined rather than #included: MLX compiles the header text from memory on both backends.
    """
    parts = [read(BACKEND_HEADERS[backend])]
    parts += [read(name) for name in includes]
    return "\n".join(p.replace("#pragma once", "") for p in parts)


def body(name: str) -> str:
    return read(f"{name}.metal")
