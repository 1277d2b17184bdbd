"""A strict safetensors reader that never loads a whole file.

The format: an 8-byte little-endian header length N, N bytes of JSON, then the data buffer.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with
offsets relative to the data buffer, plus an optional ``"__metadata__"`` of string pairs. As in
the reference implementation, the tensors must tile the data buffer exactly: no overlap, no hole,
no trailing bytes. Anything else is refused on open, so a file that opens can be read anywhere.

Tensors come back as numpy arrays of their raw storage: F8_E4M3 / F8_E5M2 / F8_E8M0 as uint8 and
BF16 as uint16 (numpy has none of these types); the caller reinterprets the bits. Reads are
positioned (``os.preadv``) straight into the result, one tensor or one row range at a time, so a
100 GB Engram table costs only the rows asked for.

Every problem raises :class:`SafetensorsError` with a one-line message naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the reference reader's limit; a larger header is not a real file
_MAX_READ = 1 << 30  # bytes per syscall (Linux caps one read near 2 GiB)

# safetensors dtype -> numpy dtype of the raw storage
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "F8_E8M0": np.dtype(np.uint8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}


class SafetensorsError(ValueError):
    """A safetensors file or checkpoint that cannot be read as it claims; the message says where."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``offset`` is absolute in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one index along the first dimension."""
        return math.prod(self.shape[1:]) * self.numpy_dtype.itemsize


def pread_into(fd: int, buf: memoryview, offset: int, what: str) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; a file that ends early is an error naming ``what``."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done : done + _MAX_READ]], offset + done)
        if n == 0:
            raise SafetensorsError(f"{what}: file ends {len(buf) - done} bytes early (truncated?)")
        done += n


def _reject_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SafetensorsFile:
    """One .safetensors file, header validated on open; reads are positioned and thread-safe."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SafetensorsError(f"{self.path}: no such file") from None
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self.metadata, self.tensors = self._parse_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, msg: str):
        raise SafetensorsError(f"{self.path}: {msg}")

    def _parse_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            self._fail(f"{size} bytes is too short for a safetensors header")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > MAX_HEADER_BYTES:
            self._fail(f"header length {n} is implausible (limit {MAX_HEADER_BYTES}); not safetensors?")
        if 8 + n > size:
            self._fail(f"truncated: header claims {n} bytes but the file has {size - 8} after the length")
        raw = bytearray(n)
        pread_into(self._fd, memoryview(raw), 8, str(self.path))
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            self._fail(f"header is not valid JSON ({e})")
        if not isinstance(header, dict):
            self._fail("header JSON is not an object")

        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            self._fail("__metadata__ must map strings to strings")

        data_start, data_len = 8 + n, size - 8 - n
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            tensors[name] = self._parse_entry(name, entry, data_start)

        # The tensors must tile the data buffer exactly (sorted by start; empty tensors anywhere).
        end, prev = 0, None
        for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
            begin = t.offset - data_start
            if begin < end:
                self._fail(f"tensors {prev!r} and {t.name!r} overlap (byte {begin} < {end})")
            if begin > end:
                self._fail(f"hole of {begin - end} bytes before tensor {t.name!r}")
            end, prev = begin + t.nbytes, t.name
        if end > data_len:
            self._fail(f"truncated: tensor {prev!r} ends at data byte {end} but the file holds {data_len}")
        if end < data_len:
            self._fail(f"{data_len - end} trailing bytes after the last tensor {prev!r}")
        return metadata, tensors

    def _parse_entry(self, name: str, entry, data_start: int) -> TensorInfo:
        where = f"tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            self._fail(f"{where}: entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            self._fail(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            self._fail(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            self._fail(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            self._fail(
                f"{where}: header lies about its size: {dtype} {shape} is {nbytes} bytes "
                f"but data_offsets span {offsets[1] - offsets[0]}"
            )
        return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], nbytes)

    # -- reading --------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}") from None

    def read(self, name: str) -> np.ndarray:
        t = self.info(name)
        out = np.empty(t.shape, dtype=t.numpy_dtype)
        self._read_into(out, t.offset, t.name)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` along the first dimension, in one positioned read."""
        t = self.info(name)
        if not t.shape:
            self._fail(f"tensor {name!r} is a scalar; it has no rows")
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= t.shape[0]):
            self._fail(f"tensor {name!r}: rows [{start}, {stop}) outside [0, {t.shape[0]})")
        out = np.empty((stop - start, *t.shape[1:]), dtype=t.numpy_dtype)
        self._read_into(out, t.offset + start * t.row_nbytes, t.name)
        return out

    def _read_into(self, out: np.ndarray, offset: int, name: str) -> None:
        if out.nbytes:
            pread_into(self._fd, memoryview(out).cast("B"), offset, f"{self.path}: tensor {name!r}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_fd", -1) >= 0:
            self.close()


