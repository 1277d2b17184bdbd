"""DeepSeek-V4.1-Flash for MLX.

Importing the package is cheap; the names below load their modules on first use:
`ModelArgs` (config), `Model` (model.deepseek_v41), `load_model` (loading).
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {"ModelArgs": "mlx_dsv41.config", "Model": "mlx_dsv41.model.deepseek_v41",
         "load_model": "mlx_dsv41.loading"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlx_dsv41' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
