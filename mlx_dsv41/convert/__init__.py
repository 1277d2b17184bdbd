"""Checkpoint conversion: EXL3 and official FP8/FP4 DeepSeek-V4.1 checkpoints (+ the official
Engram tables) -> the converted layout of `mlx_dsv41/layout.py`.

    from mlx_dsv41.convert import convert_checkpoint, ConvertError
    convert_checkpoint("DeepSeek-V4.1-Flash-EXL3", "flash-mlx", engram_from="DeepSeek-V4.1-Flash")

The names load their modules on first use (the row-file and safetensors tools need no MLX).
"""

from importlib import import_module

_LAZY = {"convert_checkpoint": "mlx_dsv41.convert.checkpoint", "ConvertError": "mlx_dsv41.convert.source"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlx_dsv41.convert' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
