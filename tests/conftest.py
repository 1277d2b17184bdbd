import os

import pytest

# Tests must not depend on the developer's shell: one thread count, no forced backend.
os.environ.setdefault("MLX_DSV41_ATTENTION", "auto")


def pytest_collection_modifyitems(config, items):
    from mlx_dsv41.kernels import backend

    if backend() != "cpu":
        return
    skip = pytest.mark.skip(reason="needs an MLX GPU backend (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
