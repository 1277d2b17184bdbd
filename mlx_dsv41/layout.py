"""The on-disk layout of a converted checkpoint (written by `python -m mlx_dsv41.convert`, read by
`mlx_dsv41.load` and by `mlx_lm.load(OUT, trust_remote_code=True)`).

    OUT/
      config.json                    the source's HF nested config (text_config, root ids), plus
                                     "model_file": "model.py" and our "mlx_dsv41" block (below);
                                     no root or text_config "quantization_config", so mlx-lm
                                     quantizes nothing itself (docs/mlx.md#mlx-lm-load step 5)
      model.py                       mlx-lm shim: our Model, Engram bound to this directory
      model-XXXXX-of-YYYYY.safetensors   weights in official names, one shard per source shard
      model.safetensors.index.json   {"metadata": {"total_size", "format"}, "weight_map"}
      engram/engram.layers.L.rows    one Engram row file per Engram layer (mlx_dsv41.engram_store)
      engram_token_map.json          the compressed-token map, built once from tokenizer.json
      tokenizer.json, tokenizer_config.json, ... (copied from the source)

Weights keep the official tensor names; `Model.sanitize` and the quant seam decide each linear's
format from what is stored: EXL3 tensors as exllamav3 wrote them (`.trellis/.suh/.svh` + marker,
per-expert, `wo_a.slice.G`), official FP8 linears as mxfp8 (`weight` uint32 [out, in/4] +
`scales` uint8 [out, in/32]) or bf16, `wo_a` as bf16 (dequantized with its scales), FP4 experts
per expert as mxfp4 (`weight` uint32 [out, in/8] + `scales`), everything else as stored. The
DSpark head (`mtp.*`) is copied the same way when the source or --dspark-from has it. Tensors
the text model never reads (vision, `gate.bias_vl`, the Engram tables) are not copied.

The "mlx_dsv41" block of config.json:

    format: "mlx_dsv41.converted", format_version: 1, converter: package version
    source: {kind: "exl3" | "official", path, quantization_config (the source's), fingerprint}
    engram_source: {path, fingerprint} (the --engram-from directory, or the source)
    dspark_source: {path, fingerprint} (the --dspark-from directory, or the source), or null
    options: {dtype: null | "bf16"}
    formats: {site class (e.g. "attn.wq_a", "ffn.experts.w1", "mtp.main_proj"): [stored formats]}
    weights: {shards, total_size}
    engram: {token_map: file, tokenizer_sha256, layers: {"L": {file, rows, row_bytes, data_sha256}}}

`fingerprint` is a SHA-256 over the source's config.json and every shard's name, size and header:
a second conversion of the same source with the same options is a no-op, of another one is
refused. `data_sha256` is the row file header's checksum of its chunk table, so a row file swapped
for another is caught when it is opened.

While a conversion runs, everything is written under `OUT.partial/` with a `convert_state.json`
recording finished shards; the directory is renamed to OUT only when complete and verified
loadable, so OUT either does not exist or is a whole checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from mlx_dsv41.engram_store import row_file_name

FORMAT = "mlx_dsv41.converted"
FORMAT_VERSION = 1
BLOCK = "mlx_dsv41"  # config.json key of our block (a ModelArgs field, so mlx-lm's from_dict keeps it)

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SHIM = "model.py"
TOKEN_MAP = "engram_token_map.json"  # {"format": 1, "size", "tokenizer_sha256", "ids": [...]}
TOKEN_MAP_FORMAT = 1
ENGRAM_DIR = "engram"
STATE = "convert_state.json"  # present only in an unfinished OUT.partial
PARTIAL_SUFFIX = ".partial"

# Copied from the source when present (tokenizer.json is required: the Engram token map needs it).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
)


def shard_name(index: int, count: int) -> str:
    """The i-th (1-based) of `count` weight shards, named as mlx-lm's `model*.safetensors` glob expects."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def engram_rows_file(layer_id: int) -> str:
    """A layer's row file, relative to the converted directory."""
    return f"{ENGRAM_DIR}/{row_file_name(layer_id)}"


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


SHIM_SOURCE = '''"""mlx-lm entry point of a DeepSeek-V4.1 checkpoint converted by mlx_dsv41.

`mlx_lm.load(this_directory, trust_remote_code=True)` runs this file: it returns mlx_dsv41's Model
with the Engram token map and SSD row stores of this directory attached. Needs the mlx_dsv41
package, installed from its source directory: pip install -e <path to the mlx_dsv41 checkout>.
"""

from pathlib import Path

try:
    from mlx_dsv41.config import ModelArgs  # noqa: F401 (mlx-lm reads ModelArgs and Model from here)
    from mlx_dsv41.loading import converted_model_class
except ImportError as e:
    raise ImportError(f"this checkpoint was converted by mlx_dsv41, which is not importable ({e}); "
                      "install it from its source directory: pip install -e <path to the mlx_dsv41 "
                      "checkout> (see its README)") from None

Model = converted_model_class(Path(__file__).resolve().parent)
'''
