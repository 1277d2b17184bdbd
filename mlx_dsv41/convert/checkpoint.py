"""`convert_checkpoint(src, out)`: an EXL3 or official FP8/FP4 DeepSeek-V4.1 checkpoint, plus the
official Engram tables, -> the converted layout of `mlx_dsv41/layout.py`.

1. Check the source from headers (`source.py`, `plan.py`): shards, shapes, dtypes, Engram tables,
   tokenizer and token map, and that the output fits on its disk (~400 GB for the real model).
   Nothing is written when anything is wrong.
2. Write under OUT.partial: the tokenizer files and the Engram token map; one weight shard per
   source shard, tensor by tensor, large tensors in ~16 MB row chunks (so memory never holds more
   than a chunk of one tensor, whatever the shard size); the Engram row files (`engram_rows.py`);
   the index, config.json and the model.py shim.
3. Load the result (lazily, Engram stores opened) to prove it loads, then rename OUT.partial -> OUT.

Resume: OUT.partial/convert_state.json holds the fingerprint of source and options and every
finished shard, recorded only after the shard is written, fsynced and renamed into place; a
rerun skips those, and row files resume by chunk. A rerun over a finished OUT with the same
source and options is a no-op. Test hook: MLX_DSV41_CONVERT_CRASH_AFTER=N makes the process exit
abruptly (no cleanup, like a kill) after writing N shards.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from mlx_dsv41 import __version__, layout
from mlx_dsv41.config import ConfigError
from mlx_dsv41.convert.engram_rows import write_engram_rows
from mlx_dsv41.convert.plan import Step, plan_steps
from mlx_dsv41.convert.safetensors_io import SafetensorsError
from mlx_dsv41.convert.safetensors_writer import SafetensorsWriter, sync_dir, sync_file
from mlx_dsv41.convert.source import DSPARK_HINT, ConvertError, Source, open_source
from mlx_dsv41.engram_store import DEFAULT_CHUNK_ROWS, EngramStoreError, RowFileHeader, open_row_file
from mlx_dsv41.quant import FormatError

CRASH_ENV = "MLX_DSV41_CONVERT_CRASH_AFTER"
_LOCK = ".lock"


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    engram_from: str | os.PathLike | None = None,
    dtype: str | None = None,
    progress: bool = True,
    dspark_from: str | os.PathLike | None = None,
) -> Path:
    """Convert `src` into `out` (see the module docstring); returns `out`.

    `engram_from`: a directory (or shard) with the official Engram tables, for sources without
    them. `dspark_from`: the official release (or the shards of it holding `mtp.*`), for sources
    without the DSpark draft head. `dtype="bf16"` dequantizes official FP8/FP4 weights (exactly)
    instead of re-laying them as MLX mxfp8/mxfp4. Every bad input raises ConvertError with a
    one-line message.
    """
    started = time.perf_counter()
    out = Path(out)
    report = _Reporter(progress)
    if dtype not in (None, "bf16"):
        raise ConvertError(f"dtype {dtype!r} is not supported: bf16, or none for MLX mxfp8 / mxfp4")
    source = open_source(src, engram_from, dspark_from)
    try:
        if dtype is not None and source.kind == "exl3":
            raise ConvertError(
                f"{source.path}: --dtype applies to official FP8/FP4 sources; EXL3 tensors are kept as stored"
            )
        fingerprint = _output_fingerprint(source, dtype)
        if _finished(out, fingerprint):
            report.say(f"{out}: already converted from this source; nothing to do")
            return out
        report.say(f"checking {source.path} ({source.kind}, {len(source.ckpt.shards())} shards)")
        if source.dspark_ckpt is None and source.args.dspark_stages:
            report.say(
                f"{source.path}: no DSpark draft head (mtp.*): the converted model decodes without "
                f"speculation; {DSPARK_HINT}"
            )
        _write_conversion(source, out, dtype, fingerprint, report)
    except (SafetensorsError, EngramStoreError, FormatError, ConfigError) as e:
        raise ConvertError(" ".join(str(e).split("\n"))) from None
    except OSError as e:
        raise ConvertError(f"{e.filename or out}: {e.strerror or e}") from None
    finally:
        source.close()
    seconds = time.perf_counter() - started
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    report.say(
        f"converted {source.path} -> {out}: {written / 1e9:.3f} GB in {seconds:.1f} s "
        f"({written / 1e6 / max(seconds, 1e-9):.0f} MB/s), peak RSS {peak_rss_bytes() / 1e6:.0f} MB"
    )
    return out


def _output_fingerprint(source: Source, dtype: str | None) -> str:
    """What the output depends on: the source (and where its Engram tables and DSpark head come
    from), the dtype and the layout's version."""
    return hashlib.sha256(
        json.dumps(
            [source.fingerprint, source.engram_fingerprint, dtype, layout.FORMAT_VERSION]
            + (["dspark", source.dspark_fingerprint] if source.dspark_ckpt is not None else [])
        ).encode()
    ).hexdigest()


