"""mlx_dsv41/convert/safetensors_io.py: files written by the reference `safetensors` library read back exactly;
every malformed file is refused on open with a one-line error naming the file and tensor."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors import TensorSpec

from mlx_dsv41.convert.safetensors_io import (
    INDEX_NAME,
    SafetensorsCheckpoint,
    SafetensorsError,
    SafetensorsFile,
)

# safetensors dtype -> (reference writer's dtype name, numpy dtype for random test data)
_REF = {
    "BOOL": ("bool", np.bool_),
    "U8": ("uint8", np.uint8),
    "I8": ("int8", np.int8),
    "I16": ("int16", np.int16),
    "U16": ("uint16", np.uint16),
    "I32": ("int32", np.int32),
    "U32": ("uint32", np.uint32),
    "I64": ("int64", np.int64),
    "U64": ("uint64", np.uint64),
    "F16": ("float16", np.float16),
    "BF16": ("bfloat16", ml_dtypes.bfloat16),
    "F32": ("float32", np.float32),
    "F64": ("float64", np.float64),
    "F8_E4M3": ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
    "F8_E5M2": ("float8_e5m2", ml_dtypes.float8_e5m2),
    "F8_E8M0": ("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu),
}


def save_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: (safetensors dtype, array)} with the reference library (independent writer)."""
    arrays = {k: np.ascontiguousarray(a) for k, (_, a) in tensors.items()}
    specs = {
        k: TensorSpec(dtype=_REF[dt][0], shape=list(a.shape), data_ptr=arrays[k].ctypes.data, data_len=arrays[k].nbytes)
        for k, (dt, a) in tensors.items()
    }
    safetensors.serialize_file(specs, str(path), metadata)


def random_tensor(rng, dtype: str, shape) -> np.ndarray:
    """Random non-zero, finite values of the dtype (raw bytes for the 8-bit float formats)."""
    np_dtype = _REF[dtype][1]
    if dtype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("F8_"):
        raw = rng.integers(1, 0x7F, shape, dtype=np.uint8)  # finite, non-zero encodings
        return raw.view(np_dtype)
    if np.issubdtype(np_dtype, np.integer):
        info = np.iinfo(np_dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, dtype=np_dtype)
    return (rng.standard_normal(shape) + 3.0).astype(np_dtype)


def raw_bits(a: np.ndarray) -> np.ndarray:
    """What the reader returns for `a`: its storage bits for the types numpy lacks."""
    if a.dtype == ml_dtypes.bfloat16:
        return a.view(np.uint16)
    if a.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu):
        return a.view(np.uint8)
    return a


def write_raw(path, header: dict, data: bytes, header_len: int | None = None) -> None:
    """A hand-made file, for headers the reference writer would never produce."""
    text = json.dumps(header).encode()
    n = len(text) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + text + data)


@pytest.fixture
def rng():
    return np.random.default_rng(3)