class SafetensorsCheckpoint:
    """A checkpoint: a directory with ``model.safetensors.index.json``, a directory of
    ``*.safetensors`` files, or one ``.safetensors`` file. Shards open on first use.

    ``use_index=False`` ignores the index and reads the headers of the ``*.safetensors`` files
    present (e.g. only the official release's two Engram shards). ``allow_missing=True`` accepts
    an index whose shards are not all present: their tensors go to ``missing`` (name -> shard
    file name) instead of ``weight_map``, for the caller to judge.
    """

    def __init__(self, path: str | os.PathLike, *, use_index: bool = True, allow_missing: bool = False):
        self.path = Path(path)
        self._open: dict[Path, SafetensorsFile] = {}
        self.missing: dict[str, str] = {}
        if self.path.is_file():
            shard = self._shard(self.path)
            self.weight_map = {name: self.path for name in shard.names()}
        elif use_index and (self.path / INDEX_NAME).is_file():
            self.weight_map = self._read_index(self.path / INDEX_NAME, allow_missing)
        elif self.path.is_dir():
            self.weight_map = {}
            for file in sorted(self.path.glob("*.safetensors")):
                for name in self._shard(file).names():
                    if name in self.weight_map:
                        raise SafetensorsError(
                            f"{self.path}: tensor {name!r} is in both {self.weight_map[name].name} and {file.name}"
                        )
                    self.weight_map[name] = file
            if not self.weight_map:
                raise SafetensorsError(f"{self.path}: no {INDEX_NAME} and no *.safetensors files")
        else:
            raise SafetensorsError(f"{self.path}: no such file or directory")

    def _read_index(self, index: Path, allow_missing: bool = False) -> dict[str, Path]:
        try:
            data = json.loads(index.read_text(), object_pairs_hook=_reject_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise SafetensorsError(f"{index}: not valid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise SafetensorsError(f"{index}: weight_map must map tensor names to shard file names")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            if Path(shard).name != shard or shard in (".", ".."):
                raise SafetensorsError(f"{index}: shard {shard!r} is not a plain file name")
            if not (index.parent / shard).is_file():
                if allow_missing:
                    self.missing.update(dict.fromkeys(names, shard))
                    continue
                raise SafetensorsError(
                    f"{index.parent}: shard {shard} is missing ({len(names)} tensors, "
                    f"e.g. {names[0]!r}, are listed in it)"
                )
        return {name: index.parent / shard for name, shard in weight_map.items() if name not in self.missing}

    def _shard(self, file: Path) -> SafetensorsFile:
        if file not in self._open:
            self._open[file] = SafetensorsFile(file)
        return self._open[file]

    def shards(self) -> list[Path]:
        """Shard files in name order (the order a streaming converter visits them)."""
        return sorted(set(self.weight_map.values()))

    def names(self, shard: Path | None = None) -> list[str]:
        return [n for n, f in self.weight_map.items() if shard is None or f == shard]

    def file_of(self, name: str) -> SafetensorsFile:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}") from None
        shard = self._shard(file)
        if name not in shard.tensors:
            raise SafetensorsError(f"{self.path}: the index puts {name!r} in {file.name}, which lacks it")
        return shard

    def info(self, name: str) -> TensorInfo:
        return self.file_of(name).info(name)

    def read(self, name: str) -> np.ndarray:
        return self.file_of(name).read(name)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.file_of(name).read_rows(name, start, stop)

    def release(self, shard: Path) -> None:
        """Close one shard (a streaming converter is done with it)."""
        f = self._open.pop(shard, None)
        if f is not None:
            f.close()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
