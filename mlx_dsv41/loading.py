"""Checkpoint directory -> Model; converted directory -> (model, tokenizer).

`load_model(path)` builds the Model from any directory with the HF nested `config.json` and
`*.safetensors` in the official tensor names, in any format the quant seam recognises per tensor
(plain bf16 / fp32, EXL3, official FP8/FP4, converted MX). Tensors are loaded lazily (`mx.load`):
nothing is read until the parameters are evaluated, and tensors the model drops (the Engram
tables, vision; the DSpark head `mtp.*` when the config cannot draft) or experts outside
`expert_range` are never read.

`load(path)` is the user entry point for a directory written by `python -m mlx_dsv41.convert`
(layout: `mlx_dsv41/layout.py`): the model with its Engram token map and SSD row stores
(`engram_store.EngramStore`, one per Engram layer) attached, and an mlx-lm TokenizerWrapper, so the
pair works with `mlx_lm.generate`. `checkpoint_kind(path)` tells a converted directory from an
EXL3 or official source that still needs converting. Every problem is a one-line `LoadError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_dsv41 import layout
from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.engram_store import EngramStore, EngramStoreError
from mlx_dsv41.model.deepseek_v41 import FP32_STORED, Model
from mlx_dsv41.model.engram_hash import CompressedTokenMap


class LoadError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor and what was expected."""


def checkpoint_tensors(path: str | Path) -> dict[str, mx.array]:
    """Every tensor of the directory's safetensors shards, lazily, by name.

    With `model.safetensors.index.json`, exactly the shards it lists (each must exist)."""
    path = Path(path)
    index = path / layout.INDEX
    if index.exists():
        data = _read_json(index, f"{index}: missing")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index}: no weight_map object")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise LoadError(f"{path}: no *.safetensors files")
    from mlx_dsv41.convert.safetensors_io import SafetensorsError, SafetensorsFile

    tensors: dict[str, mx.array] = {}
    for shard in shards:
        file = path / shard
        if not file.exists():
            raise LoadError(f"{file}: shard listed in {index.name} is missing")
        try:  # strict header check (truncation, sizes that lie): mx.load would fail only on first read
            SafetensorsFile(file).close()
        except SafetensorsError as e:
            raise LoadError(str(e)) from None
        for name, value in mx.load(str(file)).items():
            if name in tensors:
                raise LoadError(f"tensor {name} is stored twice (again in {shard})")
            tensors[name] = value
    return tensors


def check_stored(tensors: dict[str, mx.array]) -> None:
    """Dtype rules on the stored tensors themselves (before any re-layout): a lower-precision copy of
    an fp32 tensor would silently lose bits, so it is refused rather than cast."""
    for name, value in tensors.items():
        if FP32_STORED.search(name) and value.dtype != mx.float32:
            raise LoadError(
                f"{name}: stored as {value.dtype}, expected float32 "
                "(mHC parameters, attention sinks and the router bias are fp32, "
                "docs/numerics.md#dtypes)"
            )