def test_every_dtype_round_trips_whole_and_by_rows(tmp_path, rng):
    tensors = {f"t.{dt}": (dt, random_tensor(rng, dt, (7, 3, 5))) for dt in _REF}
    tensors["scalar"] = ("F32", np.array(2.5, np.float32))
    tensors["empty"] = ("BF16", np.zeros((0, 4), ml_dtypes.bfloat16))
    save_safetensors(tmp_path / "a.safetensors", tensors, metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "a.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        assert sorted(f.names()) == sorted(tensors)
        for name, (dt, a) in tensors.items():
            info = f.info(name)
            assert (info.dtype, info.shape) == (dt, a.shape)
            got, want = f.read(name), raw_bits(a)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            if a.ndim:
                for lo, hi in [(0, a.shape[0]), (2, 5), (6, 7), (3, 3)]:
                    if hi <= a.shape[0]:
                        np.testing.assert_array_equal(f.read_rows(name, lo, hi), want[lo:hi])


def test_row_read_touches_only_the_rows(tmp_path):
    """A 256 MiB (sparse) tensor: reading 2 rows reads ~2 rows of bytes, not the tensor."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io")
    rows, width = 1 << 20, 256
    path = tmp_path / "big.safetensors"
    write_raw(path, {"big": {"dtype": "U8", "shape": [rows, width], "data_offsets": [0, rows * width]}}, b"")
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size + rows * width)
    with SafetensorsFile(path) as f:
        payload = b"row 1000 bytes!!" * 16
        with open(path, "r+b") as fh:
            fh.seek(f.info("big").offset + 1000 * width)
            fh.write(payload)

        def rchar():
            with open("/proc/self/io") as io:
                return int(next(line for line in io if line.startswith("rchar")).split()[1])

        before = rchar()
        got = f.read_rows("big", 1000, 1002)
        assert rchar() - before < 64 << 10
    assert got[0].tobytes() == payload and got.shape == (2, width)


def test_checkpoint_with_index(tmp_path, rng):
    a, b, c = (random_tensor(rng, "F32", (4, 6)) for _ in range(3))
    save_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("F32", a), "b": ("F32", b)})
    save_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": ("F32", c)})
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert [p.name for p in ckpt.shards()] == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
        assert ckpt.names(ckpt.shards()[0]) == ["a", "b"]
        np.testing.assert_array_equal(ckpt.read("c"), c)
        np.testing.assert_array_equal(ckpt.read_rows("a", 1, 3), a[1:3])
        with pytest.raises(SafetensorsError, match=r"no tensor 'd'"):
            ckpt.read("d")

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SafetensorsError, match=r"shard model-00002-of-00002.safetensors is missing.*'c'"):
        SafetensorsCheckpoint(tmp_path)

    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match=r"index puts 'c' in model-00001-of-00002.safetensors, which lacks it"):
        SafetensorsCheckpoint(tmp_path).read("c")

    index["weight_map"]["c"] = "../elsewhere.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="not a plain file name"):
        SafetensorsCheckpoint(tmp_path)

    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(SafetensorsError, match=f"{INDEX_NAME}: not valid JSON"):
        SafetensorsCheckpoint(tmp_path)


def test_checkpoint_without_index_and_single_file(tmp_path, rng):
    a, b = random_tensor(rng, "I32", (3, 2)), random_tensor(rng, "F16", (5,))
    save_safetensors(tmp_path / "x.safetensors", {"a": ("I32", a)})
    save_safetensors(tmp_path / "y.safetensors", {"b": ("F16", b)})
    np.testing.assert_array_equal(SafetensorsCheckpoint(tmp_path).read("b"), b)
    np.testing.assert_array_equal(SafetensorsCheckpoint(tmp_path / "x.safetensors").read("a"), a)
    save_safetensors(tmp_path / "z.safetensors", {"a": ("I32", a)})
    with pytest.raises(SafetensorsError, match=r"'a' is in both x.safetensors and z.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(SafetensorsError, match="no such file or directory"):
        SafetensorsCheckpoint(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SafetensorsError, match="no model.safetensors.index.json and no"):
        SafetensorsCheckpoint(empty)


def _entry(dtype, shape, lo, hi):
    return {"dtype": dtype, "shape": shape, "data_offsets": [lo, hi]}


GOOD = {"w": _entry("F8_E4M3", [4, 8], 0, 32), "s": _entry("F8_E8M0", [4, 1], 32, 36)}

BAD_FILES = {
    # name: (header, data bytes, header length override, expected message)
    "truncated data": (GOOD, bytes(30), None, r"truncated: tensor 's' ends at data byte 36 but the file holds 30"),
    "trailing bytes": (GOOD, bytes(40), None, r"4 trailing bytes after the last tensor 's'"),
    "lying size": (
        {"w": _entry("F8_E4M3", [4, 8], 0, 36)},
        bytes(36),
        None,
        r"tensor 'w': header lies about its size: F8_E4M3 \[4, 8\] is 32 bytes but data_offsets span 36",
    ),
    "overlap": (
        {"a": _entry("U8", [8], 0, 8), "b": _entry("U8", [8], 4, 12)},
        bytes(12),
        None,
        r"tensors 'a' and 'b' overlap",
    ),
    "hole": (
        {"a": _entry("U8", [8], 0, 8), "b": _entry("U8", [8], 10, 18)},
        bytes(18),
        None,
        r"hole of 2 bytes before tensor 'b'",
    ),
    "unknown dtype": ({"w": _entry("F4", [4, 8], 0, 16)}, bytes(16), None, r"tensor 'w': unknown dtype 'F4'"),
    "negative shape": ({"w": _entry("U8", [-4], 0, 0)}, b"", None, r"tensor 'w': shape \[-4\] is not"),
    "bad offsets": ({"w": _entry("U8", [4], 4, 0)}, bytes(4), None, r"tensor 'w': data_offsets \[4, 0\]"),
    "missing key": (
        {"w": {"dtype": "U8", "shape": [4]}},
        bytes(4),
        None,
        r"tensor 'w': entry must have exactly dtype, shape and data_offsets",
    ),
    "bad metadata": ({"__metadata__": {"a": 1}, **GOOD}, bytes(36), None, r"__metadata__ must map strings"),
    "header past end": (GOOD, b"", 10_000, r"truncated: header claims 10000 bytes"),
    "huge header": (GOOD, b"", 1 << 40, r"header length \d+ is implausible"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_malformed_files_are_refused_on_open(tmp_path, case):
    header, data, header_len, message = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data, header_len)
    with pytest.raises(SafetensorsError, match=message) as e:
        SafetensorsFile(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_garbage_headers_are_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="2 bytes is too short"):
        SafetensorsFile(path)
    for text, message in [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "not an object"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b"\xff\xfe", "not valid JSON"),
    ]:
        path.write_bytes(struct.pack("<Q", len(text)) + text)
        with pytest.raises(SafetensorsError, match=message):
            SafetensorsFile(path)
    with pytest.raises(SafetensorsError, match="no such file"):
        SafetensorsFile(tmp_path / "missing.safetensors")


def test_bad_reads(tmp_path, rng):
    path = tmp_path / "a.safetensors"
    save_safetensors(path, {"w": ("U8", random_tensor(rng, "U8", (4, 3))), "s": ("F32", np.array(1.0, np.float32))})
    with SafetensorsFile(path) as f:
        with pytest.raises(SafetensorsError, match=r"a.safetensors: no tensor 'x'"):
            f.read("x")
        with pytest.raises(SafetensorsError, match=r"tensor 'w': rows \[3, 5\) outside \[0, 4\)"):
            f.read_rows("w", 3, 5)
        with pytest.raises(SafetensorsError, match=r"tensor 'w': rows \[2, 1\)"):
            f.read_rows("w", 2, 1)
        with pytest.raises(SafetensorsError, match="is a scalar"):
            f.read_rows("s", 0, 1)
    # A file that shrinks after open is reported when read, not returned short.
    with SafetensorsFile(path) as f:
        os.truncate(path, f.info("w").offset + 5)
        with pytest.raises(SafetensorsError, match=r"tensor 'w': file ends 7 bytes early"):
            f.read("w")