def _write_conversion(source: Source, out: Path, dtype: str | None, fingerprint: str, report) -> None:
    """The conversion into OUT.partial (resumed if it holds this fingerprint's work), verified, then
    renamed to OUT."""
    steps = plan_steps(source, dtype)
    token_map = _token_map(source)
    _check_free_space(out, source, steps)
    with _Workdir(layout.partial_dir(out), fingerprint, report) as work:
        if not work.complete:
            tokenizer_sha256 = _write_tokenizer(source, work.path, token_map)
            weight_map = _write_shards(source, steps, work, report)
            engram = _write_engram(source, work.path, report)
            block = _block(source, steps, weight_map, engram, tokenizer_sha256, dtype, fingerprint, work.path)
            _write_meta(source, weight_map, block, work.path)
            _verify(work.path, block)
        work.finish(out)


SPACE_MARGIN = 64 << 20  # tokenizer, token map, headers, config: small next to the tensors


def output_bytes(source: Source, steps: list[Step]) -> int:
    """What the conversion writes: every output tensor and every Engram row file."""
    args = source.args
    rows = sum(
        RowFileHeader.new(layer, args.engram_num_embeddings[i], args.engram_head_dim, DEFAULT_CHUNK_ROWS).file_bytes
        for i, layer in enumerate(source.tables)
    )
    return sum(step.out_bytes for step in steps) + rows + SPACE_MARGIN


