"""mlx_dsv41/convert/safetensors_writer.py: files written tensor by tensor (whole or in row chunks) are read
back exactly by the reference `safetensors` library and by mx.load; misuse is refused and leaves
no file under the final name."""

import mlx.core as mx
import numpy as np
import pytest
import safetensors
from test_safetensors_io import random_tensor, raw_bits

from mlx_dsv41.convert.safetensors_io import DTYPES, SafetensorsError
from mlx_dsv41.convert.safetensors_writer import PARTIAL_SUFFIX, SafetensorsWriter, write_safetensors


def test_reference_reader_sees_every_tensor(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t.{dt}": (dt, raw_bits(random_tensor(rng, dt, (5, 3)))) for dt in DTYPES}
    tensors["scalar"] = ("I32", np.array(-7, np.int32))
    tensors["empty"] = ("F16", np.zeros((0, 4), np.float16))
    path = write_safetensors(tmp_path / "a.safetensors", tensors, {"format": "mlx"})
    raw = path.read_bytes()
    assert int.from_bytes(raw[:8], "little") % 8 == 0
    got = dict(safetensors.deserialize(raw))
    assert set(got) == set(tensors)
    for name, (dt, a) in tensors.items():
        assert got[name]["dtype"] == dt and list(got[name]["shape"]) == list(a.shape)
        assert bytes(got[name]["data"]) == a.tobytes()
    # mx.load (which has no F64) reads what the converter writes
    mlx_dtypes = ("U8", "I8", "I16", "U32", "I32", "F16", "BF16", "F32", "F8_E4M3", "F8_E8M0")
    path = write_safetensors(
        tmp_path / "m.safetensors",
        {**{f"t.{dt}": tensors[f"t.{dt}"] for dt in mlx_dtypes}, "scalar": tensors["scalar"]},
    )
    loaded = mx.load(str(path))
    for dt in mlx_dtypes:
        a, want = loaded[f"t.{dt}"], tensors[f"t.{dt}"][1]
        got_raw = np.array(a.view(mx.uint16)) if dt == "BF16" else np.array(a)
        assert got_raw.dtype.itemsize == want.dtype.itemsize and got_raw.tobytes() == want.tobytes(), dt
    assert loaded["scalar"].shape == () and int(loaded["scalar"].item()) == -7


def test_row_chunks_equal_one_piece(tmp_path):
    a = np.arange(7 * 6, dtype=np.float32).reshape(7, 6)
    b = np.arange(5, dtype=np.uint8)
    with SafetensorsWriter(tmp_path / "c.safetensors", [("a", "F32", a.shape), ("b", "U8", b.shape)]) as w:
        for lo in range(0, 7, 3):
            w.write("a", a[lo : lo + 3])
        w.write("b", b)
    whole = write_safetensors(tmp_path / "w.safetensors", {"a": ("F32", a), "b": ("U8", b)})
    assert (tmp_path / "c.safetensors").read_bytes() == whole.read_bytes()


def test_misuse_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    specs = [("a", "F32", (4, 2)), ("b", "BF16", (3,))]
    with pytest.raises(SafetensorsError, match="got tensor 'b', expected 'a' next"):
        with SafetensorsWriter(path, specs) as w:
            w.write("b", np.zeros(3, np.uint16))
    with pytest.raises(SafetensorsError, match=r"tensor 'a' is F32, stored as float32, got float64"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", np.zeros((4, 2)))
    with pytest.raises(SafetensorsError, match=r"tensor 'a' \[4, 2\]: more bytes than it holds"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", np.zeros((4, 2), np.float32))
            w.write("a", np.zeros((1, 2), np.float32))
    with pytest.raises(SafetensorsError, match=r"tensor 'a' \[4, 2\]: got a piece of shape \[4, 3\]"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", np.zeros((4, 3), np.float32))
    with pytest.raises(SafetensorsError, match="tensor 'b' was not written completely"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", np.zeros((4, 2), np.float32))
    assert not path.exists() and not path.with_name(path.name + PARTIAL_SUFFIX).exists()
