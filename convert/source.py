"""Open a checkpoint to convert: config, kind, shard headers, Engram tables, tokenizer, fingerprint.

Only headers are read here (strictly: truncated files and sizes that lie are refused on open), so
every problem with the source is found before anything is written. The Engram tables come from
the source itself (the official release) or from ``--engram-from`` (a directory holding the
official release's last two shards, or the whole release); an index whose shards are not all
present is fine there. Errors are ``ConvertError`` with one line naming the file and tensor.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from convert.engram_rows import EngramTable, check_table, table_from_checkpoint
from convert.safetensors_io import SafetensorsCheckpoint, SafetensorsError
from mlx_dsv41 import layout
from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.engram_store import WHERE_TO_GET, EngramStoreError
from mlx_dsv41.loading import LoadError, checkpoint_kind, read_config, source_quantization


class ConvertError(ValueError):
    """A source, option or output directory the converter refuses; the message is one line."""


_ENGRAM_TABLE = "layers.{}.engram.embed.{}"


@dataclass
class Source:
    path: Path
    kind: str  # "exl3" | "official"
    config: dict  # config.json as stored
    args: ModelArgs
    ckpt: SafetensorsCheckpoint  # the weights (shards listed in an index may be missing: ckpt.missing)
    tables: dict[int, EngramTable]  # Engram layer -> its table (the source's or --engram-from's)
    engram_ckpt: SafetensorsCheckpoint | None  # what the tables are read from (may be `ckpt`)
    engram_path: Path | None  # where the tables are read from
    tokenizer: Path  # tokenizer.json
    fingerprint: str  # SHA-256 of config.json and every shard's name, size and header
    engram_fingerprint: str

    @property
    def quantization(self) -> dict | None:
        return source_quantization(self.config)

    def close(self) -> None:
        self.ckpt.close()
        if self.engram_ckpt is not None:
            self.engram_ckpt.close()


def shard_fingerprint(files: list[Path]) -> str:
    """SHA-256 over each file's name, size and header bytes (cheap; changes with any re-shard,
    re-quantization or truncation)."""
    h = hashlib.sha256()
    for file in sorted(files):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f"{file.name}\0{os.fstat(f.fileno()).st_size}\0".encode())
            h.update(f.read(n))
    return h.hexdigest()


def _open_all(ckpt: SafetensorsCheckpoint) -> None:
    """Open every shard (strict header checks) and check the index against what each holds."""
    for name in ckpt.weight_map:
        ckpt.info(name)


def _engram_tables(args: ModelArgs, ckpt: SafetensorsCheckpoint, src: Path,
                   engram_from: Path | None) -> tuple[dict[int, EngramTable], SafetensorsCheckpoint | None]:
    if not args.engram_layer_ids:
        return {}, None
    # Every shard of `origin` is open and checked already: `ckpt` by open_source, and a
    # checkpoint read without its index opens every file to list its tensors.
    if engram_from is not None:
        if not engram_from.exists():
            raise ConvertError(f"--engram-from {engram_from}: no such file or directory; {WHERE_TO_GET}")
        origin, where = SafetensorsCheckpoint(engram_from, use_index=False), engram_from
    else:
        origin, where = ckpt, src
        for layer in args.engram_layer_ids:
            name = _ENGRAM_TABLE.format(layer, "weight")
            if name in ckpt.missing:
                raise ConvertError(f"{src}: shard {ckpt.missing[name]} holding {name} is missing; {WHERE_TO_GET}")
    tables = {}
    try:
        for i, layer in enumerate(args.engram_layer_ids):
            if _ENGRAM_TABLE.format(layer, "weight") not in origin.weight_map:
                raise ConvertError(f"{where}: no Engram table {_ENGRAM_TABLE.format(layer, 'weight')} "
                                   f"(the source has none); {WHERE_TO_GET}")
            table = table_from_checkpoint(origin, layer)
            check_table(table, layer, args.engram_num_embeddings[i], args.engram_head_dim)
            tables[layer] = table
    except BaseException:
        if origin is not ckpt:
            origin.close()
        raise
    return tables, origin


def open_source(src: str | os.PathLike, engram_from: str | os.PathLike | None = None) -> Source:
    """Everything the converter needs to know about ``src``, checked from headers."""
    src = Path(src)
    engram_from = None if engram_from is None else Path(engram_from)
    try:
        kind = checkpoint_kind(src)
        if kind == "converted":
            raise ConvertError(f"{src}: already a converted checkpoint; load it with mlx_dsv41.load")
        config = read_config(src)
        args = ModelArgs.from_dict(config)
        ckpt = SafetensorsCheckpoint(src, allow_missing=True)
    except (LoadError, ConfigError, SafetensorsError) as e:
        raise ConvertError(str(e)) from None
    try:
        _open_all(ckpt)
        missing = {n: s for n, s in ckpt.missing.items() if ".engram.embed." not in n}
        if missing:
            name, shard = next(iter(missing.items()))
            count = sum(s == shard for s in missing.values())
            raise ConvertError(f"{src}: shard {shard} is missing ({count} tensors, e.g. {name!r}, "
                               f"are listed in it)")
        tables, origin = _engram_tables(args, ckpt, src, engram_from)
        tokenizer = next((d / "tokenizer.json" for d in (src, engram_from)
                          if d is not None and d.is_dir() and (d / "tokenizer.json").is_file()), None)
        if tokenizer is None:
            raise ConvertError(f"{src}: no tokenizer.json (needed for the tokenizer and the Engram "
                               f"token map); copy it from the official release")
        config_bytes = (src / layout.CONFIG).read_bytes()
        fingerprint = hashlib.sha256(config_bytes + shard_fingerprint(ckpt.shards()).encode()).hexdigest()
        engram_fp = "" if origin is None else shard_fingerprint(
            sorted({origin.weight_map[_ENGRAM_TABLE.format(layer, part)]
                    for layer in tables for part in ("weight", "scale")}))
    except (SafetensorsError, EngramStoreError) as e:
        ckpt.close()
        raise ConvertError(str(e)) from None
    except BaseException:
        ckpt.close()
        raise
    return Source(src, kind, config, args, ckpt, tables, origin, engram_from if origin is not ckpt else src,
                  tokenizer, fingerprint, engram_fp)

