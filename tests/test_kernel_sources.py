"""Every registered kernel's generated Metal source compiles (against a stand-in Metal header) and
its CUDA source compiles with nvcc. A compile check, not a run: GPU runs are in tests/gpu/."""

import re
import shutil

import kernel_source_check as source_check
import pytest

from mlx_dsv41 import kernels

CASES = [
    (name, i) for name, k in sorted(kernels.load_all().items()) for i in range(len(k.examples()) if k.examples else 0)
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


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", sorted(kernels.load_all()))
def test_pruned_source_compiles_to_the_same_ptx(name):
    """What Kernel.source removes (comments, decided conditionals, header items the body does not
    reach; kernels/source_text.py) changes nothing compiled: the PTX of a kernel's first example is
    the PTX of its whole headers."""
    k = kernels.REGISTRY[name]
    call = k.examples()[0]
    pruned_ptx, log = source_check.cuda_ptx(source_check.cuda_source(k, call))
    assert pruned_ptx is not None, log[:4000]
    whole_ptx, log = source_check.cuda_ptx(source_check.cuda_source(k, call, source=k.whole_source("cuda")))
    assert whole_ptx is not None, log[:4000]
    assert pruned_ptx == whole_ptx, f"{name}: pruning changed the PTX"


def test_exl3_launch_constants_match_the_format():
    """The launcher's copies of format facts (it imports nothing of mlx_dsv41.exl3): the 128-block,
    and each codebook's CB template value, the header's EXL3_CB_* number."""
    from mlx_dsv41 import metal_ext
    from mlx_dsv41.exl3.codebook import CODEBOOKS
    from mlx_dsv41.exl3.hadamard import BLOCK
    from mlx_dsv41.kernels import exl3 as launch
    from mlx_dsv41.kernels.exl3 import CODEBOOK_IDS

    assert launch.BLOCK == BLOCK
    defined = re.findall(r"^#define EXL3_CB_(\w+) (\d+)$", metal_ext.read("exl3_decode.h"), re.M)
    assert {name.lower(): int(v) for name, v in defined} == CODEBOOK_IDS
    assert set(CODEBOOK_IDS) == set(CODEBOOKS)


def test_slot_rule_is_written_once():
    """Which launch writes an expert slot: the numbers live in SlotStack only. The headers and
    bodies use the names (and define none); every expert kernel's source defines them."""
    from mlx_dsv41 import metal_ext
    from mlx_dsv41.kernels import exl3

    assert all(s < 0 for s in exl3.SlotStack)  # the bodies test `pos < 0` for "not this launch"
    names = [name for name, _ in exl3.SLOT_DEFINES]
    header = metal_ext.read("exl3_experts.h")
    assert all(name in header for name in names)
    for source in [header] + [metal_ext.body(k.name) for k in kernels.load_all().values()]:
        assert not re.search(r"#define\s+EXL3_SLOT_", source)
        assert not re.search(r"pos\s*[=!]=\s*-\d|:\s*-[12]\s*;", source)
    users = [k for k in kernels.load_all().values() if "exl3_experts.h" in k.includes]
    assert users
    for k in users:
        header_text, _ = k.source("cuda")
        for name, value in exl3.SLOT_DEFINES:
            assert f"#define {name} ({value})" in header_text, k.name


def test_threadgroup_memory_is_declared_at_kernel_scope():
    """Metal takes threadgroup variables at a kernel's own scope only, and the stand-in header CI
    compiles against does not check it: every KX_SHARED / KX_SHARED16 in a body starts its line."""
    from mlx_dsv41 import metal_ext

    for k in kernels.load_all().values():
        nested = [line for line in metal_ext.body(k.name).splitlines() if re.match(r"\s+KX_SHARED", line)]
        assert not nested, (k.name, nested)
