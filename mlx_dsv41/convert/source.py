"""Open a checkpoint to convert: config, kind, shard headers, Engram tables, DSpark tensors,
tokenizer, fingerprint.

Only headers are read here (strictly: truncated files and sizes that lie are refused on open), so
every problem with the source is found before anything is written. The Engram tables come from
the source itself (the official release) or from ``--engram-from`` (a directory holding the
official release's last two shards, or the whole release); an index whose shards are not all
present is fine there. The DSpark draft head (``mtp.*``, docs/dspark.md#tensors) comes from the
source when it holds it, or from ``--dspark-from`` (the official release: only the shards its index
lists for ``mtp.*`` are opened); without either, the conversion has no draft head and the model
decodes without speculation. Errors are ``ConvertError`` with one line naming the file and tensor.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from mlx_dsv41 import layout
from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.convert.engram_rows import EngramTable, check_table, table_from_checkpoint
from mlx_dsv41.convert.safetensors_io import SafetensorsCheckpoint, SafetensorsError
from mlx_dsv41.engram_store import WHERE_TO_GET, EngramStoreError
from mlx_dsv41.loading import LoadError, checkpoint_kind, read_config, source_quantization
from mlx_dsv41.model.deepseek_v41 import MTP


class ConvertError(ValueError):
    """A source, option or output directory the converter refuses; the message is one line."""


_ENGRAM_TABLE = "layers.{}.engram.embed.{}"
DSPARK_HINT = (
    "the DSpark draft head is mtp.* in the official DeepSeek-V4.1-Flash release; add it with "
    "`python -m mlx_dsv41.convert SRC OUT --dspark-from OFFICIAL_DIR`"
)


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
    dspark_ckpt: SafetensorsCheckpoint | None = None  # where mtp.* is read from (may be `ckpt`); None: no DSpark
    dspark_path: Path | None = None
    dspark_fingerprint: str = ""

    @property
    def quantization(self) -> dict | None:
        return source_quantization(self.config)

    def close(self) -> None:
        self.ckpt.close()
        for other in (self.engram_ckpt, self.dspark_ckpt):
            if other is not None and other is not self.ckpt:
                other.close()


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


def _engram_tables(
    args: ModelArgs, ckpt: SafetensorsCheckpoint, src: Path, engram_from: Path | None
) -> tuple[dict[int, EngramTable], SafetensorsCheckpoint | None]:
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
                raise ConvertError(
                    f"{where}: no Engram table {_ENGRAM_TABLE.format(layer, 'weight')} "
                    f"(the source has none); {WHERE_TO_GET}"
                )
            table = table_from_checkpoint(origin, layer)
            check_table(table, layer, args.engram_num_embeddings[i], args.engram_head_dim)
            tables[layer] = table
    except BaseException:
        if origin is not ckpt:
            origin.close()
        raise
    return tables, origin


def _dspark_origin(
    args: ModelArgs, ckpt: SafetensorsCheckpoint, src: Path, dspark_from: Path | None
) -> SafetensorsCheckpoint | None:
    """Where the DSpark tensors are read from: the source, --dspark-from (only the shards holding
    mtp.* are opened), or nowhere (None: the conversion has no draft head)."""
    in_source = any(MTP.match(n) for n in ckpt.weight_map)
    if dspark_from is None:
        return ckpt if in_source and args.dspark_stages else None
    if not args.dspark_stages:
        raise ConvertError(f"--dspark-from {dspark_from}: {src} cannot draft ({args.dspark_unavailable})")
    if in_source:
        raise ConvertError(
            f"--dspark-from {dspark_from}: {src} holds the DSpark tensors (mtp.*) itself; drop --dspark-from"
        )
    if not dspark_from.exists():
        raise ConvertError(f"--dspark-from {dspark_from}: no such file or directory; {DSPARK_HINT}")
    origin = SafetensorsCheckpoint(dspark_from, allow_missing=True)
    try:
        missing = {n: shard for n, shard in origin.missing.items() if MTP.match(n)}
        if missing:
            name, shard = next(iter(missing.items()))
            raise ConvertError(f"--dspark-from {dspark_from}: shard {shard} holding {name} is missing")
        names = [n for n in origin.weight_map if MTP.match(n)]
        if not names:
            raise ConvertError(f"--dspark-from {dspark_from}: no DSpark tensors (mtp.*); {DSPARK_HINT}")
        for name in names:
            origin.info(name)  # opens (strictly) just the shards that hold them
    except BaseException:
        origin.close()
        raise
    return origin


def _check_no_missing_shard(src: Path, ckpt: SafetensorsCheckpoint) -> None:
    """Every shard the index lists is there (the Engram tables may come from elsewhere)."""
    missing = {n: s for n, s in ckpt.missing.items() if ".engram.embed." not in n}
    if missing:
        name, shard = next(iter(missing.items()))
        count = sum(s == shard for s in missing.values())
        raise ConvertError(f"{src}: shard {shard} is missing ({count} tensors, e.g. {name!r}, are listed in it)")


def _tokenizer_file(src: Path, engram_from: Path | None) -> Path:
    tokenizer = next(
        (
            d / "tokenizer.json"
            for d in (src, engram_from)
            if d is not None and d.is_dir() and (d / "tokenizer.json").is_file()
        ),
        None,
    )
    if tokenizer is None:
        raise ConvertError(
            f"{src}: no tokenizer.json (needed for the tokenizer and the Engram "
            f"token map); copy it from the official release"
        )
    return tokenizer


def _fingerprints(src: Path, ckpt: SafetensorsCheckpoint, tables, origin, dspark) -> tuple[str, str, str]:
    """(source, Engram tables, DSpark head) fingerprints: what a resumed conversion must match."""
    config_bytes = (src / layout.CONFIG).read_bytes()
    fingerprint = hashlib.sha256(config_bytes + shard_fingerprint(ckpt.shards()).encode()).hexdigest()
    engram_fp = (
        ""
        if origin is None
        else shard_fingerprint(
            sorted(
                {
                    origin.weight_map[_ENGRAM_TABLE.format(layer, part)]
                    for layer in tables
                    for part in ("weight", "scale")
                }
            )
        )
    )
    dspark_fp = (
        ""
        if dspark is None or dspark is ckpt
        else shard_fingerprint(sorted({f for n, f in dspark.weight_map.items() if MTP.match(n)}))
    )
    return fingerprint, engram_fp, dspark_fp


def open_source(
    src: str | os.PathLike, engram_from: str | os.PathLike | None = None, dspark_from: str | os.PathLike | None = None
) -> Source:
    """Everything the converter needs to know about ``src``, checked from headers."""
    src = Path(src)
    engram_from = None if engram_from is None else Path(engram_from)
    dspark_from = None if dspark_from is None else Path(dspark_from)
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
        _check_no_missing_shard(src, ckpt)
        tables, origin = _engram_tables(args, ckpt, src, engram_from)
        dspark = _dspark_origin(args, ckpt, src, dspark_from)
        tokenizer = _tokenizer_file(src, engram_from)
        fingerprint, engram_fp, dspark_fp = _fingerprints(src, ckpt, tables, origin, dspark)
    except (SafetensorsError, EngramStoreError) as e:
        ckpt.close()
        raise ConvertError(str(e)) from None
    except BaseException:
        ckpt.close()
        raise
    return Source(
        src,
        kind,
        config,
        args,
        ckpt,
        tables,
        origin,
        engram_from if origin is not ckpt else src,
        tokenizer,
        fingerprint,
        engram_fp,
        dspark,
        None if dspark is None else (src if dspark is ckpt else dspark_from),
        dspark_fp,
    )
