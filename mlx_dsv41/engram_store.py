"""SSD-resident Engram tables: the row-file format and :class:`EngramStore`, its reader.

A token needs 24 rows of each Engram table (docs/model.md#engram-rows); a row is ``head_dim`` e4m3
value bytes then ``head_dim / 32`` e8m0 scale bytes (264 bytes for Flash). The official tables are
~100 GB each (docs/checkpoint.md#sizes), so they stay on disk, re-laid by the converter
(``mlx_dsv41/convert/engram_rows.py``) as one row file per Engram layer:

    offset  size  field (little-endian)
    0       8     magic b"DSV41ENG"
    8       4     format version (1)
    12      4     layer id
    16      8     rows
    24      4     head_dim (value bytes per row)
    28      4     row bytes (head_dim + head_dim / 32)
    32      8     data offset (a multiple of 16 KiB, the Apple page size)
    40      8     chunk rows (rows per checksummed chunk)
    48      8     chunks (ceil(rows / chunk rows))
    56      8     chunks done (== chunks in a finished file; a resumable writer's progress mark)
    64      32    data checksum: SHA-256 of the chunk table
    96      32    header checksum: SHA-256 of bytes [0, 96) and the chunk table
    128     32*n  chunk table: SHA-256 of each chunk's row bytes as stored
    ...     zero padding up to the data offset, then rows * row bytes of rows at a fixed stride

One row is one positioned read. Checksums are per chunk (~69 MB at the default 2^18 rows) so a
writer can resume without re-reading what it wrote and a verifier can stop at the first bad
chunk; SHA-256 runs at ~2.0 GB/s per core here (x86 SHA extensions; OpenSSL uses the ARMv8
SHA-2 instructions on Apple silicon, not measured), about 50 s per 100 GB table, and is only
computed when writing or on an explicit :meth:`EngramStore.verify`. Opening checks the header,
its checksum and the file size, never the data.

Read modes (``mode=``):

- ``"pread"``: ``os.preadv`` of each distinct row straight into the result, spread over a thread
  pool so a cold SSD sees a deep queue. No page faults, no read-ahead.
- ``"mmap"``: a read-only map with ``madvise(MADV_RANDOM)`` so a fault reads one page, not a
  read-ahead window (~140x amplification without it, docs/mlx.md#ssd-rows); rows are gathered with
  numpy. A cached row still costs a minor fault on its page's first touch, a cold row a
  synchronous major fault.
- ``"ram"``: the whole data region read into memory once (~100 GB per Flash table), bypassing
  (macOS) or then dropping (Linux) the file's page-cache copy.
- ``"auto"``: ``"pread"``, by measurement (docs/benchmarks.md, "Engram store": 4.3 GB table, 48
  random rows per token): cold, pread over 8 threads took 1.0 ms per token against 2.9 ms for
  mmap (one major fault per row) and 2.9 ms for a single thread; warm, mmap was no faster
  (0.25 vs 0.07-0.17 ms: every random row is a first touch of its page in the mapping).

Platform notes. macOS has no ``O_DIRECT``. There the store sets ``F_RDAHEAD`` to 0 (no read-ahead
on this descriptor) and, with ``nocache=True``, ``F_NOCACHE`` (reads bypass the unified buffer
cache, so the table does not push model weights out of memory; the cost is that hot rows are read
from SSD every time, and cold reads are reported ~22% slower on an M3). ``madvise(MADV_RANDOM)``
works on both systems. On Linux the descriptor gets ``posix_fadvise(POSIX_FADV_RANDOM)``;
``nocache`` has no effect there (Linux would need ``O_DIRECT`` with aligned buffers).

Prefetch: :meth:`EngramStore.prefetch` starts reading rows for the next forward on a background
thread; a later :meth:`EngramStore.read` takes the rows it can from the newest prefetched batches
(waiting for one still in flight) and reads only the rest. ``read`` and ``prefetch`` may be
called from any thread while a prefetch is in flight; ``close`` waits for prefetches and must
not race a ``read``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MAGIC = b"DSV41ENG"
FORMAT_VERSION = 1
PAGE_BYTES = 16384  # Apple silicon page; also a multiple of the 4 KiB x86 page
SCALE_GROUP = 32  # one e8m0 scale per 32 values (docs/model.md#engram-rows)
DEFAULT_CHUNK_ROWS = 1 << 18
DIGEST_BYTES = 32
_FIXED = struct.Struct("<8sIIQIIQQQQ32s32s")  # 128 bytes, layout in the module docstring
_HASHED_PREFIX = 96  # the header checksum covers the fields before it
_READ_BLOCK = 64 << 20

WHERE_TO_GET = (
    "the Engram tables are layers.{1,14}.engram.embed.{weight,scale} in the official "
    "DeepSeek-V4.1-Flash release shards model-00047-of-00048 and model-00048-of-00048; "
    "convert them with `python -m mlx_dsv41.convert SRC OUT --engram-from DIR`"
)

# Darwin fcntl commands (sys/fcntl.h); Python exposes F_NOCACHE only on some versions.
_F_RDAHEAD = 45
_F_NOCACHE = 48


class EngramStoreError(ValueError):
    """An Engram row file or request that cannot be served; the message names the file."""


def row_file_name(layer_id: int) -> str:
    """The one naming rule for a layer's row file inside a converted directory."""
    return f"engram.layers.{layer_id}.rows"