def _check_free_space(out: Path, source: Source, steps: list[Step]) -> None:
    """Refuse before writing anything when the output (less what an unfinished OUT.partial already
    holds) does not fit on its disk."""
    partial = layout.partial_dir(out)
    held = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()) if partial.is_dir() else 0
    need = max(0, output_bytes(source, steps) - held)
    where = next(p for p in [out, *out.absolute().parents] if p.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        more = f" more (OUT.partial holds {held / 1e9:.1f} GB)" if held else ""
        raise ConvertError(
            f"not enough free disk space for {out}: the conversion writes {need / 1e9:.1f} GB"
            f"{more}, {where} has {free / 1e9:.1f} GB free"
        )


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# ------------------------------------------------------------------------------ output directory


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _our_block(directory: Path) -> dict | None:
    block = (_read_json(directory / layout.CONFIG) or {}).get(layout.BLOCK)
    return block if isinstance(block, dict) and block.get("format") == layout.FORMAT else None


def _finished(out: Path, fingerprint: str) -> bool:
    """True if `out` already holds this conversion; ConvertError if it holds anything else."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory; choose another output directory")
    block = _our_block(out)
    if block is not None and not (out / layout.STATE).exists():
        if block.get("fingerprint") == fingerprint:
            return True
        raise ConvertError(
            f"{out}: already holds a conversion of {block.get('source', {}).get('path')} "
            f"(another source or other options); delete it or choose another output directory"
        )
    if any(out.iterdir()):
        raise ConvertError(
            f"{out}: exists and is not a converted checkpoint; refusing to write into it "
            f"(choose another output directory)"
        )
    return False  # an empty directory: replaced by the finished conversion


def _write_json(path: Path, data, indent: int | None = 1) -> None:
    """Atomically (write, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=indent, separators=None if indent else (",", ":"))
        f.flush()
        sync_file(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


class _Workdir:
    """OUT.partial, locked, with its convert_state.json."""

    def __init__(self, path: Path, fingerprint: str, report: _Reporter):
        self.path, self.fingerprint, self.report = path, fingerprint, report
        self.complete = False
        self._lock = -1

    def __enter__(self) -> _Workdir:
        leftover = self.path.is_dir() and any(e.name != _LOCK for e in self.path.iterdir())
        if leftover and not (self.path / layout.STATE).exists():
            block = _our_block(self.path)
            if block is None or block.get("fingerprint") != self.fingerprint:
                raise ConvertError(f"{self.path}: exists and was not written by this conversion; delete it")
            self.complete = True  # finished, only the final rename was missing
        self.path.mkdir(exist_ok=True)
        self._lock = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ConvertError(f"{self.path}: another conversion is writing it") from None
        if self.complete:
            return self
        state = _read_json(self.path / layout.STATE)
        if state is not None and state.get("format") != layout.FORMAT:
            raise ConvertError(f"{self.path}: its {layout.STATE} was not written by this converter; delete it")
        if state is not None and state.get("fingerprint") != self.fingerprint:
            self.report.say(f"{self.path}: discarding an unfinished conversion of another source or options")
            for entry in self.path.iterdir():
                if entry.name != _LOCK:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            state = None
        elif state is not None:
            self.report.say(f"{self.path}: resuming ({len(state.get('shards', {}))} shards done)")
        self.state = state or {"format": layout.FORMAT, "fingerprint": self.fingerprint, "shards": {}}
        _write_json(self.path / layout.STATE, self.state)
        return self

    def record_shard(self, name: str, source_name: str, size: int) -> None:
        self.state["shards"][name] = {"source": source_name, "bytes": size}
        _write_json(self.path / layout.STATE, self.state)

    def shard_done(self, name: str, source_name: str) -> bool:
        rec = self.state["shards"].get(name)
        file = self.path / name
        return bool(rec) and rec["source"] == source_name and file.is_file() and file.stat().st_size == rec["bytes"]

    def finish(self, out: Path) -> None:
        """Mark complete (no state file), then give the directory its final name."""
        (self.path / layout.STATE).unlink(missing_ok=True)
        (self.path / _LOCK).unlink(missing_ok=True)
        sync_dir(self.path)
        if out.exists():
            out.rmdir()  # the empty directory _finished accepted
        os.rename(self.path, out)
        sync_dir(out.parent)

    def __exit__(self, *exc) -> None:
        if self._lock >= 0:
            os.close(self._lock)


# ------------------------------------------------------------------------------ stages


def _token_map(source: Source):
    """The compressed-token map (docs/model.md#engram-token-map), built from the tokenizer and
    checked against the config."""
    if not source.args.engram_layer_ids:
        return None
    from tokenizers import Tokenizer

    from mlx_dsv41.model.engram_hash import CompressedTokenMap

    try:
        tokenizer = Tokenizer.from_file(str(source.tokenizer))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
        raise ConvertError(f"{source.tokenizer}: cannot be read as a tokenizers file ({e})") from None
    try:
        return CompressedTokenMap.from_tokenizer(tokenizer, source.args.engram_compressed_vocab_size)
    except ConfigError as e:
        raise ConvertError(f"{source.tokenizer}: {e}") from None


def _write_tokenizer(source: Source, work: Path, token_map) -> str:
    """Copy the tokenizer files and write the token map; returns the copied tokenizer.json's SHA-256."""
    from mlx_dsv41.chat import TEMPLATE_TYPE

    for name in layout.TOKENIZER_FILES:
        file = source.tokenizer.parent / name
        if not file.is_file():
            continue
        if name == "tokenizer_config.json":
            # The release ships no usable chat template (docs/chat.md#chat-encoding): name ours, so
            # that mlx-lm's `apply_chat_template` (and its server) render the official DeepSeek-V4.1
            # encoding.
            try:
                config = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConvertError(f"{file}: not valid JSON ({e})") from None
            config.pop("chat_template", None)
            config["chat_template_type"] = TEMPLATE_TYPE
            _write_json(work / name, config)
            continue
        tmp = work / (name + ".tmp")
        shutil.copyfile(file, tmp)
        os.replace(tmp, work / name)
    tokenizer_sha256 = hashlib.sha256((work / "tokenizer.json").read_bytes()).hexdigest()
    if token_map is not None:
        _write_json(
            work / layout.TOKEN_MAP,
            {
                "format": layout.TOKEN_MAP_FORMAT,
                "size": token_map.size,
                "tokenizer_sha256": tokenizer_sha256,
                "ids": token_map.ids.tolist(),
            },
            indent=None,
        )
    return tokenizer_sha256


def _write_shards(source: Source, steps: list[Step], work: _Workdir, report: _Reporter) -> dict[str, str]:
    """One output shard per source shard that has tensors to keep; returns the weight map."""
    ckpt = source.ckpt
    groups: dict[Path, list[Step]] = {}
    origins: dict[Path, object] = {}  # source shard -> the checkpoint it belongs to
    for step in steps:
        origin = step.origin or ckpt
        shard = origin.weight_map[step.primary]
        groups.setdefault(shard, []).append(step)
        origins[shard] = origin
    crash_after = int(os.environ.get(CRASH_ENV) or 0)
    weight_map, written = {}, 0
    total = sum(step.out_bytes for step in steps)
    with report.bar(total, "weights") as bar:
        for i, (src_shard, shard_steps) in enumerate(groups.items()):
            name = layout.shard_name(i + 1, len(groups))
            for step in shard_steps:
                weight_map.update({out_name: name for out_name, _, _ in step.outputs})
            if work.shard_done(name, src_shard.name):
                bar.update(sum(step.out_bytes for step in shard_steps))
                continue
            specs = [spec for step in shard_steps for spec in step.outputs]
            with SafetensorsWriter(work.path / name, specs, {"format": "mlx"}) as writer:
                for step in shard_steps:
                    for out_name, data in step.run(origins[src_shard]):
                        writer.write(out_name, data)
                        bar.update(data.nbytes)
                    mx.clear_cache()
            work.record_shard(name, src_shard.name, (work.path / name).stat().st_size)
            origins[src_shard].release(src_shard)
            written += 1
            if crash_after and written >= crash_after:
                sys.stderr.flush()
                os._exit(75)  # the test hook: like a kill, nothing after this runs
    return weight_map


def _write_engram(source: Source, work: Path, report: _Reporter) -> dict:
    """One row file per Engram layer; returns their records for config.json."""
    records = {}
    if source.tables:
        (work / layout.ENGRAM_DIR).mkdir(exist_ok=True)
    for i, (layer, table) in enumerate(source.tables.items()):
        rel = layout.engram_rows_file(layer)
        rows = source.args.engram_num_embeddings[i]
        with report.bar(rows, f"engram layer {layer}") as bar:
            done = [0]

            def progress(rows_done, _total, bar=bar, done=done):
                bar.update(rows_done - done[0])
                done[0] = rows_done

            write_engram_rows(table, work / rel, layer, rows, progress=progress)
        fd, header = open_row_file(work / rel, expected_rows=rows, layer_id=layer, head_dim=source.args.engram_head_dim)
        os.close(fd)
        records[str(layer)] = {
            "file": rel,
            "rows": header.rows,
            "row_bytes": header.row_bytes,
            "data_sha256": hashlib.sha256(header.chunk_digests).hexdigest(),
        }
    return records


def _block(
    source: Source,
    steps: list[Step],
    weight_map: dict[str, str],
    engram: dict,
    tokenizer_sha256: str,
    dtype: str | None,
    fingerprint: str,
    work: Path,
) -> dict:
    formats: dict[str, set[str]] = {}
    for step in steps:
        if step.site_class is not None:
            formats.setdefault(step.site_class, set()).add(step.fmt)
    files = sorted(set(weight_map.values()))
    block = {
        "format": layout.FORMAT,
        "format_version": layout.FORMAT_VERSION,
        "converter": f"mlx_dsv41 {__version__}",
        "fingerprint": fingerprint,
        "source": {
            "kind": source.kind,
            "path": str(source.path.resolve()),
            "quantization_config": source.quantization,
            "fingerprint": source.fingerprint,
        },
        "engram_source": None
        if source.engram_path is None
        else {"path": str(source.engram_path.resolve()), "fingerprint": source.engram_fingerprint},
        "dspark_source": None
        if source.dspark_path is None
        else {
            "path": str(source.dspark_path.resolve()),
            "fingerprint": source.dspark_fingerprint or source.fingerprint,
        },
        "options": {"dtype": dtype},
        "formats": {k: sorted(v) for k, v in sorted(formats.items())},
        "weights": {"shards": len(files), "total_size": sum((work / f).stat().st_size for f in files)},
    }
    if engram:  # Engram layers: their row files and the token map
        block["engram"] = {"token_map": layout.TOKEN_MAP, "layers": engram, "tokenizer_sha256": tokenizer_sha256}
    return block


def _write_meta(source: Source, weight_map: dict[str, str], block: dict, work: Path) -> None:
    _write_json(
        work / layout.INDEX,
        {
            "metadata": {"total_size": block["weights"]["total_size"], "format": "mlx"},
            "weight_map": dict(sorted(weight_map.items())),
        },
    )
    (work / layout.SHIM).write_text(layout.SHIM_SOURCE)
    config = copy.deepcopy(source.config)
    # mlx-lm would quantize the model itself (docs/mlx.md#mlx-lm-load)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # mlx-lm reads eos at the root
        config.setdefault(key, getattr(source.args, key))
    config["model_file"] = layout.SHIM
    config[layout.BLOCK] = block
    _write_json(work / layout.CONFIG, config)


def _verify(work: Path, block: dict) -> None:
    """The output must load: the model built lazily (every tensor through the seam) and the
    Engram stores opened. A failure here is a converter bug; the partial stays unfinished."""
    from mlx_dsv41.loading import LoadError, attach_engram, load_model

    try:
        model = load_model(work, lazy=True)
        for store in attach_engram(model, work, "pread", block=block).values():
            store.close()
    except LoadError as e:
        raise ConvertError(f"{work}: the converted checkpoint does not load ({e}); please report this") from None


# ------------------------------------------------------------------------------ progress


class _NoBar:
    def update(self, n: int) -> None:
        pass


class _Reporter:
    """Progress bars and status lines on stderr, or nothing."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    @contextmanager
    def bar(self, length: int, label: str):
        if not self.enabled or not length:
            yield _NoBar()
            return
        import click

        with click.progressbar(
            length=length, label=label, file=sys.stderr, show_pos=False, show_percent=True, show_eta=True, width=32
        ) as bar:
            yield bar
