"""EXL3 decoding in plain MLX (docs/exl3.md#trellis): codebook tables, known-answer states,
reconstruct bit for bit against an independent numpy decoder (tests/exl3_numpy.py) and the exllamav3
fixture."""

import hashlib
from pathlib import Path

import exl3_numpy
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from mlx_dsv41.exl3 import codebook_table, dequantize, k2_from_trellis_shape, reconstruct
from mlx_dsv41.exl3.trellis import tile_states

FIXTURE = Path(__file__).parent / "fixtures" / "exl3_ref_fixture.safetensors"
FIXTURE_SHA256 = "1d8b80cc288eaeed1597d668866c578d19fcbaf78101fbd64b6dc55feb805171"
# docs/exl3.md#fixture: relative Frobenius error of the decoded W against W0 (the quantization
# error).
FIXTURE_TAGS = {
    "K2_mul1_fb": ("mul1", 0.26),
    "K2_mul1_cal": ("mul1", 0.26),
    "K3_mul1_fb": ("mul1", 0.13),
    "K3_mul1_cal": ("mul1", 0.13),
    "K4_mcg_fb": ("mcg", 0.067),
    "K4_mcg_cal": ("mcg", 0.067),
}
ALL_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS = (1.5, 2.5, 3.5)

# docs/exl3.md#codebooks.
LUT_SHA256 = {
    "3inst": "ad88de2dcff5bb05fff2faec37cceceb43aa1c2e8203f9d81a6fbd6dd3393eea",
    "mcg": "95383563929baa9d1ae5de0be22490284382673620bdd85929feea7bdbef04a9",
    "mul1": "bc48d02cb1c14939dc47b90f870dd689d63e3b1ab69a157e65538db68677a6c8",
}
KNOWN_VALUES = {  # state -> (3inst, mcg, mul1) fp16 bits
    0x0000: (0x3A25, 0x3F60, 0xC2E8),
    0x0001: (0xBB5B, 0x304E, 0x3921),
    0x0002: (0x3B74, 0xBA13, 0xB72D),
    0x1234: (0xC066, 0x3E0F, 0xB89E),
    0x8000: (0xB7F8, 0xB915, 0xBAF2),
    0xFFFF: (0xB110, 0x3ACD, 0xB936),
}
CODEBOOK_STATS = {"3inst": (1.243711, 10598), "mcg": (1.244112, 10746), "mul1": (1.000310, 913)}


def random_trellis(tk, tn, bits, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(-(1 << 15), 1 << 15, size=(tk, tn, int(16 * bits)), dtype=np.int16)


@pytest.fixture(scope="module")
def fixture():
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == FIXTURE_SHA256
    return load_file(str(FIXTURE))


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_codebook_table_sha256_and_known_values(codebook):
    table = codebook_table(codebook)
    assert table.dtype == np.float16 and table.shape == (65536,)
    assert hashlib.sha256(table.astype("<f2").tobytes()).hexdigest() == LUT_SHA256[codebook]
    column = ("3inst", "mcg", "mul1").index(codebook)
    for state, bits in KNOWN_VALUES.items():
        assert int(table.view(np.uint16)[state]) == bits[column], f"{codebook} state {state:#06x}"
    std, distinct = CODEBOOK_STATS[codebook]
    assert abs(table.astype(np.float64).std() - std) < 1e-6 and len(np.unique(table)) == distinct


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_codebook_table_matches_numpy_decoder(codebook):
    ours = codebook_table(codebook).view(np.uint16)
    theirs = exl3_numpy.decode(np.arange(65536), codebook).view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_mul1_two_fp16_roundings_would_be_wrong():
    # Guard for the one-rounding rule (docs/exl3.md#codebooks): rounding after the multiply changes
    # 60,326 states.
    x = (np.arange(65536, dtype=np.uint64) * 0x83DCD12D) % (1 << 32)
    bs = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))
    h = (1024 + bs).astype(np.float16)
    twice = (h * np.float16(1774 / 2**18)).astype(np.float16) + np.float16(-1329 / 128)
    assert int(np.sum(twice.view(np.uint16) != codebook_table("mul1").view(np.uint16))) == 60326


def test_mul1_packed_fp16_fma_is_exact_for_every_byte_sum():
    # The kernels form h = 1024 + bytesum as the fp16 bits 0x6400 + bytesum (dp4a) and then
    # value = fma(h, 0x1EEE, 0xC931) on fp16 operands with ONE rounding (a packed half2 fma): model
    # that fma exactly (float64 holds the product and sum exactly) and round once to fp16, for all
    # 1021 byte sums, against the definition in docs/exl3.md#codebooks (float32, then one rounding) and the table.
    bs = np.arange(1021)
    h = (0x6400 + bs).astype(np.uint16).view(np.float16)
    assert np.array_equal(h.astype(np.float64), 1024.0 + bs)  # exact: fp16 integers up to 2048
    k_inv = np.array([0x1EEE], np.uint16).view(np.float16).astype(np.float64)[0]
    k_bias = np.array([0xC931], np.uint16).view(np.float16).astype(np.float64)[0]
    assert (k_inv, k_bias) == (1774 / 2**18, -1329 / 128)
    fma_once = (h.astype(np.float64) * k_inv + k_bias).astype(np.float16)
    spec = ((1024 + bs).astype(np.float32) * np.float32(1774 / 2**18) + np.float32(-1329 / 128)).astype(np.float16)
    assert np.array_equal(fma_once.view(np.uint16), spec.view(np.uint16))
    x = (np.arange(65536, dtype=np.uint64) * 0x83DCD12D) % (1 << 32)
    state_bs = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)).astype(np.int64)
    assert np.array_equal(fma_once[state_bs].view(np.uint16), codebook_table("mul1").view(np.uint16))


