"""DeepSeek-V4.1-Flash for MLX.

Importing the package is cheap; the names below load their modules on first use:
`ModelArgs` (config), `Model` (model.deepseek_v41), `load_model` and `load` (loading), and so do
submodules used as attributes (`mlx_dsv41.demo.ensure_demo()`).

    model, tokenizer = mlx_dsv41.load("path/to/converted")   # see `python -m mlx_dsv41.convert`
"""

import os
import sys
from importlib import import_module
from importlib.util import find_spec

# fp32 matmuls (router logits, the fp32 head, compressor pooling) are fp32 model semantics
# (docs/numerics.md#tf32). MLX otherwise runs them as TF32 on CUDA and M5-class GPUs; it reads this
# variable once, at the first matmul of the process, so it must be set before any model code runs.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# MLX's CUDA backend records launches into CUDA graphs of at most this many nodes (100 on an H100 /
# H200): a decode step of ~850 nodes in ~1 graph queues ~1.7 ms faster than in ~9 on the H200
# (docs/design.md#graph-size). Read once, when MLX first uses the GPU. Metal reads the same variable
# for its command buffers (its defaults are per machine, not measured here): left alone on macOS.
if sys.platform != "darwin":
    os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1000")

__version__ = "0.1.0"

_LAZY = {
    "ModelArgs": "mlx_dsv41.config",
    "Model": "mlx_dsv41.model.deepseek_v41",
    "load_model": "mlx_dsv41.loading",
    "load": "mlx_dsv41.loading",
}


# mlx-lm's tokenizer loader imports `mlx_lm.chat_templates.<chat_template_type>`; a converted
# tokenizer_config.json names "mlx_dsv41", which this makes resolve to mlx_dsv41.chat.
from mlx_dsv41.chat import register_with_mlx_lm as _register_chat_template  # noqa: E402

_register_chat_template()


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if not name.startswith("_") and find_spec(f"{__name__}.{name}") is not None:  # mlx_dsv41.demo, ...
        return import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'mlx_dsv41' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
