"""Write a .safetensors file tensor by tensor, never holding more than the chunk being written.

The header needs every tensor's dtype and shape, so they are given up front (``specs``); the
bytes then follow in that order, each tensor in one piece or in consecutive row chunks. The file
is written as ``<name>.partial``, made durable and renamed on :meth:`SafetensorsWriter.close`, so
nothing under the final name is ever half written. The header is padded with spaces to a multiple
of 8 bytes (the format allows it) so every tensor starts 8-byte aligned.

Arrays are the raw storage numpy dtypes of ``convert.safetensors_io.DTYPES`` (BF16 as uint16,
F8_* as uint8).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np

from mlx_dsv41.convert.safetensors_io import DTYPES, SafetensorsError

PARTIAL_SUFFIX = ".partial"


def sync_file(fd: int) -> None:
    """Flush to stable storage; macOS's fsync stops at the drive cache, F_FULLFSYNC does not."""
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_FULLFSYNC", 51))
    else:
        os.fsync(fd)


def sync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def header_bytes(specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """The length prefix and JSON header for tensors laid out back to back in ``specs`` order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPES:
            raise SafetensorsError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if name in header:
            raise SafetensorsError(f"tensor {name!r} is listed twice")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """``write(name, array)`` the tensors of ``specs`` in order, then ``close()``."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.specs = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in specs]
        head = header_bytes(self.specs, metadata)
        self._fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._current, self._done = 0, 0  # index into specs; bytes of that tensor written
        self._write(head)

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.write(self._fd, view)
            view = view[n:]

    def _need(self, index: int) -> int:
        name, dtype, shape = self.specs[index]
        return math.prod(shape) * DTYPES[dtype].itemsize

    def write(self, name: str, data: np.ndarray) -> None:
        """Append ``data`` (the whole tensor, or its next rows) to tensor ``name``."""
        if self._fd < 0:
            raise SafetensorsError(f"{self.partial}: writer is closed")
        if (
            self._current < len(self.specs)
            and self._done == self._need(self._current)
            and self.specs[self._current][0] != name
        ):
            self._current, self._done = self._current + 1, 0
        if self._current >= len(self.specs) or self.specs[self._current][0] != name:
            expected = self.specs[self._current][0] if self._current < len(self.specs) else "nothing"
            raise SafetensorsError(f"{self.partial}: got tensor {name!r}, expected {expected!r} next")
        _, dtype, shape = self.specs[self._current]
        data = np.asarray(data)
        if not data.flags.c_contiguous:
            data = data.copy(order="C")  # (np.ascontiguousarray would make a 0-dim array 1-dim)
        if data.dtype != DTYPES[dtype]:
            raise SafetensorsError(
                f"{self.partial}: tensor {name!r} is {dtype}, stored as {DTYPES[dtype]}, got {data.dtype}"
            )
        if data.shape != shape and (not shape or data.ndim != len(shape) or data.shape[1:] != shape[1:]):
            raise SafetensorsError(
                f"{self.partial}: tensor {name!r} {list(shape)}: got a piece of shape {list(data.shape)}"
            )
        if self._done + data.nbytes > self._need(self._current):
            raise SafetensorsError(f"{self.partial}: tensor {name!r} {list(shape)}: more bytes than it holds")
        if data.nbytes:
            self._write(data)
        self._done += data.nbytes

    def close(self) -> Path:
        """Check every tensor is complete, make the file durable and give it its final name."""
        if self._current < len(self.specs) and self._done == self._need(self._current):
            self._current, self._done = self._current + 1, 0
        while self._current < len(self.specs) and self._need(self._current) == 0:
            self._current += 1
        if self._current < len(self.specs):
            name = self.specs[self._current][0]
            self.abort()
            raise SafetensorsError(f"{self.partial}: tensor {name!r} was not written completely")
        sync_file(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.partial, self.path)
        sync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Close and delete the partial file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None
) -> Path:
    """A whole file from ``{name: (safetensors dtype, raw array)}``, in dict order."""
    specs = [(name, dtype, a.shape) for name, (dtype, a) in tensors.items()]
    with SafetensorsWriter(path, specs, metadata) as w:
        for name, (_, a) in tensors.items():
            w.write(name, a)
    return Path(path)
