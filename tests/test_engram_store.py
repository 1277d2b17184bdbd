"""mlx_dsv41/engram_store.py: every mode returns exactly the source rows; distinct rows are fetched
once per call; prefetched rows are served without a second read; bad files and requests fail
with a one-line error naming the file."""

import hashlib
import os
import threading

import numpy as np
import pytest
from test_engram_rows import CHUNK, HEAD_DIM, ROW_BYTES, ROWS, engram_table

from mlx_dsv41.convert.engram_rows import table_from_arrays, write_engram_rows
from mlx_dsv41.engram_store import EngramStore, EngramStoreError, StoreStats, row_file_name

MODES = ["pread", "mmap", "ram", "auto"]


@pytest.fixture(scope="module")
def table():
    values, scales = engram_table(11)
    return np.concatenate([values, scales], axis=1)  # the reference rows, [ROWS, 264]


@pytest.fixture(scope="module")
def row_file(tmp_path_factory, table):
    path = tmp_path_factory.mktemp("engram") / row_file_name(1)
    write_engram_rows(table_from_arrays(table[:, :HEAD_DIM], table[:, HEAD_DIM:]), path, 1, ROWS, chunk_rows=CHUNK)
    return path


def token_ids(rng, n_tokens=3, per_token=24):
    """Row ids as a forward asks for them: random, with repeats inside and across tokens."""
    ids = rng.integers(0, ROWS, n_tokens * per_token)
    ids[5] = ids[0]
    ids[-1] = ids[7]
    ids[10] = ROWS - 1
    ids[11] = 0
    return ids.astype(np.int64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 4])
def test_rows_equal_the_source_and_duplicates_are_read_once(row_file, table, mode, threads):
    rng = np.random.default_rng(threads)
    with EngramStore(
        row_file, mode=mode, threads=threads, rows_per_task=3, expected_rows=ROWS, layer_id=1, head_dim=HEAD_DIM
    ) as store:
        assert store.mode == ("pread" if mode == "auto" else mode)
        fetched = 0
        for _ in range(4):
            ids = token_ids(rng)
            got = store.read(ids)
            assert got.dtype == np.uint8 and got.shape == (len(ids), ROW_BYTES)
            np.testing.assert_array_equal(got, table[ids])
            fetched += len(np.unique(ids))
            assert store.stats.rows == fetched  # distinct rows only
        s = store.stats
        assert (s.reads, s.rows_requested, s.bytes, s.prefetch_hits) == (4, 4 * 72, fetched * ROW_BYTES, 0)
        assert s.seconds > 0 and s.fetch_seconds > 0
        assert store.read(np.array([], np.int64)).shape == (0, ROW_BYTES)
        np.testing.assert_array_equal(store.read(np.array([3, 3, 3], np.int32)), table[[3, 3, 3]])


@pytest.mark.parametrize("mode", ["pread", "mmap", "ram"])
def test_prefetched_rows_are_not_read_again(row_file, table, mode):
    rng = np.random.default_rng(5)
    with EngramStore(row_file, mode=mode, threads=4, rows_per_task=4) as store:
        ids = token_ids(rng)
        store.prefetch(ids)
        got = store.read(ids)
        np.testing.assert_array_equal(got, table[ids])
        n = len(np.unique(ids))
        s = store.stats
        assert (s.prefetches, s.prefetch_rows, s.prefetch_hits, s.rows) == (1, n, n, n)

        # partly prefetched: only the rest is fetched
        store.reset_stats()
        nxt = token_ids(rng)
        store.prefetch(nxt[:30])
        mixed = np.concatenate([nxt, ids[:4]])
        np.testing.assert_array_equal(store.read(mixed), table[mixed])
        prefetched = set(nxt[:30].tolist()) | set(ids.tolist())  # both batches are still held
        wanted = set(mixed.tolist())
        s = store.stats
        assert s.prefetch_hits == len(wanted & prefetched)
        assert s.rows == len(set(nxt[:30].tolist())) + len(wanted - prefetched)


def test_prefetch_depth_bounds_what_is_kept(row_file, table):
    with EngramStore(row_file, mode="pread", prefetch_depth=2) as store:
        for k in range(3):
            store.prefetch(np.array([k], np.int64))
        np.testing.assert_array_equal(store.read(np.array([0, 1, 2])), table[[0, 1, 2]])
        s = store.stats
        assert (s.prefetch_hits, s.rows) == (2, 4)  # batch [0] was dropped: read again


