"""Engram row decoding (docs/model.md#engram-rows) and the gated projection
(docs/model.md#engram-gate) against float64 references."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.config import ModelArgs
from mlx_dsv41.model.engram import Engram, MemoryRowSource, decode_rows

ml_dtypes = pytest.importorskip("ml_dtypes")
rng = np.random.default_rng(17)
HD = 64  # engram_head_dim: 2 scales per row
ROW = HD + HD // 32


def _random_rows(n, scale_lo=100, scale_hi=150):
    values = rng.integers(0, 256, (n, HD)).astype(np.uint8)
    values[(values & 0x7F) == 0x7F] = 0x41  # e4m3 NaN codes do not occur in real tables
    scales = rng.integers(scale_lo, scale_hi, (n, HD // 32)).astype(np.uint8)
    return np.concatenate([values, scales], axis=1)


def _decode_f64(raw):
    values = raw[..., :HD].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = np.exp2(raw[..., HD:].astype(np.float64) - 127)
    return values * np.repeat(scales, 32, axis=-1)


def _bf16(a):
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_decode_rows_exact():
    raw = _random_rows(300)
    raw[:2, HD:] = [[0, 1], [253, 254]]  # extreme scales: 2^-127 (subnormal in fp32) .. 2^127
    raw[:2, :HD] = rng.integers(0x30, 0x40, (2, HD))  # moderate values, so 2^127 stays finite
    got = decode_rows(mx.array(raw), HD)
    assert got.dtype == mx.bfloat16 and got.shape == (300, HD)
    got = np.array(got.astype(mx.float32), np.float64)
    ref = _bf16(_decode_f64(raw))
    assert np.array_equal(got, ref)
    assert np.abs(got).max() > 1e30 and np.abs(got[0][got[0] != 0]).min() < 1e-35


def test_decode_rows_rejects_wrong_row_bytes():
    with pytest.raises(ValueError, match=r"Engram rows must be uint8 \[\.\.\., 66\]"):
        decode_rows(mx.zeros((3, 65), mx.uint8), HD)


def _args():
    return ModelArgs(
        hidden_size=48,
        hc_mult=4,
        engram_head_dim=HD,
        engram_n_heads=2,
        engram_max_ngram_size=3,
        num_hidden_layers=2,
        num_nextn_predict_layers=0,
        compress_ratios=(0, 0),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=-1,
        engram_layer_ids=(1,),
        engram_num_embeddings=(0,),
    )


def test_engram_matches_float64():
    args = _args()
    eng = Engram(args)
    HC, D, cols = args.hc_mult, args.hidden_size, args.engram_columns
    wkv = _bf16(rng.standard_normal(((HC + 1) * D, cols * HD)) / np.sqrt(cols * HD) * 4)
    qw, kw = _bf16(1 + 0.3 * rng.standard_normal((HC, D))), _bf16(1 + 0.3 * rng.standard_normal((HC, D)))
    eng.wkv.weight = mx.array(wkv.astype(np.float32)).astype(mx.bfloat16)
    eng.q_weight = mx.array(qw.astype(np.float32)).astype(mx.bfloat16)
    eng.k_weight = mx.array(kw.astype(np.float32)).astype(mx.bfloat16)
    B, S = 2, 6
    rows = _random_rows(B * S * cols, 118, 128).reshape(B, S, cols, ROW)
    streams = _bf16(rng.standard_normal((B, S, HC, D)))
    live = np.ones((B, S), bool)
    live[1, 2] = False  # a DEAD (image) position: gate 0, streams unchanged
    out = eng(mx.array(streams.astype(np.float32)).astype(mx.bfloat16), mx.array(rows), mx.array(live))
    assert out.dtype == mx.bfloat16
    out = np.array(out.astype(mx.float32), np.float64)

    e = _bf16(_decode_f64(rows)).reshape(B, S, -1)
    kv = _bf16(e @ wkv.T)  # the linear returns bf16
    key, value = kv[..., : HC * D].reshape(B, S, HC, D), kv[..., HC * D :]
    dot = (streams * qw * kw * key).sum(-1)
    dot = dot / np.sqrt((streams**2).mean(-1) + 1e-20) / np.sqrt((key**2).mean(-1) + 1e-20) / np.sqrt(D)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    gate[~live] = 0
    ref = streams + gate[..., None] * value[:, :, None, :]
    assert 0.05 < gate[live].min() and gate.max() < 0.95 and gate[live].std() > 0.05  # gates vary
    np.testing.assert_allclose(out, ref, rtol=2**-7, atol=1e-5)
    assert np.array_equal(out[1, 2], streams[1, 2])
    assert np.abs(out - streams).mean() > 0.1  # the Engram value actually moved the streams


def test_memory_row_source():
    table = _random_rows(50)
    src = MemoryRowSource(table)
    ids = np.array([3, 3, 49, 0])
    assert np.array_equal(src.read(ids), table[ids])
    src.prefetch(ids)
    assert src.stats.rows == 4 and src.stats.bytes == 4 * ROW
    with pytest.raises(IndexError, match=r"Engram row 50 is outside the table \(0\.\.49\)"):
        src.read(np.array([1, 50]))
    with pytest.raises(ValueError, match="uint8"):
        MemoryRowSource(table.astype(np.int16))
