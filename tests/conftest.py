import os
import re
import subprocess
import sys
import time
from pathlib import Path

import demo_helpers
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


# The demo checkpoint for the test files that run it: `env` (subprocess environment) and `loaded`
# ((model, tokenizer)) once per test module, one demo server per session.
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return demo_helpers.demo_env(tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    import mlx_dsv41

    return mlx_dsv41.load(demo_helpers.demo_checkpoint(tmp_path_factory))


@pytest.fixture(scope="session", name="server")
def demo_server(tmp_path_factory):
    """(host, port, log file) of the session's demo server (default max_tokens 4)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_dsv41.server", "--demo", "--port", "0", "--max-tokens", "4", "--warmup", "12"],
            cwd=demo_helpers.REPO,
            env=demo_helpers.demo_env(tmp_path_factory),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 120
        while True:
            m = re.search(r"Serving on http://([\d.]+):(\d+)", log.read_text())
            if m:
                break
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"server did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.2)
        yield m.group(1), int(m.group(2)), log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