def test_concurrent_reads_while_prefetches_are_in_flight(row_file, table):
    errors = []
    with EngramStore(row_file, mode="pread", threads=4, rows_per_task=2) as store:

        def model_thread(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(40):
                    nxt = token_ids(rng, n_tokens=2)
                    store.prefetch(nxt)
                    ids = token_ids(rng, n_tokens=1)
                    np.testing.assert_array_equal(store.read(ids), table[ids])
                    np.testing.assert_array_equal(store.read(nxt), table[nxt])
            except BaseException as e:  # surfaced below
                errors.append(e)

        workers = [threading.Thread(target=model_thread, args=(s,)) for s in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not errors, errors[0]


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("mode", ["pread", "mmap", "ram"])
def test_close_releases_descriptors_and_threads(row_file, mode):
    fds, threads = _fd_count(), threading.active_count()
    store = EngramStore(row_file, mode=mode, threads=4, rows_per_task=1)
    store.prefetch(np.arange(0, ROWS, 7))
    store.read(np.arange(40))
    store.close()
    store.close()  # idempotent
    assert (_fd_count(), threading.active_count()) == (fds, threads)
    with pytest.raises(EngramStoreError, match="store is closed"):
        store.read(np.arange(3))
    with pytest.raises(EngramStoreError, match="store is closed"):
        store.prefetch(np.arange(3))


def test_bad_requests(row_file):
    with EngramStore(row_file) as store:
        for ids, message in [
            (np.array([0, ROWS]), rf"row id {ROWS} outside \[0, {ROWS}\)"),
            (np.array([-1]), r"row id -1 outside"),
            (np.array([1.0, 2.0]), r"row ids must be a 1-D integer array, got float64 \[2\]"),
            (np.zeros((2, 2), np.int64), r"1-D integer array, got int64 \[2, 2\]"),
        ]:
            with pytest.raises(EngramStoreError, match=message):
                store.read(ids)
            with pytest.raises(EngramStoreError, match=message):
                store.prefetch(ids)
        assert store.stats == StoreStats()
    with pytest.raises(EngramStoreError, match=r"mode 'fast' is not one of"):
        EngramStore(row_file, mode="fast")


def _corrupt(src, dst, offset, data: bytes):
    blob = bytearray(src.read_bytes())
    blob[offset : offset + len(data)] = data
    dst.write_bytes(bytes(blob))


def _rehash_header(src, dst, offset, data: bytes):
    """Change a header field and recompute the header checksum, as a buggy writer would."""
    _corrupt(src, dst, offset, data)
    blob = bytearray(dst.read_bytes())
    table = bytes(blob[128 : 128 + 32 * (ROWS // CHUNK + 1)])
    blob[96:128] = hashlib.sha256(bytes(blob[:96]) + table).digest()
    dst.write_bytes(bytes(blob))


def test_bad_files(row_file, tmp_path):
    bad = tmp_path / "bad.rows"
    size = row_file.stat().st_size
    cases = [
        (lambda: _corrupt(row_file, bad, 0, b"NOTENGRM"), {}, r"not an Engram row file \(magic b'NOTENGRM'"),
        (
            lambda: _corrupt(row_file, bad, 8, (2).to_bytes(4, "little")),
            {},
            r"format version 2; this reader knows version 1",
        ),
        (
            lambda: _corrupt(row_file, bad, 28, (300).to_bytes(4, "little")),
            {},
            r"row bytes 300 do not fit head_dim 256",
        ),
        (lambda: _corrupt(row_file, bad, 12, (14).to_bytes(4, "little")), {}, r"header checksum mismatch"),
        (lambda: _corrupt(row_file, bad, 64, b"\x00"), {}, r"header checksum mismatch"),
        (lambda: _rehash_header(row_file, bad, 64, b"\x00"), {}, r"data checksum does not match the chunk table"),
        (
            lambda: bad.write_bytes(row_file.read_bytes()[: size - 1]),
            {},
            rf"truncated: {size - 1} bytes, the header needs {size}",
        ),
        (lambda: bad.write_bytes(row_file.read_bytes() + b"\x00"), {}, r"1 trailing bytes after the last row"),
        (lambda: bad.write_bytes(row_file.read_bytes()[:100]), {}, r"100 bytes is too short"),
        (
            lambda: bad.write_bytes(row_file.read_bytes()),
            {"expected_rows": 384006168},
            r"5000 rows but the config's engram_num_embeddings for layer 1 is 384006168 .*model-00047-of-00048",
        ),
        (lambda: bad.write_bytes(row_file.read_bytes()), {"layer_id": 14}, r"holds Engram layer 1, expected layer 14"),
        (
            lambda: bad.write_bytes(row_file.read_bytes()),
            {"head_dim": 512},
            r"rows of 264 bytes \(head_dim 256\), the config needs 528",
        ),
    ]
    for make, kwargs, message in cases:
        make()
        with pytest.raises(EngramStoreError, match=message) as e:
            EngramStore(bad, **kwargs)
        assert str(e.value).startswith(str(bad)) and "\n" not in str(e.value)
    with pytest.raises(EngramStoreError, match=r"no Engram row file; .*model-00047-of-00048 and model-00048-of-00048"):
        EngramStore(tmp_path / "missing.rows")


def test_verify_finds_damaged_rows(row_file, tmp_path):
    bad = tmp_path / "bad.rows"
    row = 3 * CHUNK + 17  # in chunk 3
    _corrupt(row_file, bad, 16384 + row * ROW_BYTES + 260, b"\xff")  # a scale byte
    with EngramStore(bad) as store:  # opening checks the header only
        with pytest.raises(
            EngramStoreError, match=rf"rows {3 * CHUNK}..{4 * CHUNK - 1} \(chunk 3\) fail their checksum"
        ):
            store.verify()
    with pytest.raises(EngramStoreError, match=r"\(chunk 3\) fail their checksum"):
        EngramStore(bad, verify=True)
    EngramStore(row_file, verify=True).close()
