"""mlx_dsv41/convert/engram_rows.py: row files hold exactly the source rows at the documented layout, from
arrays or from official-format safetensors shards; interrupted writes resume and never leave a
file that opens; a second write over a finished file is a no-op."""

import fcntl
import hashlib
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from test_safetensors_io import save_safetensors

from mlx_dsv41.convert.engram_rows import (
    PARTIAL_SUFFIX,
    EngramTable,
    table_from_arrays,
    table_from_checkpoint,
    write_engram_rows,
)
from mlx_dsv41.convert.safetensors_io import SafetensorsCheckpoint, SafetensorsError
from mlx_dsv41.engram_store import EngramStore, EngramStoreError

ROWS, HEAD_DIM, CHUNK = 5000, 256, 512  # 10 chunks, the last one partial (392 rows)
ROW_BYTES = HEAD_DIM + HEAD_DIM // 32


def engram_table(seed: int, rows: int = ROWS, head_dim: int = HEAD_DIM):
    """Random FP8 table bytes: finite non-zero e4m3 values, e8m0 scales around 2^0."""
    rng = np.random.default_rng(seed)
    values = rng.integers(1, 0x7F, (rows, head_dim), dtype=np.uint8)
    values |= rng.integers(0, 2, (rows, head_dim), dtype=np.uint8) << 7  # random sign
    scales = rng.integers(112, 136, (rows, head_dim // 32), dtype=np.uint8)
    return values, scales


def expected_file(values, scales, layer_id, chunk_rows=CHUNK) -> bytes:
    """The row file built independently from the format description in engram_store's docstring."""
    rows = np.concatenate([values, scales], axis=1)
    n_chunks = -(-len(rows) // chunk_rows)
    digests = b"".join(
        hashlib.sha256(rows[k * chunk_rows : (k + 1) * chunk_rows].tobytes()).digest() for k in range(n_chunks)
    )
    data_offset = -(-(128 + 32 * n_chunks) // 16384) * 16384
    prefix = struct.pack(
        "<8sIIQIIQQQQ32s",
        b"DSV41ENG",
        1,
        layer_id,
        len(rows),
        values.shape[1],
        rows.shape[1],
        data_offset,
        chunk_rows,
        n_chunks,
        n_chunks,
        hashlib.sha256(digests).digest(),
    )
    header = prefix + hashlib.sha256(prefix + digests).digest() + digests
    return header + bytes(data_offset - len(header)) + rows.tobytes()


class CountingTable:
    """Wraps a table: records which row ranges were read, optionally fails at one chunk."""

    def __init__(self, values, scales, fail_at_row: int | None = None):
        self.inner = table_from_arrays(values, scales)
        self.reads: list[tuple[int, int]] = []
        self.fail_at_row = fail_at_row

    def table(self) -> EngramTable:
        def read(lo, hi):
            if self.fail_at_row is not None and lo <= self.fail_at_row < hi:
                raise KeyboardInterrupt("simulated interruption")
            self.reads.append((lo, hi))
            return self.inner.read(lo, hi)

        return EngramTable(self.inner.rows, self.inner.head_dim, read, "counting table")


def test_file_layout_matches_the_format(tmp_path):
    values, scales = engram_table(1)
    out = tmp_path / "l1.rows"
    progress = []
    status = write_engram_rows(
        table_from_arrays(values, scales),
        out,
        1,
        ROWS,
        chunk_rows=CHUNK,
        progress=lambda done, total: progress.append((done, total)),
    )
    assert status == "written"
    data = out.read_bytes()
    assert data == expected_file(values, scales, 1)
    assert progress[0] == (0, ROWS) and progress[-1] == (ROWS, ROWS) and len(progress) == 11
    assert not (tmp_path / ("l1.rows" + PARTIAL_SUFFIX)).exists()
    with EngramStore(out, expected_rows=ROWS, layer_id=1, head_dim=HEAD_DIM) as store:
        assert store.header.data_offset % 16384 == 0 and store.row_bytes == 264
        store.verify()


def test_small_head_dim_and_single_chunk(tmp_path):
    values, scales = engram_table(2, rows=77, head_dim=64)
    out = tmp_path / "small.rows"
    write_engram_rows(table_from_arrays(values, scales), out, 14, 77, chunk_rows=1000)
    assert out.read_bytes() == expected_file(values, scales, 14, chunk_rows=1000)


def official_shard(tmp_path, layer, values, scales):
    """An official-release-style shard: the table pair in real F8 dtypes, plus an unrelated tensor."""
    tensors = {
        f"layers.{layer}.engram.embed.weight": ("F8_E4M3", values.view(ml_dtypes.float8_e4m3fn)),
        f"layers.{layer}.engram.embed.scale": ("F8_E8M0", scales.view(ml_dtypes.float8_e8m0fnu)),
        f"layers.{layer}.engram.q_weight": ("BF16", np.ones((4, 8), ml_dtypes.bfloat16)),
    }
    path = tmp_path / "model-00047-of-00048.safetensors"
    save_safetensors(path, tensors)
    return path


def test_from_safetensors_equals_from_arrays(tmp_path):
    values, scales = engram_table(3)
    shard = official_shard(tmp_path, 14, values, scales)
    out = tmp_path / "l14.rows"
    with SafetensorsCheckpoint(shard) as ckpt:
        table = table_from_checkpoint(ckpt, 14)
        assert (table.rows, table.head_dim) == (ROWS, HEAD_DIM)
        assert write_engram_rows(table, out, 14, ROWS, chunk_rows=CHUNK) == "written"
    assert out.read_bytes() == expected_file(values, scales, 14)


def test_bad_sources(tmp_path):
    values, scales = engram_table(4)
    table = table_from_arrays(values, scales)
    with pytest.raises(
        EngramStoreError,
        match=r"5000 rows but the config's engram_num_embeddings for "
        r"layer 1 is 384006168.*model-00047-of-00048",
    ):
        write_engram_rows(table, tmp_path / "x.rows", 1, 384006168)
    with pytest.raises(EngramStoreError, match="does not exist"):
        write_engram_rows(table, tmp_path / "nodir" / "x.rows", 1, ROWS)
    with pytest.raises(EngramStoreError, match="must be uint8"):
        table_from_arrays(values.astype(np.int16), scales)
    with pytest.raises(EngramStoreError, match=r"values \[5000, 256\] and scales \[5000, 4\]"):
        table_from_arrays(values, scales[:, :4])

    shard = official_shard(tmp_path, 14, values, scales)
    with SafetensorsCheckpoint(shard) as ckpt:
        with pytest.raises(
            EngramStoreError,
            match=r"no layers.1.engram.embed.weight.*model-00047-of-00048 "
            r"and model-00048-of-00048",
        ):
            table_from_checkpoint(ckpt, 1)
    save_safetensors(
        shard,
        {
            "layers.1.engram.embed.weight": ("U8", values),
            "layers.1.engram.embed.scale": ("F8_E8M0", scales.view(ml_dtypes.float8_e8m0fnu)),
        },
    )
    with SafetensorsCheckpoint(shard) as ckpt:
        with pytest.raises(SafetensorsError, match="is U8 and .* is F8_E8M0, expected F8_E4M3 and F8_E8M0"):
            table_from_checkpoint(ckpt, 1)
    save_safetensors(
        shard,
        {
            "layers.1.engram.embed.weight": ("F8_E4M3", values.view(ml_dtypes.float8_e4m3fn)),
            "layers.1.engram.embed.scale": ("F8_E8M0", scales[:10].view(ml_dtypes.float8_e8m0fnu)),
        },
    )
    with SafetensorsCheckpoint(shard) as ckpt:
        with pytest.raises(SafetensorsError, match=r"\[5000, 256\] and .* \[10, 8\] are not"):
            table_from_checkpoint(ckpt, 1)


def test_interrupted_write_resumes_without_redoing_chunks(tmp_path):
    values, scales = engram_table(5)
    out = tmp_path / "l1.rows"
    partial = tmp_path / ("l1.rows" + PARTIAL_SUFFIX)
    first = CountingTable(values, scales, fail_at_row=4 * CHUNK + 10)  # dies reading chunk 4
    with pytest.raises(KeyboardInterrupt):
        write_engram_rows(first.table(), out, 1, ROWS, chunk_rows=CHUNK)
    assert not out.exists() and partial.exists()
    for path in (out, partial):  # nothing opens as a valid row file
        with pytest.raises(EngramStoreError, match=r"no Engram row file|unfinished \(4 of 10 chunks\)"):
            EngramStore(path)

    second = CountingTable(values, scales)
    assert write_engram_rows(second.table(), out, 1, ROWS, chunk_rows=CHUNK) == "resumed"
    # chunk 0 and chunk 3 are re-read to check the source and the last write, then chunks 4..9
    assert second.reads == [(0, CHUNK), (3 * CHUNK, 4 * CHUNK)] + [
        (k * CHUNK, min(ROWS, (k + 1) * CHUNK)) for k in range(4, 10)
    ]
    assert out.read_bytes() == expected_file(values, scales, 1) and not partial.exists()


def test_interrupted_write_restarts_when_the_partial_cannot_be_trusted(tmp_path):
    values, scales = engram_table(6)
    out = tmp_path / "l1.rows"
    partial = tmp_path / ("l1.rows" + PARTIAL_SUFFIX)

    def interrupt(v, s):
        with pytest.raises(KeyboardInterrupt):
            write_engram_rows(CountingTable(v, s, fail_at_row=3 * CHUNK).table(), out, 1, ROWS, chunk_rows=CHUNK)

    # another source table: restart from scratch
    other_values, other_scales = engram_table(7)
    interrupt(other_values, other_scales)
    assert write_engram_rows(table_from_arrays(values, scales), out, 1, ROWS, chunk_rows=CHUNK) == "written"
    assert out.read_bytes() == expected_file(values, scales, 1)
    out.unlink()

    # the last recorded chunk damaged on disk (a lost write): restart
    interrupt(values, scales)
    with open(partial, "r+b") as fh:
        fh.seek(16384 + 2 * CHUNK * ROW_BYTES + 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x40]))
    assert write_engram_rows(table_from_arrays(values, scales), out, 1, ROWS, chunk_rows=CHUNK) == "written"
    assert out.read_bytes() == expected_file(values, scales, 1)
    out.unlink()

    # a damaged header: restart
    interrupt(values, scales)
    with open(partial, "r+b") as fh:
        fh.seek(130)
        fh.write(b"\x00\x01")
    assert write_engram_rows(table_from_arrays(values, scales), out, 1, ROWS, chunk_rows=CHUNK) == "written"
    assert out.read_bytes() == expected_file(values, scales, 1)


def test_second_write_is_a_no_op_and_a_different_table_is_refused(tmp_path):
    values, scales = engram_table(8)
    out = tmp_path / "l1.rows"
    write_engram_rows(table_from_arrays(values, scales), out, 1, ROWS, chunk_rows=CHUNK)
    before = out.stat()
    again = CountingTable(values, scales)
    # a different chunk size asked for: the finished file's own chunking is what gets compared
    assert write_engram_rows(again.table(), out, 1, ROWS, chunk_rows=1000) == "unchanged"
    assert sorted(again.reads) == [(0, CHUNK), (9 * CHUNK, ROWS)]
    after = out.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)

    changed = values.copy()
    changed[ROWS - 1, 0] ^= 1
    with pytest.raises(EngramStoreError, match="exists but holds a different table; delete it"):
        write_engram_rows(table_from_arrays(changed, scales), out, 1, ROWS, chunk_rows=CHUNK)
    with pytest.raises(EngramStoreError, match="holds Engram layer 1, expected layer 14"):
        write_engram_rows(table_from_arrays(values, scales), out, 14, ROWS, chunk_rows=CHUNK)


def test_concurrent_writer_is_refused(tmp_path):
    values, scales = engram_table(9)
    out = tmp_path / "l1.rows"
    fd = os.open(tmp_path / ("l1.rows" + PARTIAL_SUFFIX), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(EngramStoreError, match=r"l1.rows.partial: another process is writing it"):
            write_engram_rows(table_from_arrays(values, scales), out, 1, ROWS, chunk_rows=CHUNK)
    finally:
        os.close(fd)
    assert write_engram_rows(table_from_arrays(values, scales), out, 1, ROWS, chunk_rows=CHUNK) == "written"
    assert out.read_bytes() == expected_file(values, scales, 1)