def read_exact(fd: int, out: np.ndarray, offset: int, path: Path) -> None:
    """Fill the C-contiguous array ``out`` from ``fd`` at ``offset`` (positioned reads)."""
    buf, done = memoryview(out).cast("B"), 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done : done + _READ_BLOCK]], offset + done)
        if n == 0:
            raise EngramStoreError(f"{path}: file ends early at byte {offset + done} (truncated?)")
        done += n


def chunk_digest(rows: np.ndarray) -> bytes:
    return hashlib.sha256(memoryview(np.ascontiguousarray(rows)).cast("B")).digest()


@dataclass(frozen=True)
class RowFileHeader:
    layer_id: int
    rows: int
    head_dim: int
    chunk_rows: int
    chunks_done: int
    chunk_digests: bytes  # DIGEST_BYTES per chunk; zeros for chunks not written yet

    @staticmethod
    def new(layer_id: int, rows: int, head_dim: int, chunk_rows: int) -> RowFileHeader:
        if head_dim <= 0 or head_dim % SCALE_GROUP:
            raise EngramStoreError(f"head_dim {head_dim} is not a positive multiple of {SCALE_GROUP}")
        if rows <= 0 or chunk_rows <= 0:
            raise EngramStoreError(f"rows ({rows}) and chunk rows ({chunk_rows}) must be positive")
        n_chunks = -(-rows // chunk_rows)
        return RowFileHeader(layer_id, rows, head_dim, chunk_rows, 0, bytes(DIGEST_BYTES * n_chunks))

    @property
    def row_bytes(self) -> int:
        return self.head_dim + self.head_dim // SCALE_GROUP

    @property
    def n_chunks(self) -> int:
        return -(-self.rows // self.chunk_rows)

    @property
    def data_offset(self) -> int:
        return -(-(_FIXED.size + DIGEST_BYTES * self.n_chunks) // PAGE_BYTES) * PAGE_BYTES

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.rows * self.row_bytes

    @property
    def complete(self) -> bool:
        return self.chunks_done == self.n_chunks

    def chunk_range(self, k: int) -> tuple[int, int]:
        return k * self.chunk_rows, min(self.rows, (k + 1) * self.chunk_rows)

    def digest_of(self, k: int) -> bytes:
        return self.chunk_digests[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]

    def with_chunk(self, k: int, digest: bytes) -> RowFileHeader:
        """The header after chunk ``k`` (the next one in order) is written."""
        assert k == self.chunks_done and len(digest) == DIGEST_BYTES
        table = self.chunk_digests[: k * DIGEST_BYTES] + digest + self.chunk_digests[(k + 1) * DIGEST_BYTES :]
        return replace(self, chunks_done=k + 1, chunk_digests=table)

    def pack(self) -> bytes:
        """The whole header region, zero-padded to the data offset."""
        data_digest = hashlib.sha256(self.chunk_digests).digest()
        fields = (
            MAGIC,
            FORMAT_VERSION,
            self.layer_id,
            self.rows,
            self.head_dim,
            self.row_bytes,
            self.data_offset,
            self.chunk_rows,
            self.n_chunks,
            self.chunks_done,
            data_digest,
        )
        prefix = _FIXED.pack(*fields, bytes(DIGEST_BYTES))[:_HASHED_PREFIX]
        header_digest = hashlib.sha256(prefix + self.chunk_digests).digest()
        out = prefix + header_digest + self.chunk_digests
        return out + bytes(self.data_offset - len(out))

    @staticmethod
    def read(fd: int, path: Path) -> RowFileHeader:
        """Parse and check the header (not the data); raises EngramStoreError naming ``path``."""

        def fail(msg: str):
            raise EngramStoreError(f"{path}: {msg}")

        size = os.fstat(fd).st_size
        raw = os.pread(fd, _FIXED.size, 0)
        if len(raw) < _FIXED.size:
            fail(f"{size} bytes is too short to be an Engram row file")
        (
            magic,
            version,
            layer_id,
            rows,
            head_dim,
            row_bytes,
            data_offset,
            chunk_rows,
            n_chunks,
            chunks_done,
            data_digest,
            header_digest,
        ) = _FIXED.unpack(raw)
        if magic != MAGIC:
            fail(f"not an Engram row file (magic {magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            fail(f"row file format version {version}; this reader knows version {FORMAT_VERSION}")
        if head_dim <= 0 or head_dim % SCALE_GROUP or row_bytes != head_dim + head_dim // SCALE_GROUP:
            fail(f"row bytes {row_bytes} do not fit head_dim {head_dim} (expected head_dim + head_dim/32)")
        if rows <= 0 or chunk_rows <= 0 or n_chunks != -(-rows // chunk_rows) or chunks_done > n_chunks:
            fail(
                f"inconsistent header: {rows} rows, {chunk_rows} rows per chunk, {n_chunks} chunks, {chunks_done} done"
            )
        table = os.pread(fd, DIGEST_BYTES * n_chunks, _FIXED.size)
        if len(table) < DIGEST_BYTES * n_chunks:
            fail(f"truncated inside the header ({size} bytes)")
        header = RowFileHeader(layer_id, rows, head_dim, chunk_rows, chunks_done, table)
        if data_offset != header.data_offset:
            fail(f"data offset {data_offset}, expected {header.data_offset}")
        if hashlib.sha256(raw[:_HASHED_PREFIX] + table).digest() != header_digest:
            fail("header checksum mismatch (the header is corrupted)")
        if hashlib.sha256(table).digest() != data_digest:
            fail("data checksum does not match the chunk table (the header is corrupted)")
        return header


def open_row_file(
    path: Path, *, expected_rows: int | None = None, layer_id: int | None = None, head_dim: int | None = None
) -> tuple[int, RowFileHeader]:
    """Open a finished row file read-only and check it against what the config expects.

    Returns ``(fd, header)``; the caller owns ``fd``.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise EngramStoreError(f"{path}: no Engram row file; {WHERE_TO_GET}") from None
    except OSError as e:
        raise EngramStoreError(f"{path}: cannot open ({e.strerror})") from None
    try:
        header = RowFileHeader.read(fd, path)
        size = os.fstat(fd).st_size
        if not header.complete:
            raise EngramStoreError(
                f"{path}: unfinished ({header.chunks_done} of {header.n_chunks} chunks); rerun the converter"
            )
        if size < header.file_bytes:
            raise EngramStoreError(f"{path}: truncated: {size} bytes, the header needs {header.file_bytes}")
        if size > header.file_bytes:
            raise EngramStoreError(f"{path}: {size - header.file_bytes} trailing bytes after the last row")
        if head_dim is not None and header.head_dim != head_dim:
            raise EngramStoreError(
                f"{path}: rows of {header.row_bytes} bytes (head_dim {header.head_dim}), the config "
                f"needs {head_dim + head_dim // SCALE_GROUP} (head_dim {head_dim})"
            )
        if layer_id is not None and header.layer_id != layer_id:
            raise EngramStoreError(f"{path}: holds Engram layer {header.layer_id}, expected layer {layer_id}")
        if expected_rows is not None and header.rows != expected_rows:
            raise EngramStoreError(
                f"{path}: {header.rows} rows but the config's engram_num_embeddings for layer "
                f"{header.layer_id} is {expected_rows} (a table of another model?); {WHERE_TO_GET}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, header


@dataclass(frozen=True)
class StoreStats:
    """Counters since open (or the last ``reset_stats``).

    ``rows`` / ``bytes`` / ``seconds`` are the row-source protocol's counters (docs/design.md):
    ``rows`` and ``bytes`` count distinct rows taken from storage, by reads and prefetches (a row
    served from a prefetched batch counts once, and in ``prefetch_hits``); ``rows_requested``
    counts the ids asked for, duplicates included. ``seconds`` is wall time spent inside
    :meth:`EngramStore.read` (including waits for a prefetch in flight); ``fetch_seconds`` is time
    spent fetching, on any thread.
    """

    reads: int = 0
    rows_requested: int = 0
    rows: int = 0
    bytes: int = 0
    prefetches: int = 0
    prefetch_rows: int = 0
    prefetch_hits: int = 0
    seconds: float = 0.0
    fetch_seconds: float = 0.0


@dataclass
class _Batch:
    ids: np.ndarray  # sorted unique row ids
    rows: np.ndarray  # [len(ids), row_bytes], filled when `done` resolves
    done: Future


class EngramStore:
    """Rows of one Engram layer's row file: ``read(ids) -> uint8 [N, row_bytes]``."""

    MODES = ("pread", "mmap", "ram", "auto")

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        mode: str = "auto",
        expected_rows: int | None = None,
        layer_id: int | None = None,
        head_dim: int | None = None,
        threads: int = 8,
        rows_per_task: int = 8,
        prefetch_depth: int = 4,
        nocache: bool = False,
        verify: bool = False,
    ):
        if mode not in self.MODES:
            raise EngramStoreError(f"mode {mode!r} is not one of {self.MODES}")
        if threads < 1 or rows_per_task < 1 or prefetch_depth < 1:
            raise EngramStoreError("threads, rows_per_task and prefetch_depth must be >= 1")
        self.path = Path(path)
        self.mode = "pread" if mode == "auto" else mode
        self._fd, self.header = open_row_file(
            self.path, expected_rows=expected_rows, layer_id=layer_id, head_dim=head_dim
        )
        self.rows, self.row_bytes = self.header.rows, self.header.row_bytes
        self._threads, self._rows_per_task = threads, rows_per_task
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._batches: deque[_Batch] = deque(maxlen=prefetch_depth)
        self._closed = False
        self._mmap: mmap.mmap | None = None
        self._table: np.ndarray | None = None  # mmap / ram modes: [rows, row_bytes]
        self._io_pool = ThreadPoolExecutor(threads, thread_name_prefix="engram-io") if threads > 1 else None
        self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="engram-prefetch")
        try:
            self._advise(nocache)
            if verify:
                self.verify()
            if self.mode == "mmap":
                self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
                self._mmap.madvise(mmap.MADV_RANDOM)
                self._table = np.frombuffer(
                    self._mmap, np.uint8, self.rows * self.row_bytes, self.header.data_offset
                ).reshape(self.rows, self.row_bytes)
            elif self.mode == "ram":
                self._table = np.empty((self.rows, self.row_bytes), np.uint8)
                read_exact(self._fd, self._table, self.header.data_offset, self.path)
                if hasattr(os, "posix_fadvise"):  # no second copy in the page cache
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            self.close()
            raise

    def _advise(self, nocache: bool) -> None:
        if sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(self._fd, _F_RDAHEAD, 0)
            if nocache or self.mode == "ram":  # ram: no second copy in the buffer cache
                fcntl.fcntl(self._fd, _F_NOCACHE, 1)
        elif hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    # -- public API -------------------------------------------------------------------------------

    def read(self, row_ids: np.ndarray) -> np.ndarray:
        """Rows ``row_ids`` (int64 [N]) as uint8 [N, row_bytes]; each distinct row is fetched once."""
        t0 = time.perf_counter()
        ids = self._check_ids(row_ids)
        uniq, inverse = np.unique(ids, return_inverse=True)
        rows = np.empty((len(uniq), self.row_bytes), np.uint8)
        need = np.ones(len(uniq), bool)
        with self._lock:
            batches = list(self._batches)
        hits = 0
        for batch in reversed(batches):  # newest first
            if not need.any():
                break
            if not len(batch.ids):
                continue
            pos = np.minimum(np.searchsorted(batch.ids, uniq), len(batch.ids) - 1)
            hit = need & (batch.ids[pos] == uniq)
            if hit.any():
                batch.done.result()  # waits if in flight; re-raises a failed prefetch's error
                rows[hit] = batch.rows[pos[hit]]
                need &= ~hit
                hits += int(hit.sum())
        if need.all():
            self._fetch(uniq, rows)
        elif need.any():
            missing = np.empty((int(need.sum()), self.row_bytes), np.uint8)
            self._fetch(uniq[need], missing)
            rows[need] = missing
        out = rows[inverse.reshape(-1)]
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                reads=s.reads + 1,
                rows_requested=s.rows_requested + len(ids),
                prefetch_hits=s.prefetch_hits + hits,
                seconds=s.seconds + time.perf_counter() - t0,
            )
        return out

    def prefetch(self, row_ids: np.ndarray) -> None:
        """Start fetching rows in the background; a later ``read`` takes them from memory."""
        uniq = np.unique(self._check_ids(row_ids))
        rows = np.empty((len(uniq), self.row_bytes), np.uint8)
        with self._lock:
            self._check_open()
            self._batches.append(_Batch(uniq, rows, self._prefetch_pool.submit(self._fetch, uniq, rows)))
            s = self._stats
            self._stats = replace(s, prefetches=s.prefetches + 1, prefetch_rows=s.prefetch_rows + len(uniq))

    @property
    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = StoreStats()

    def verify(self) -> None:
        """Re-read the whole data region and check every chunk checksum (slow: ~a minute per 100 GB)."""
        h = self.header
        for k in range(h.n_chunks):
            lo, hi = h.chunk_range(k)
            buf = np.empty((hi - lo) * self.row_bytes, np.uint8)
            read_exact(self._fd, buf, h.data_offset + lo * self.row_bytes, self.path)
            if chunk_digest(buf) != h.digest_of(k):
                raise EngramStoreError(f"{self.path}: rows {lo}..{hi - 1} (chunk {k}) fail their checksum")

    def close(self) -> None:
        """Wait for prefetches in flight, then release threads, the mapping and the descriptor."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._prefetch_pool.shutdown(wait=True)
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=True)
        self._batches.clear()
        self._table = None  # drop the numpy view before closing the map it points into
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        os.close(self._fd)

    def __enter__(self) -> EngramStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- fetching ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngramStoreError(f"{self.path}: store is closed")

    def _check_ids(self, row_ids) -> np.ndarray:
        self._check_open()
        ids = np.asarray(row_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise EngramStoreError(
                f"{self.path}: row ids must be a 1-D integer array, got {ids.dtype} {list(ids.shape)}"
            )
        ids = ids.astype(np.int64, copy=False)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.rows):
            bad = int(ids[(ids < 0) | (ids >= self.rows)][0])
            raise EngramStoreError(f"{self.path}: row id {bad} outside [0, {self.rows})")
        return ids

    def _fetch(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out[i]`` with row ``ids[i]`` from storage (ids sorted and distinct)."""
        if not len(ids):
            return
        t0 = time.perf_counter()
        if self._table is not None:
            np.take(self._table, ids, axis=0, out=out)
        else:
            # split into up to `threads` runs of >= rows_per_task rows; this thread takes the first
            tasks = min(self._threads, -(-len(ids) // self._rows_per_task))
            bounds = [len(ids) * t // tasks for t in range(tasks + 1)]
            futures = [
                self._io_pool.submit(self._pread_rows, ids, out, bounds[t], bounds[t + 1]) for t in range(1, tasks)
            ]
            self._pread_rows(ids, out, bounds[0], bounds[1])
            for f in futures:
                f.result()
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                rows=s.rows + len(ids),
                bytes=s.bytes + out.nbytes,
                fetch_seconds=s.fetch_seconds + time.perf_counter() - t0,
            )

    def _pread_rows(self, ids: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
        """Rows ``ids[lo:hi]`` into ``out[lo:hi]``, one positioned read each."""
        rb, fd = self.row_bytes, self._fd
        view = memoryview(out).cast("B")  # out is C-contiguous [len(ids), row_bytes]
        offsets = (self.header.data_offset + ids[lo:hi] * rb).tolist()
        for i, offset in enumerate(offsets, lo):
            if os.preadv(fd, [view[i * rb : (i + 1) * rb]], offset) != rb:
                raise EngramStoreError(f"{self.path}: short read at row {int(ids[i])} (file truncated?)")
