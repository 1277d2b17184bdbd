import os
from pathlib import Path

import pytest

# Tests must not depend on the developer's shell.
os.environ.setdefault("MLX_DSV41_ATTENTION", "auto")

_GPU_DIR = Path(__file__).resolve().parent / "gpu"


def pytest_collection_modifyitems(config, items):
    from mlx_dsv41.kernels import backend

    on_cpu = backend() == "cpu"
    skip = pytest.mark.skip(reason="needs an MLX GPU backend (run on the device machine)")
    for item in items:
        if _GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
        if on_cpu and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_selection(monkeypatch):
    """The sparse-attention variant selection and counters reset around a test."""
    from mlx_dsv41.kernels import sparse_attention as sa

    monkeypatch.delenv(sa.ENV_VAR, raising=False)
    sa.set_default_variant(None)
    sa.reset_variant_counts()
    yield
    sa.set_default_variant(None)
    sa.reset_variant_counts()
