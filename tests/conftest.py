import os
from pathlib import Path

import pytest

# Tests must not depend on the developer's shell.
os.environ.setdefault("MLX_DSV41_ATTENTION", "auto")

_GPU_DIR = Path(__file__).resolve().parent / "gpu"


_GPU_SKIP = "needs an MLX GPU backend (run on the device machine)"


def pytest_collection_modifyitems(config, items):
    from mlx_dsv41.kernels import backend

    on_cpu = backend() == "cpu"
    skip = pytest.mark.skip(reason=_GPU_SKIP)
    for item in items:
        if _GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
        if on_cpu and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every GPU skip reported at one place (tests/gpu), so `-ra` folds them into one summary line
    instead of one per test location."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and isinstance(report.longrepr, tuple):
        report.longrepr = (str(_GPU_DIR), None, f"Skipped: {_GPU_SKIP}")


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
