"""The DeepSeek-V4.1 architecture, one concept per file (docs/design.md). `Block` and `Model` live in
`deepseek_v41`; importing this package alone loads none of them."""

from importlib import import_module

_LAZY = {"Block": "deepseek_v41", "Model": "deepseek_v41"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
