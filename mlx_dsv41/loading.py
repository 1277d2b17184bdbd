"""Checkpoint directory -> Model.

Now: a directory with the HF nested `config.json` and `*.safetensors` in the official tensor names
(plain bf16 / fp32 tensors, or any format the quant seam recognises per tensor). Tensors are
loaded lazily (`mx.load`): nothing is read until the parameters are evaluated, and tensors the
model drops (the Engram tables, vision, MTP) are never read.

Later (issue 3): converted directories and `mlx_dsv41.load()` (model + tokenizer + Engram store)
build on `load_model`; the steps below (read config, collect tensors, check, sanitize, load) stay.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .config import ModelArgs
from .model.deepseek_v41 import Model


class LoadError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor and what was expected."""


# Stored in fp32 in the release and computed from fp32 (spec §3): a lower-precision copy would
# silently lose bits, so it is refused rather than cast.
_FP32_STORED = re.compile(r"\.(hc_(attn|ffn)_(fn|base|scale)|attn_sink|ffn\.gate\.bias)$")


def checkpoint_tensors(path: str | Path) -> dict[str, mx.array]:
    """Every tensor of the directory's safetensors shards, lazily, by name.

    With `model.safetensors.index.json`, exactly the shards it lists (each must exist)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index}: no weight_map object")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise LoadError(f"{path}: no *.safetensors files")
    tensors: dict[str, mx.array] = {}
    for shard in shards:
        file = path / shard
        if not file.exists():
            raise LoadError(f"{file}: shard listed in {index.name} is missing")
        for name, value in mx.load(str(file)).items():
            if name in tensors:
                raise LoadError(f"tensor {name} is stored twice (again in {shard})")
            tensors[name] = value
    return tensors


def check_stored(tensors: dict[str, mx.array]) -> None:
    """Dtype rules on the stored tensors themselves (before any re-layout)."""
    for name, value in tensors.items():
        if _FP32_STORED.search(name) and value.dtype != mx.float32:
            raise LoadError(f"{name}: stored as {value.dtype}, expected float32 "
                            f"(mHC parameters, attention sinks and the router bias are fp32, spec §3)")


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
            raise LoadError(f"{name}: expected a {'float' if mx.issubdtype(want.dtype, mx.floating) else want}"
                            f" tensor, got {value.dtype}")


def load_model(path: str | Path, *, lazy: bool = True,
               expert_range: tuple[int, int] | None = None) -> Model:
    """The Model stored in `path` (config.json + safetensors in official names).

    lazy=False reads every parameter now; otherwise on first use. `expert_range` keeps only those
    routed experts (the others' tensors are never read)."""
    path = Path(path)
    args = ModelArgs.from_file(path / "config.json")
    tensors = checkpoint_tensors(path)
    check_stored(tensors)
    model = Model(args, expert_range)
    try:
        weights = model.sanitize(tensors)
    except ValueError as e:  # the quant seam's FormatError: already names the tensor
        raise LoadError(f"{path}: {e}") from None
    check_parameters(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    return model
