"""Every registered kernel's generated Metal source compiles (against a stand-in Metal header) and
its CUDA source compiles with nvcc. A compile check, not a run: GPU runs are in tests/gpu/."""

import shutil

import pytest

from mlx_dsv41 import kernels
import kernel_source_check as source_check

CASES = [
    (name, i)
    for name, k in sorted(kernels.load_all().items())
    for i in range(len(k.examples()) if k.examples else 0)
]


def test_every_kernel_has_examples():
    missing = [n for n, k in kernels.load_all().items() if not k.examples or not k.examples()]
    assert not missing, f"kernels without example launches: {missing}"


@pytest.mark.parametrize("name,i", CASES)
def test_metal_source_compiles(name, i):
    k = kernels.REGISTRY[name]
    src = source_check.metal_source(k, k.examples()[i])
    ok, log = source_check.compile_metal(src)
    assert ok, f"{name} example {i}:\n{log[:4000]}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("name,i", CASES)
def test_cuda_source_compiles(name, i):
    k = kernels.REGISTRY[name]
    src = source_check.cuda_source(k, k.examples()[i])
    ok, log = source_check.compile_cuda(src)
    assert ok, f"{name} example {i}:\n{log[:4000]}"