def test_known_answer_states():
    # docs/exl3.md#bit-ring: two tiles with known states[0..7] and state[255].
    k4 = ((np.arange(64) * 0x0F0F + 0x1234) & 0xFFFF).astype(np.uint16).view(np.int16)
    k2 = (np.arange(32) + 1).astype(np.uint16).view(np.int16)
    for words, first, last in (
        (k4, [0x7D62, 0xD621, 0x6214, 0x2143, 0x1431, 0x4312, 0x3123, 0x1234], 0xB7D6),
        (k2, [0x007C, 0x01F0, 0x07C0, 0x1F00, 0x7C00, 0xF000, 0xC000, 0x0002], 0x001F),
    ):
        states = np.array(tile_states(mx.array(words.reshape(1, 1, -1))))[0, 0]
        assert states[:8].tolist() == first and int(states[255]) == last
        assert np.array_equal(states, exl3_numpy.tile_states(words, words.size / 16))


def test_state_rule_is_tail_biting_shift_register():
    # state(p) = ((state(p-1) << K) | own bits(p)) & 0xFFFF around the whole ring, every K.
    for bits in ALL_BITS + HALF_BITS:
        trellis = random_trellis(1, 1, bits, seed=int(bits * 10))
        states = np.array(tile_states(mx.array(trellis)))[0, 0].astype(np.int64)
        ends = exl3_numpy.window_ends(bits)
        own = np.diff(np.concatenate([[ends[-1] - 256 * bits], ends])).astype(int)
        prev = np.roll(states, 1)
        expect = ((prev << own) | (states & ((1 << own) - 1))) & 0xFFFF
        assert np.array_equal(states, expect), bits


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
@pytest.mark.parametrize("bits", ALL_BITS)
def test_reconstruct_matches_numpy_decoder(bits, codebook):
    trellis = random_trellis(2, 3, bits, seed=bits * 7 + len(codebook))
    ours = np.array(reconstruct(mx.array(trellis), codebook))
    assert ours.dtype == np.float16 and ours.shape == (32, 48)
    assert np.array_equal(ours.view(np.uint16), exl3_numpy.reconstruct(trellis, codebook).view(np.uint16))


@pytest.mark.parametrize("bits", HALF_BITS)
def test_reconstruct_half_integer_k(bits):
    trellis = random_trellis(2, 2, bits, seed=int(bits * 2))
    assert k2_from_trellis_shape(trellis.shape) == int(2 * bits)
    ours = np.array(reconstruct(mx.array(trellis), "mul1"))
    assert np.array_equal(ours.view(np.uint16), exl3_numpy.reconstruct(trellis, "mul1").view(np.uint16))
    with pytest.raises(ValueError, match="half-integer K.*mul1"):
        reconstruct(mx.array(trellis), "mcg")


def test_reconstruct_uint16_trellis_and_chunks(monkeypatch):
    # The decoder works in chunks of tile rows; the result must not depend on the chunk size.
    trellis = random_trellis(5, 2, 3, seed=11)
    whole = np.array(reconstruct(mx.array(trellis), "mul1"))
    monkeypatch.setattr("mlx_dsv41.exl3.trellis._TILES_PER_CHUNK", 4)
    chunked = np.array(reconstruct(mx.array(trellis.view(np.uint16)), "mul1"))
    assert np.array_equal(whole.view(np.uint16), chunked.view(np.uint16))


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 20), (2, 2, 24 + 16 * 8), (0, 2, 32), (2, 2, 136)])
def test_impossible_trellis_shapes(shape):
    with pytest.raises(ValueError, match="trellis"):
        k2_from_trellis_shape(shape)


@pytest.mark.parametrize("tag", sorted(FIXTURE_TAGS))
def test_fixture_decodes_to_w0(fixture, tag):
    codebook, quant_error = FIXTURE_TAGS[tag]
    assert f"{tag}.{codebook}" in fixture
    trellis = fixture[f"{tag}.trellis"]
    ours = np.array(reconstruct(mx.array(trellis), codebook))
    assert np.array_equal(ours.view(np.uint16), exl3_numpy.reconstruct(trellis, codebook).view(np.uint16))
    w0 = fixture[f"{tag}.W0"].astype(np.float64)
    w = np.array(
        dequantize(mx.array(trellis), mx.array(fixture[f"{tag}.suh"]), mx.array(fixture[f"{tag}.svh"]), codebook)
    )
    w64 = exl3_numpy.dequantize(trellis, fixture[f"{tag}.suh"], fixture[f"{tag}.svh"], codebook)
    assert np.abs(w - w64).max() <= 1e-6 * np.abs(w64).max()  # float32 transforms vs float64
    rel = np.linalg.norm(w64 - w0) / np.linalg.norm(w0)
    assert 0.85 * quant_error < rel < 1.15 * quant_error, rel
