"""Engram hashing: the Flash constants of docs/model.md#engram reproduced exactly, the hash against
a direct scalar transcription of docs/model.md#engram-hash, and the compressed token map against an
independent normalizer."""

import json
import re
import unicodedata

import numpy as np
import pytest

from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.model.engram_hash import (
    DEAD,
    CompressedTokenMap,
    EngramHashLayout,
    bucket_primes,
    hash_multipliers,
)

# docs/model.md#engram-buckets, as the docs list them (Flash: layers 1 and 14; n = 2, 3, 4; 8
# heads).
FLASH_PRIMES = {
    1: [
        [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
        [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
        [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463],
    ],
    14: [
        [16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
        [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
        [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889],
    ],
}
FLASH_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


def _flash_layout():
    args = ModelArgs()
    return args, EngramHashLayout.from_args(args, CompressedTokenMap(np.arange(args.vocab_size), 99092))


def _trial_division_prime(n):
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def test_flash_primes_sums_and_multipliers():
    args, layout = _flash_layout()
    assert np.array_equal(layout.primes, np.array([FLASH_PRIMES[1], FLASH_PRIMES[14]]))
    assert layout.primes.reshape(2, -1).sum(axis=1).tolist() == [384006168, 384016682]
    assert (2**63 - 1) // 99092 // 2 == 46539438283891
    assert layout.multipliers.tolist() == [FLASH_MULTIPLIERS[1], FLASH_MULTIPLIERS[14]]
    assert hash_multipliers(args, 14).tolist() == FLASH_MULTIPLIERS[14]  # seed 10007·14, by layer id
    # Offsets: exclusive prefix sums of the 24 columns, restarting at 0 for each layer.
    for li in range(2):
        cols = layout.primes[li].reshape(-1)
        assert layout.offsets[li].tolist() == [int(cols[:c].sum()) for c in range(24)]
    assert layout.pad_id == 2


def test_flash_hash_test_vector():
    _, layout = _flash_layout()
    ids = layout.row_ids(np.array([[10, 20, 30, 40]]), np.full((1, 3), DEAD))
    assert ids.shape == (1, 4, 2, 24)
    assert ids[0, 3, 0, :4].tolist() == [1326936, 22120929, 40011923, 55142539]
    assert ids[0, 3, 0, -1] == 378628807
    assert ids[0, 0, 0, :2].tolist() == [9400104, 24924096]


def test_prime_search_restarts_per_n_with_a_global_seen_set():
    # Tiny geometry where the restart matters: each n restarts at 49 and must skip used primes.
    args = ModelArgs(
        engram_vocab_size=50,
        engram_n_heads=3,
        engram_max_ngram_size=3,
        engram_layer_ids=(0, 1),
        engram_num_embeddings=(0, 0),
        num_hidden_layers=2,
        num_nextn_predict_layers=0,
        compress_ratios=(0, 0),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=-1,
        engram_compressed_vocab_size=10,
        vocab_size=64,
    )
    primes = bucket_primes(args)
    expected, seen = [], set()
    for _ in range(2):
        for _ in range(2):
            cand = 49
            for _ in range(3):
                cand += 1
                while cand in seen or not _trial_division_prime(cand):
                    cand += 1
                seen.add(cand)
                expected.append(cand)
    assert primes.reshape(-1).tolist() == expected == [53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103]


def test_num_embeddings_mismatch_is_a_clear_error():
    args = ModelArgs(engram_num_embeddings=(384006168, 384016681))
    with pytest.raises(
        ConfigError,
        match=r"layer 14: the bucket primes sum to 384016682 rows but "
        r"engram_num_embeddings\[1\] is 384016681",
    ):
        EngramHashLayout.from_args(args, CompressedTokenMap(np.arange(args.vocab_size), 99092))
    with pytest.raises(ConfigError, match="99091 compressed ids"):
        EngramHashLayout.from_args(ModelArgs(), CompressedTokenMap(np.arange(10), 99091))


def _scalar_hash(layout, li, seq, t):
    """docs/model.md#engram-hash for one position, with Python ints: seq holds compressed ids, DEAD
    for dead tokens."""
    toks, dead = [], False
    for s in range(layout.max_ngram):
        if t - s < 0 or seq[t - s] == DEAD:
            dead = True
        toks.append(layout.pad_id if dead else int(seq[t - s]))
    p = [toks[s] * int(layout.multipliers[li, s]) for s in range(layout.max_ngram)]
    out, x = [], p[0]
    for n in range(2, layout.max_ngram + 1):
        x ^= p[n - 1]
        for h in range(layout.primes.shape[2]):
            col = (n - 2) * layout.primes.shape[2] + h
            out.append(x % int(layout.primes[li, n - 2, h]) + int(layout.offsets[li, col]))
    return out


def test_hash_matches_scalar_transcription_across_calls_with_dead_tokens():
    _, layout = _flash_layout()
    rng = np.random.default_rng(3)
    seq = rng.integers(0, 99092, (2, 23)).astype(np.int64)
    seq[0, 5] = DEAD
    seq[1, [0, 12, 13]] = DEAD
    seq[1, 7] = layout.pad_id  # a real pad token does NOT stop the look-back
    ref = np.array([[[_scalar_hash(layout, li, seq[b], t) for li in range(2)] for t in range(23)] for b in range(2)])
    # All at once, and split over calls with the history carried explicitly.
    assert np.array_equal(layout.row_ids(seq, np.full((2, 3), DEAD)), ref)
    hist, parts = np.full((2, 3), DEAD), []
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 11), (11, 23)]:
        parts.append(layout.row_ids(seq[:, a:b], hist))
        hist = np.concatenate([hist, seq[:, a:b]], axis=1)[:, -3:]
    assert np.array_equal(np.concatenate(parts, axis=1), ref)
    # Rows stay inside each layer's table.
    assert ref.min() >= 0 and (ref[:, :, 0].max() < 384006168) and (ref[:, :, 1].max() < 384016682)


# ----------------------------------------------------------------------------- token map

_SENT = "\ue000"


def _bytes_to_unicode():
    """The GPT-2 byte-level alphabet (printable bytes map to themselves, the rest to 256+)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_B2U = _bytes_to_unicode()
_U2B = {v: k for k, v in _B2U.items()}


def _oracle_key(raw_token):
    """docs/model.md#engram-token-map written with Python's unicodedata/re, independent of
    `tokenizers`."""
    text = bytes(_U2B[c] for c in raw_token).decode("utf-8", errors="replace")
    if "\ufffd" in text:
        return raw_token
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if unicodedata.category(c) != "Mn").lower()
    t = re.sub(r"[ \t\r\n]+", " ", t)
    t = (_SENT if t == " " else t).strip().replace(_SENT, " ")
    return t or text


_WORDS = [
    "Hello",
    "hello",
    " Hello",
    "HELLO",
    "Héllo",
    " ",
    "  ",
    "\n",
    "\t \n",
    "\ufb01",
    "fi",
    "\u0301",
    "a\u0301",
    "á",
    " the",
    "The",
    "x  y",
    "\u3000z",
]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models

    tokens = ["".join(_B2U[b] for b in w.encode()) for w in _WORDS]
    tokens += [_B2U[0xC3], _B2U[0xA9]]  # partial UTF-8 bytes: decode to U+FFFD
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok, list(vocab)


def test_token_map_matches_independent_normalizer():
    tok, raw = _tokenizer()
    keys = [_oracle_key(r) for r in raw]
    first_seen = {}
    expected = [first_seen.setdefault(k, len(first_seen)) for k in keys]
    tmap = CompressedTokenMap.from_tokenizer(tok, expected_size=len(first_seen))
    assert tmap.ids.tolist() == expected
    # The cases the rules exist for, spelled out.
    ids = dict(zip(_WORDS, tmap.ids[: len(_WORDS)].tolist()))
    assert ids["Hello"] == ids["hello"] == ids[" Hello"] == ids["HELLO"] == ids["Héllo"]
    assert ids[" "] == ids["  "] == ids["\n"] == ids["\t \n"]  # whitespace runs: one space, kept
    assert ids["\ufb01"] == ids["fi"] and ids["a\u0301"] == ids["á"]
    assert ids["\u0301"] not in (ids[" "], ids["fi"])  # normalizes to "": keyed by its text
    assert tmap.ids[-2] != tmap.ids[-1]  # two U+FFFD tokens keep their raw strings apart
    assert tmap.size == len(set(keys)) < len(raw)


def test_token_map_size_check_and_json_cache(tmp_path, monkeypatch):
    tok, raw = _tokenizer()
    size = len(set(_oracle_key(r) for r in raw))
    with pytest.raises(
        ConfigError, match=f"gives {size} compressed Engram token ids but engram_compressed_vocab_size is {size + 1}"
    ):
        CompressedTokenMap.from_tokenizer(tok, expected_size=size + 1)

    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    built = CompressedTokenMap.load_or_build(path, size)
    cache = tmp_path / "engram_token_map.json"
    assert json.loads(cache.read_text())["size"] == size

    def no_build(*a, **k):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(CompressedTokenMap, "from_tokenizer", classmethod(no_build))
    again = CompressedTokenMap.load_or_build(path, size)
    assert np.array_equal(again.ids, built.ids)
    with pytest.raises(ConfigError, match="engram_token_map.json gives"):
        CompressedTokenMap.load_or_build(path, size + 1)
    # A different tokenizer file invalidates the cache (it would rebuild).
    path.write_text(path.read_text().replace('"Hello"', '"Hallo"', 1))
    with pytest.raises(AssertionError, match="cache should have been used"):
        CompressedTokenMap.load_or_build(path, size)


def test_compress_marks_dead_tokens_and_rejects_unknown_ids():
    tmap = CompressedTokenMap(np.array([0, 1, 1, 2, 0]), 3)
    assert tmap.compress(np.array([[4, 3, 2]]), dead_token_id=3).tolist() == [[0, DEAD, 1]]
    with pytest.raises(ValueError, match="token id 5 is outside the Engram token map"):
        tmap.compress(np.array([[5]]))
