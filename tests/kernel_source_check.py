"""Compile the generated kernel sources without a GPU (CI).

Metal: MLX prints the Metal source it would compile when a kernel is traced by
``mx.export_function`` with ``verbose=True`` (this works without Metal); the text is compiled as
C++ against ``tests/kernel_stubs/metal_stub.h``. CUDA: ``mx.fast.cuda_kernel`` cannot be built without
the CUDA backend, so the source is assembled the way MLX 0.32's ``build_kernel`` does and compiled
with ``nvcc -ptx`` against a stand-in of MLX's prelude header. Neither replaces running the
kernels; both catch name, type and syntax errors before a device is involved.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from mlx_dsv41 import kernels
from mlx_dsv41.kernels import Kernel

# Stand-in headers (not installed: they exist only to compile sources in CI).
STUBS = Path(__file__).resolve().parent / "kernel_stubs"


def _capture_fd1(fn) -> str:
    """Run fn() and return what C++ code wrote to file descriptor 1 meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode()


def metal_source(kernel: Kernel, call: dict) -> str:
    """The Metal source MLX generates for one call of ``kernel`` (without MLX's utils prelude)."""
    inputs = list(call["inputs"])
    rest = {k: v for k, v in call.items() if k != "inputs"}

    def traced(*arrays):
        return kernel(inputs=arrays, backend_name="metal", verbose=True, **rest)

    with tempfile.TemporaryDirectory() as tmp:
        out = _capture_fd1(lambda: mx.export_function(str(Path(tmp) / "k.mlxfn"), traced, *inputs))
    m = re.search(r"```\n(.*?)```", out, re.S)
    if not m:
        raise RuntimeError(f"no Metal source printed for {kernel.name}: {out[:500]}")
    return m.group(1)


def cuda_source(kernel: Kernel, call: dict, source: tuple[str, str] | None = None) -> str:
    """The CUDA source MLX 0.32 would JIT for one call (assembled as MLX's build_kernel does), from
    the kernel's (header, body) or the given ones; without the arguments the call names ``absent``
    (the launch leaves them out: kernels.absent_prelude)."""
    left_out = kernel.left_out("cuda", call["inputs"], call["output_dtypes"], call.get("absent", ()))
    header, body = source or kernel.source("cuda")
    body = kernels.absent_prelude(body, *left_out) + body
    lines = [
        '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
        "#define inf cuda::std::numeric_limits<float>::infinity()\n",
        header,
        "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n",
        f"__global__ void custom_kernel_{kernel.name}(",
    ]
    params = []
    for name, arr in zip(kernel.input_names, call["inputs"]):
        if name in left_out[0]:
            continue
        params.append(f"    const {kernels.CUDA_TYPES[arr.dtype]}* {name}")
        if arr.ndim > 0:
            for suffix, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if name + suffix in body:
                    params.append(f"    const __grid_constant__ {ctype} {name}{suffix}")
    for name, dtype in zip(kernel.output_names, call["output_dtypes"]):
        if name not in left_out[1]:
            params.append(f"    {kernels.CUDA_TYPES[dtype]}* {name}")
    lines.append(",\n".join(params) + ") {")
    for tname, value in call.get("template") or []:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {tname} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {tname} = {value};")
        else:
            lines.append(f"  using {tname} = {kernels.CUDA_TYPES[value]};")
    lines.append(body)
    lines.append("}\n}  // namespace mlx::core::cu\n")
    return "\n".join(lines)


def compile_metal(source: str) -> tuple[bool, str]:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return False, "no C++ compiler found"
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(source)
    try:
        r = subprocess.run(
            [
                cxx,
                "-std=c++17",
                "-fsyntax-only",
                "-Wno-attributes",
                "-Werror=return-type",
                "-include",
                str(STUBS / "metal_stub.h"),
                "-x",
                "c++",
                f.name,
            ],
            capture_output=True,
            text=True,
        )
        return r.returncode == 0, r.stderr
    finally:
        os.unlink(f.name)


def compile_cuda(source: str) -> tuple[bool, str]:
    """(compiled, nvcc's messages) for one CUDA source."""
    ptx, log = cuda_ptx(source)
    return ptx is not None, log


@functools.cache
def cuda_ptx(source: str) -> tuple[str | None, str]:
    """(the PTX nvcc makes of source, or None; nvcc's messages). nvcc names file-local symbols after
    the file and a hash of its text; those names are replaced by one placeholder, so two sources
    that compile to the same code give the same text."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, "nvcc not found"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(source)
        r = subprocess.run(
            [nvcc, "-std=c++17", "-arch=sm_90", "-ptx", "-I", str(STUBS), "-o", str(Path(tmp) / "k.ptx"), str(src)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            return None, r.stderr
        lines = (line for line in (Path(tmp) / "k.ptx").read_text().splitlines() if not line.startswith("//"))
        return re.sub(r"_INTERNAL_[0-9a-f]{8}_\d+_k_cu_[0-9a-f]{8}", "_INTERNAL_", "\n".join(lines)), r.stderr
