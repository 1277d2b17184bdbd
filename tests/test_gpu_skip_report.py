"""On a machine without an MLX GPU, the GPU tests are skipped and reported as skipped in one
summary line (tests/conftest.py), not one line per test location."""

import re
import subprocess
import sys

import pytest
from demo_helpers import REPO

from mlx_dsv41.kernels import backend


@pytest.mark.skipif(backend() != "cpu", reason="the GPU tests run here")
def test_gpu_skips_fold_into_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    skipped = re.findall(r"^SKIPPED.*$", r.stdout, re.M)
    total = int(re.search(r"(\d+) skipped", r.stdout).group(1))
    assert total > 0 and skipped == [
        f"SKIPPED [{total}] tests/gpu: needs an MLX GPU backend (run on the device machine)"
    ], r.stdout
