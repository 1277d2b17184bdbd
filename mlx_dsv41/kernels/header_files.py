"""CUDA kernel headers handed to MLX as files on disk, included by path
(docs/design.md#kernel-header-files).

MLX hashes a custom kernel's whole source at every launch (docs/design.md#kernel-source-size): a
Flash decode step's ~1,000 launches hash ~8 MB of text, mostly the same few headers again and
again. NVRTC reads an `#include` from the file system, so on CUDA the header MLX holds is one line,
`#include "<dir>/<kernel>-<sha256 of the text>.cuh"`, and the text sits in that file. The file's
name carries its content's hash, so a changed header is a new name: MLX's JIT and PTX caches, named
by the source's hash, never compile one text and run another. Metal's runtime compiler reads no
files: Metal keeps the text.

`MLX_DSV41_KERNEL_HEADERS`: a directory for the files (default `<cache root>/kernel-headers`,
mlx_dsv41.user_cache), or `inline` for the text in the source. Where the directory cannot be
written, the text stays inline.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from mlx_dsv41.user_cache import cache_root

ENV_VAR = "MLX_DSV41_KERNEL_HEADERS"
INLINE = "inline"


def directory() -> Path | None:
    """Where header files go, or None for headers inline."""
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting.lower() == INLINE:
        return None
    return Path(setting).expanduser() if setting else cache_root() / "kernel-headers"


def header_file(name: str, text: str, where: Path) -> Path | None:
    """The file in `where` holding `text` (written once, atomically: a reader never sees part of
    it), or None where it cannot be written or its path cannot be an #include's."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    path = where.resolve() / f"{name}-{digest}.cuh"
    if any(c in str(path) for c in '"\\\n'):
        return None
    try:
        if path.is_file() and path.read_text() == text:
            return path
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def cuda_header(name: str, text: str) -> str:
    """What MLX is handed as kernel `name`'s CUDA header: an #include of the file holding `text`,
    or `text` itself (headers inline, or no file could be written)."""
    where = directory()
    path = header_file(name, text, where) if where is not None and text else None
    return f'#include "{path}"\n' if path else text
