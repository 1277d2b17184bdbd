"""Engram n-gram hashing on the host (docs/model.md#engram-hashing; docs/model.md#engram-checks).

Everything here is numpy int64: the row ids select rows of tables that live on SSD, so they are
needed on the CPU before the rows can be read.

- `CompressedTokenMap`: token id -> compressed id, from a tokenizer by the official normalization.
- `EngramHashLayout`: per Engram layer, the bucket primes, column offsets and hash multipliers.
- `EngramHashLayout.row_ids`: the row ids of the n-grams ending at every position.

Compressed ids use -1 for DEAD positions (image tokens, and "before the sequence start" in
histories): the look-back stops there (docs/model.md#engram-hash).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.layout import TOKEN_MAP, TOKEN_MAP_FORMAT

DEAD = -1  # a compressed id that stops the n-gram look-back

# ----------------------------------------------------------------------------- token map

# Keeps a token that is exactly one space alive through Strip (docs/model.md#engram-token-map).
_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_keys(tokenizer) -> list[str]:
    """The normalization key of every token id 0..len-1 (docs/model.md#engram-token-map), from a
    tokenizers.Tokenizer."""
    norm = _normalizer()
    keys = []
    for tid in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            # A partial UTF-8 byte token: nothing to normalize, key it by its raw token string.
            raw = tokenizer.id_to_token(tid)
            if raw is None:
                raise ValueError(f"token id {tid} has no token string")
            keys.append(raw)
        else:
            keys.append(norm.normalize_str(text) or text)
    return keys


@dataclass(frozen=True)
class CompressedTokenMap:
    """`ids[token_id]` is the compressed id (first-seen order of the normalization keys)."""

    ids: np.ndarray  # int64 [vocab]
    size: int  # number of compressed ids

    @classmethod
    def from_tokenizer(cls, tokenizer, expected_size: int) -> CompressedTokenMap:
        first_seen: dict[str, int] = {}
        ids = np.array([first_seen.setdefault(k, len(first_seen)) for k in compressed_keys(tokenizer)], dtype=np.int64)
        return cls._checked(ids, len(first_seen), expected_size, "the tokenizer")

    @classmethod
    def _checked(cls, ids: np.ndarray, size: int, expected_size: int, where: str) -> CompressedTokenMap:
        if size != expected_size:
            raise ConfigError(
                f"{where} gives {size} compressed Engram token ids but engram_compressed_vocab_size "
                f"is {expected_size}: every hash multiplier depends on it, so the tokenizer and the "
                f"config must belong to the same checkpoint"
            )
        return cls(ids=ids, size=size)

    @classmethod
    def load_or_build(
        cls, tokenizer_file: str | os.PathLike, expected_size: int, cache_file: str | os.PathLike | None = None
    ) -> CompressedTokenMap:
        """Read the JSON cache (default: `engram_token_map.json` next to tokenizer.json, the file a
        converted directory holds) if it was built from this exact tokenizer file; otherwise build
        the map and write the cache."""
        tokenizer_file = Path(tokenizer_file)
        cache_file = Path(cache_file) if cache_file else tokenizer_file.with_name(TOKEN_MAP)
        digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
        if cache_file.exists():
            cached = json.loads(cache_file.read_text())
            if cached.get("format") == TOKEN_MAP_FORMAT and cached.get("tokenizer_sha256") == digest:
                ids = np.asarray(cached["ids"], dtype=np.int64)
                return cls._checked(ids, int(cached["size"]), expected_size, str(cache_file))
        from tokenizers import Tokenizer

        tmap = cls.from_tokenizer(Tokenizer.from_file(str(tokenizer_file)), expected_size)
        payload = {"format": TOKEN_MAP_FORMAT, "tokenizer_sha256": digest, "size": tmap.size, "ids": tmap.ids.tolist()}
        tmp = cache_file.with_name(cache_file.name + ".tmp")
        tmp.write_text(json.dumps(payload, separators=(",", ":")))
        os.replace(tmp, cache_file)
        return tmap

    def compress(self, token_ids: np.ndarray, dead_token_id: int | None = None) -> np.ndarray:
        """Token ids [B, S] -> compressed ids int64, DEAD where the token is `dead_token_id`."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        bad = (token_ids < 0) | (token_ids >= len(self.ids))
        if bad.any():
            raise ValueError(
                f"token id {int(token_ids[bad][0])} is outside the Engram token map (0..{len(self.ids) - 1})"
            )
        out = self.ids[token_ids]
        if dead_token_id is not None:
            out = np.where(token_ids == dead_token_id, DEAD, out)
        return out


# ----------------------------------------------------------------------------- hash layout


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (these bases are exact for n < 3.3·10^24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(args: ModelArgs) -> np.ndarray:
    """int64 [n_engram_layers, max_ngram - 1, n_heads] (docs/model.md#engram-buckets): per layer,
    per n, per head, the next prime above the previous candidate, restarting at engram_vocab_size -
    1 for every n, never reusing a prime (one seen set across all layers)."""
    seen: set[int] = set()
    out = np.zeros((len(args.engram_layer_ids), len(args.engram_ngram_sizes), args.engram_n_heads), dtype=np.int64)
    for li in range(out.shape[0]):
        for ni in range(out.shape[1]):
            candidate = args.engram_vocab_size - 1
            for h in range(out.shape[2]):
                candidate += 1
                while candidate in seen or not _is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                out[li, ni, h] = candidate
    return out


def hash_multipliers(args: ModelArgs, layer_id: int) -> np.ndarray:
    """int64 [max_ngram] odd multipliers of one Engram layer (docs/model.md#engram-multipliers)."""
    bound = (2**63 - 1) // args.engram_compressed_vocab_size // 2
    draws = np.random.default_rng(seed=10007 * layer_id).integers(
        low=0, high=bound, size=args.engram_max_ngram_size, dtype=np.int64
    )
    return draws * 2 + 1


@dataclass(frozen=True)
class EngramHashLayout:
    """Primes, offsets and multipliers of every Engram layer, checked against the config."""

    layer_ids: tuple[int, ...]
    primes: np.ndarray  # int64 [L, max_ngram - 1, heads]
    offsets: np.ndarray  # int64 [L, columns]: exclusive prefix sums within each layer
    multipliers: np.ndarray  # int64 [L, max_ngram]
    max_ngram: int
    pad_id: int  # compressed id of engram_pad_token_id

    @classmethod
    def from_args(cls, args: ModelArgs, token_map: CompressedTokenMap) -> EngramHashLayout:
        if token_map.size != args.engram_compressed_vocab_size:
            raise ConfigError(
                f"token map has {token_map.size} compressed ids, config says "
                f"engram_compressed_vocab_size = {args.engram_compressed_vocab_size}"
            )
        primes = bucket_primes(args)
        for li, layer in enumerate(args.engram_layer_ids):
            total = int(primes[li].sum())
            if total != args.engram_num_embeddings[li]:
                raise ConfigError(
                    f"Engram layer {layer}: the bucket primes sum to {total} rows but "
                    f"engram_num_embeddings[{li}] is {args.engram_num_embeddings[li]} "
                    f"(check engram_vocab_size, engram_n_heads, engram_max_ngram_size)"
                )
        flat = primes.reshape(len(args.engram_layer_ids), -1)
        offsets = np.concatenate([np.zeros_like(flat[:, :1]), np.cumsum(flat, axis=1)[:, :-1]], axis=1)
        mults = (
            np.stack([hash_multipliers(args, layer) for layer in args.engram_layer_ids])
            if args.engram_layer_ids
            else np.zeros((0, args.engram_max_ngram_size), np.int64)
        )
        pad = int(token_map.ids[args.engram_pad_token_id])
        return cls(tuple(args.engram_layer_ids), primes, offsets, mults, args.engram_max_ngram_size, pad)

    @property
    def history_length(self) -> int:
        """Compressed ids of look-back a later call needs (3 for Flash)."""
        return self.max_ngram - 1

    def row_ids(self, compressed: np.ndarray, history: np.ndarray) -> np.ndarray:
        """Row ids of the n-grams ending at each position (docs/model.md#engram-hash).

        compressed [B, S] int64: this call's compressed ids (DEAD = -1 for dead positions).
        history [B, max_ngram - 1] int64: the ids just before them, oldest first (DEAD before the
        sequence start). Returns int64 [B, S, n_layers, (max_ngram - 1)·heads], rows within each
        layer's own table.
        """
        compressed = np.asarray(compressed, dtype=np.int64)
        history = np.asarray(history, dtype=np.int64)
        k = self.history_length
        if compressed.ndim != 2 or history.shape != (compressed.shape[0], k):
            raise ValueError(
                f"row_ids: compressed must be [B, S] and history [B, {k}], got {compressed.shape} and {history.shape}"
            )
        B, S = compressed.shape
        ext = np.concatenate([history, compressed], axis=1)  # [B, k + S]
        alive = np.ones((B, S), dtype=bool)
        looks = []
        for s in range(self.max_ngram):  # the token s positions back, pad once the chain is dead
            tok = ext[:, k - s : k - s + S]
            alive &= tok != DEAD
            looks.append(np.where(alive, tok, self.pad_id))
        heads = self.primes.shape[2]
        out = np.empty((B, S, len(self.layer_ids), (self.max_ngram - 1) * heads), dtype=np.int64)
        for li in range(len(self.layer_ids)):
            # No overflow: ids < compressed vocab and multipliers < (2^63 - 1) / compressed vocab.
            x = looks[0] * self.multipliers[li, 0]
            for n in range(2, self.max_ngram + 1):
                x = x ^ (looks[n - 1] * self.multipliers[li, n - 1])
                cols = slice((n - 2) * heads, (n - 1) * heads)
                out[:, :, li, cols] = x[..., None] % self.primes[li, n - 2] + self.offsets[li, cols]
        return out