def check_parameters(model: Model, weights: dict[str, mx.array]) -> None:
    """The sanitized weights must be exactly the model's parameters, shape for shape."""
    expected = dict(tree_flatten(model.parameters()))
    missing = [k for k in expected if k not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"missing tensor {missing[0]}{more}")
    unexpected = [k for k in weights if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise LoadError(f"unexpected tensor {unexpected[0]}{more}: not a parameter of this model")
    for name, value in weights.items():
        want = expected[name]
        if value.shape != want.shape:
            raise LoadError(f"{name}: expected shape {list(want.shape)}, got {list(value.shape)}")
        if mx.issubdtype(want.dtype, mx.floating) != mx.issubdtype(value.dtype, mx.floating):
            raise LoadError(
                f"{name}: expected a {'float' if mx.issubdtype(want.dtype, mx.floating) else want}"
                f" tensor, got {value.dtype}"
            )


def load_model(path: str | Path, *, lazy: bool = True, expert_range: tuple[int, int] | None = None) -> Model:
    """The Model stored in `path` (config.json + safetensors in official names).

    lazy=False reads every parameter now; otherwise on first use. `expert_range` keeps only those
    routed experts (the others' tensors are never read)."""
    path = Path(path)
    args = ModelArgs.from_file(path / layout.CONFIG)
    tensors = checkpoint_tensors(path)
    check_stored(tensors)
    model = Model(args, expert_range)
    try:
        weights = model.sanitize(tensors)
    except ValueError as e:  # the quant seam's FormatError: already names the tensor
        raise LoadError(f"{path}: {e}") from None
    check_parameters(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    # Only the model may hold the stored tensors now, and parameters are read one at a time: a
    # parameter built from others (a layer's experts stacked) frees its sources as soon as it is
    # evaluated, so loading peaks at the parameters' bytes plus one such parameter, not two copies.
    del tensors, weights
    if not lazy:
        for _, value in tree_flatten(model.parameters()):
            mx.eval(value)
    return model


# ------------------------------------------------------------------------------ converted directories


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n"))


def _read_json(file: Path, missing: str):
    """The parsed JSON file; LoadError(`missing`) if it does not exist, or if it is not JSON."""
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise LoadError(missing) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{file}: not valid JSON ({_one_line(e)})") from None


def read_config(path: str | Path) -> dict:
    """The directory's config.json as a dict (LoadError if absent or not JSON)."""
    file = Path(path) / layout.CONFIG
    config = _read_json(file, f"{Path(path)}: no {layout.CONFIG} (not a checkpoint directory)")
    if not isinstance(config, dict):
        raise LoadError(f"{file}: not a JSON object")
    return config


def source_quantization(config: dict) -> dict | None:
    """The quantization_config of a source config (root, or inside text_config)."""
    q = config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization_config")
    return q


def checkpoint_kind(path: str | Path) -> str:
    """ "converted" (ours, complete), "exl3" (an exllamav3 checkpoint) or "official" (the FP8/FP4
    release, or plain tensors in official names); LoadError for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"{path}: no such directory")
    config = read_config(path)
    block = config.get(layout.BLOCK)
    if isinstance(block, dict) and block.get("format") == layout.FORMAT:
        if (path / layout.STATE).exists():
            raise LoadError(f"{path}: unfinished conversion; rerun `python -m mlx_dsv41.convert` to complete it")
        return "converted"
    if config.get("model_type") != "deepseek_v41" and "DeepseekV41ForCausalLM" not in (
        config.get("architectures") or ()
    ):
        raise LoadError(
            f"{path}: model_type {config.get('model_type')!r} is not DeepSeek-V4.1 (expected 'deepseek_v41')"
        )
    quant = source_quantization(config)
    if quant is None:
        return "official"
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "exl3":
        return "exl3"
    if method == "fp8":
        block_size, fmt = list(quant.get("weight_block_size") or ()), quant.get("scale_fmt")
        if block_size != [32, 32] or fmt != "ue8m0":
            raise LoadError(
                f"{path}: fp8 with weight_block_size {block_size} and scale_fmt {fmt!r} is "
                f"not the DeepSeek-V4.1 release format ([32, 32], 'ue8m0')"
            )
        return "official"
    raise LoadError(
        f"{path}: quantization_config.quant_method {method!r} is not supported "
        f"(expected 'exl3' or the official release's 'fp8')"
    )


def is_converted(path: str | Path) -> bool:
    """True for a complete directory written by `python -m mlx_dsv41.convert`."""
    try:
        return checkpoint_kind(path) == "converted"
    except LoadError:
        return False


def _converted_block(path: Path) -> dict:
    kind = checkpoint_kind(path)
    if kind != "converted":
        extra = " --engram-from DIR_WITH_THE_OFFICIAL_ENGRAM_SHARDS" if kind == "exl3" else ""
        raise LoadError(
            f"{path} is an {kind} checkpoint, not a converted one; convert it first: "
            f"python -m mlx_dsv41.convert {path} OUT{extra}"
        )
    block = read_config(path)[layout.BLOCK]
    if block.get("format_version") != layout.FORMAT_VERSION:
        raise LoadError(
            f"{path}: converted layout version {block.get('format_version')}, this mlx_dsv41 "
            f"reads version {layout.FORMAT_VERSION}; convert the source again"
        )
    return block


def read_token_map(path: Path, args: ModelArgs, tokenizer_sha256: str) -> CompressedTokenMap:
    """The stored compressed-token map; it must be the one built from this directory's tokenizer."""
    file = path / layout.TOKEN_MAP
    data = _read_json(file, f"{file}: missing (the Engram token map); convert the source again")
    if not isinstance(data, dict) or data.get("format") != layout.TOKEN_MAP_FORMAT:
        raise LoadError(
            f"{file}: not a token map of format {layout.TOKEN_MAP_FORMAT} (what this mlx_dsv41 reads); "
            f"convert the source again"
        )
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise LoadError(f"{tokenizer}: missing (the tokenizer the Engram token map was built from)")
    if (
        data.get("tokenizer_sha256") != tokenizer_sha256
        or hashlib.sha256(tokenizer.read_bytes()).hexdigest() != tokenizer_sha256
    ):
        raise LoadError(f"{file}: was not built from this directory's tokenizer.json; convert the source again")
    ids = np.asarray(data.get("ids", []), dtype=np.int64)
    size = data.get("size")
    if size != args.engram_compressed_vocab_size or ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= size:
        raise LoadError(
            f"{file}: {size} compressed ids over {len(ids)} tokens does not fit the config "
            f"(engram_compressed_vocab_size {args.engram_compressed_vocab_size})"
        )
    return CompressedTokenMap(ids=ids, size=size)


def attach_engram(
    model: Model, path: str | Path, mode: str | None = None, block: dict | None = None
) -> dict[int, EngramStore]:
    """Open the converted directory's Engram row files (`mode`: EngramStore's, default
    $MLX_DSV41_ENGRAM_MODE or "auto") and its token map, and set them on `model`.

    `block` is the config's mlx_dsv41 block (default: read and checked from `path`). Returns the
    stores, which the model now reads from (close them when done with the model)."""
    path = Path(path)
    args = model.args
    if not args.engram_layer_ids:
        return {}
    block = _converted_block(path) if block is None else block
    engram = block.get("engram") or {}
    tables = engram.get("layers") or {}
    mode = mode or os.environ.get("MLX_DSV41_ENGRAM_MODE", "auto")
    stores: dict[int, EngramStore] = {}
    try:
        token_map = read_token_map(path, args, engram.get("tokenizer_sha256"))
        for i, layer in enumerate(args.engram_layer_ids):
            store = EngramStore(
                path / layout.engram_rows_file(layer),
                mode=mode,
                expected_rows=args.engram_num_embeddings[i],
                layer_id=layer,
                head_dim=args.engram_head_dim,
            )
            stores[layer] = store
            recorded = (tables.get(str(layer)) or {}).get("data_sha256")
            if hashlib.sha256(store.header.chunk_digests).hexdigest() != recorded:
                raise LoadError(
                    f"{store.path}: its checksum differs from the one recorded in "
                    f"{layout.CONFIG} (a row file of another conversion?)"
                )
        model.set_engram(token_map, stores)
    except (EngramStoreError, ConfigError, ValueError) as e:
        for store in stores.values():
            store.close()
        raise LoadError(_one_line(e)) from None
    return stores


def load_converted(
    path: str | Path, *, lazy: bool = True, engram_mode: str | None = None, expert_range: tuple[int, int] | None = None
) -> Model:
    """The Model of a converted directory with its Engram stores attached (no tokenizer)."""
    path = Path(path)
    _converted_block(path)
    try:
        model = load_model(path, lazy=lazy, expert_range=expert_range)
    except LoadError:
        raise
    except (ConfigError, ValueError, RuntimeError, OSError) as e:  # mx.load / eval of a bad shard
        raise LoadError(f"{path}: {_one_line(e)}") from None
    attach_engram(model, path, engram_mode)
    return model


def converted_model_class(path: str | Path) -> type:
    """A Model class whose instances attach the Engram stores of `path` (the model.py shim's
    Model: mlx-lm builds it as Model(args), then sanitizes and loads the weights itself)."""
    path = Path(path)

    class ConvertedModel(Model):
        def __init__(self, args: ModelArgs, expert_range: tuple[int, int] | None = None):
            super().__init__(args, expert_range)
            attach_engram(self, path)

    ConvertedModel.__doc__ = f"DeepSeek-V4.1 with the Engram row stores of {path}."
    return ConvertedModel


class _ModelTypeWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("You are using a model of type")


@contextmanager
def _no_model_type_warning():
    """transformers warns that loading the tokenizer meets a config whose model_type
    ("deepseek_v41") it has no class for: true and harmless here, so it is dropped."""
    logger, drop = logging.getLogger("transformers.configuration_utils"), _ModelTypeWarning()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def load(
    path: str | Path, *, lazy: bool = False, engram_mode: str | None = None, expert_range: tuple[int, int] | None = None
):
    """(model, tokenizer) of a converted directory.

    lazy=False reads every parameter now; otherwise on first use. `engram_mode` is the Engram
    store's read mode ("pread", "mmap", "ram" or "auto"). `expert_range=(lo, hi)` keeps only
    routed experts lo..hi-1 (expert parallelism); the other experts' tensors are never read.
    The tokenizer is mlx-lm's TokenizerWrapper, so the pair works with `mlx_lm.generate`.
    """
    path = Path(path)
    model = load_converted(path, lazy=lazy, engram_mode=engram_mode, expert_range=expert_range)
    try:
        from mlx_lm.utils import load_config, load_tokenizer

        with _no_model_type_warning():
            tokenizer = load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))
    except Exception as e:  # noqa: BLE001 (transformers raises many types; the message is what counts)
        for store in model.engram_sources.values():
            store.close()
        raise LoadError(f"{path}: cannot load the tokenizer ({_one_line(e)})") from None
    return model, tokenizer
