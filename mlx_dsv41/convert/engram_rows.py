"""Write Engram tables as row files (format in ``mlx_dsv41/engram_store.py``).

The source is the official table pair ``layers.{L}.engram.embed.weight`` (F8_E4M3 [rows, D]) and
``.scale`` (F8_E8M0 [rows, D/32]) read in row chunks through ``safetensors_io``, or two numpy
arrays. Each chunk is interleaved into rows (values then scales), hashed, written and made
durable, and only then recorded in the header as done, so the file is always either resumable or
restarted, never wrong. The file is written as ``<name>.partial`` and renamed when complete:
nothing under the final name is ever half written.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_dsv41.convert.safetensors_io import SafetensorsCheckpoint, SafetensorsError
from mlx_dsv41.convert.safetensors_writer import PARTIAL_SUFFIX, sync_dir, sync_file
from mlx_dsv41.engram_store import (
    DEFAULT_CHUNK_ROWS,
    SCALE_GROUP,
    WHERE_TO_GET,
    EngramStoreError,
    RowFileHeader,
    chunk_digest,
    open_row_file,
    read_exact,
)


@dataclass(frozen=True)
class EngramTable:
    """A source table; ``read(start, stop)`` -> values uint8 [n, head_dim], scales uint8 [n, head_dim/32]."""

    rows: int
    head_dim: int
    read: Callable[[int, int], tuple[np.ndarray, np.ndarray]]
    description: str

    def rows_of(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as stored in a row file: uint8 [n, head_dim + head_dim/32]."""
        values, scales = self.read(start, stop)
        n, d = stop - start, self.head_dim
        if values.shape != (n, d) or scales.shape != (n, d // SCALE_GROUP):
            raise EngramStoreError(
                f"{self.description}: rows [{start}, {stop}) came back as {list(values.shape)} and "
                f"{list(scales.shape)}, expected [{n}, {d}] and [{n}, {d // SCALE_GROUP}]"
            )
        out = np.empty((n, d + d // SCALE_GROUP), np.uint8)
        out[:, :d] = values
        out[:, d:] = scales
        return out


def table_from_arrays(values: np.ndarray, scales: np.ndarray, description: str = "arrays") -> EngramTable:
    """A table from raw bytes in memory (or np.memmap): values [rows, D], scales [rows, D/32], uint8."""
    if values.dtype != np.uint8 or scales.dtype != np.uint8:
        raise EngramStoreError(f"{description}: values and scales must be uint8 (raw e4m3 / e8m0 bytes)")
    if (
        values.ndim != 2
        or values.shape[1] % SCALE_GROUP
        or scales.shape != (values.shape[0], values.shape[1] // SCALE_GROUP)
    ):
        raise EngramStoreError(
            f"{description}: values {list(values.shape)} and scales {list(scales.shape)} are not "
            f"[rows, D] and [rows, D/{SCALE_GROUP}]"
        )
    return EngramTable(values.shape[0], values.shape[1], lambda a, b: (values[a:b], scales[a:b]), description)


def table_from_checkpoint(ckpt: SafetensorsCheckpoint, layer_id: int) -> EngramTable:
    """Layer ``layer_id``'s table in a safetensors checkpoint (the official release's last shards)."""
    w_name = f"layers.{layer_id}.engram.embed.weight"
    s_name = f"layers.{layer_id}.engram.embed.scale"
    if w_name not in ckpt.weight_map or s_name not in ckpt.weight_map:
        raise EngramStoreError(f"{ckpt.path}: no {w_name} / {s_name}; {WHERE_TO_GET}")
    w, s = ckpt.info(w_name), ckpt.info(s_name)
    if w.dtype != "F8_E4M3" or s.dtype != "F8_E8M0":
        raise SafetensorsError(
            f"{ckpt.path}: {w_name} is {w.dtype} and {s_name} is {s.dtype}, expected F8_E4M3 and F8_E8M0"
        )
    if len(w.shape) != 2 or w.shape[1] % SCALE_GROUP or s.shape != (w.shape[0], w.shape[1] // SCALE_GROUP):
        raise SafetensorsError(
            f"{ckpt.path}: {w_name} {list(w.shape)} and {s_name} {list(s.shape)} are not "
            f"[rows, D] and [rows, D/{SCALE_GROUP}]"
        )
    return EngramTable(
        w.shape[0],
        w.shape[1],
        lambda a, b: (ckpt.read_rows(w_name, a, b), ckpt.read_rows(s_name, a, b)),
        f"{ckpt.path} layer {layer_id}",
    )


def check_table(table: EngramTable, layer_id: int, expected_rows: int, head_dim: int | None = None) -> None:
    """The table must have the config's row count (``engram_num_embeddings``) and head_dim."""
    if table.rows != expected_rows:
        raise EngramStoreError(
            f"{table.description}: {table.rows} rows but the config's engram_num_embeddings for "
            f"layer {layer_id} is {expected_rows} (a table of another model?); {WHERE_TO_GET}"
        )
    if head_dim is not None and table.head_dim != head_dim:
        raise EngramStoreError(
            f"{table.description}: rows of {table.head_dim} values but the config's "
            f"engram_head_dim is {head_dim} (a table of another model?)"
        )


def write_engram_rows(
    table: EngramTable,
    out_path: str | os.PathLike,
    layer_id: int,
    expected_rows: int,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Write ``table`` as a row file at ``out_path``; returns "unchanged", "resumed" or "written".

    ``expected_rows`` is the config's ``engram_num_embeddings`` entry for the layer. A finished
    file from the same source is left alone; a finished file from another source is an error
    (delete it first). ``progress(rows_done, rows)`` is called after every chunk.
    """
    out_path = Path(out_path)
    check_table(table, layer_id, expected_rows)
    if not out_path.parent.is_dir():
        raise EngramStoreError(f"{out_path}: directory {out_path.parent} does not exist")

    if out_path.exists():
        fd, header = open_row_file(out_path, expected_rows=expected_rows, layer_id=layer_id, head_dim=table.head_dim)
        os.close(fd)
        last = header.n_chunks - 1
        if any(chunk_digest(table.rows_of(*header.chunk_range(k))) != header.digest_of(k) for k in {0, last}):
            raise EngramStoreError(f"{out_path}: exists but holds a different table; delete it to rewrite")
        return "unchanged"

    partial = out_path.with_name(out_path.name + PARTIAL_SUFFIX)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when fd closes
        except BlockingIOError:
            raise EngramStoreError(f"{partial}: another process is writing it") from None
        header = _resumable_header(fd, partial, table, layer_id, chunk_rows)
        resumed = header is not None
        if header is None:
            header = RowFileHeader.new(layer_id, table.rows, table.head_dim, chunk_rows)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, header.file_bytes)
            _pwrite_all(fd, header.pack(), 0)
        _write_chunks(fd, header, table, progress)
        sync_file(fd)
    finally:
        os.close(fd)
    os.replace(partial, out_path)
    sync_dir(out_path.parent)
    return "resumed" if resumed else "written"


def _write_chunks(
    fd: int, header: RowFileHeader, table: EngramTable, progress: Callable[[int, int], None] | None
) -> None:
    """The chunks the header does not list as done, each made durable before the header (rewritten
    after every chunk) says it is."""
    if progress is not None:
        progress(min(header.rows, header.chunks_done * header.chunk_rows), header.rows)
    # One chunk of read-ahead: the source read of chunk k+1 overlaps hashing and writing
    # chunk k (pread, sha256 and numpy copies all release the GIL).
    with ThreadPoolExecutor(1, thread_name_prefix="engram-source") as reader:
        chunks = range(header.chunks_done, header.n_chunks)
        pending = reader.submit(table.rows_of, *header.chunk_range(chunks[0])) if chunks else None
        for k in chunks:
            rows = pending.result()
            if k + 1 < header.n_chunks:
                pending = reader.submit(table.rows_of, *header.chunk_range(k + 1))
            lo, hi = header.chunk_range(k)
            _pwrite_all(fd, rows, header.data_offset + lo * header.row_bytes)
            sync_file(fd)  # the chunk is durable before the header says it is done
            header = header.with_chunk(k, chunk_digest(rows))
            _pwrite_all(fd, header.pack(), 0)
            if progress is not None:
                progress(hi, header.rows)


def _resumable_header(fd: int, path: Path, table: EngramTable, layer_id: int, chunk_rows: int) -> RowFileHeader | None:
    """The header of a partial file that can be continued from ``table``, or None to restart.

    The last recorded chunk must match both the file and the source, and the first chunk the
    source: a partial file of another table or one whose last write was lost is restarted.
    """
    if os.fstat(fd).st_size == 0:
        return None
    try:
        header = RowFileHeader.read(fd, path)
    except EngramStoreError:
        return None
    if (header.layer_id, header.rows, header.head_dim, header.chunk_rows) != (
        layer_id,
        table.rows,
        table.head_dim,
        chunk_rows,
    ) or os.fstat(fd).st_size != header.file_bytes:
        return None
    for k in {0, header.chunks_done - 1} if header.chunks_done else ():
        lo, hi = header.chunk_range(k)
        on_disk = np.empty((hi - lo) * header.row_bytes, np.uint8)
        read_exact(fd, on_disk, header.data_offset + lo * header.row_bytes, path)
        digest = header.digest_of(k)
        if chunk_digest(on_disk) != digest or chunk_digest(table.rows_of(lo, hi)) != digest:
            return None
    return header


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
