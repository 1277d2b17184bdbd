"""The single place that chooses how an op runs: a Metal kernel, a CUDA kernel, or plain MLX.

Every custom kernel is one body (``mlx_dsv41/metal_ext/<name>.metal``) compiled for the active GPU backend
with that backend's macro header. Ops (``sparse_attention``, ``exl3``) ask :func:`backend` once per
call and fall back to their plain-MLX reference on the CPU.

Launch constants (sizes, splits, scales, limits) are template values or come from input shapes,
never small arrays made on the host: on MLX's CUDA backend such arrays live in managed memory,
and a kernel that reads one after the host touched its page waits for a page migration (10-20 µs
per launch, measured; docs/design.md "Launch constants").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import mlx.core as mx
import numpy as np

from mlx_dsv41 import metal_ext
from mlx_dsv41.kernels.header_files import cuda_header
from mlx_dsv41.kernels.source_text import minified, pruned, resolved

# Metal only passes a [[thread_position_in_grid]]-style argument when its name occurs in the body
# text; the KX_* macros hide the names in the header, so every Metal body gets this comment.
_METAL_ATTRIBUTE_NAMES = (
    "thread_position_in_grid thread_position_in_threadgroup threadgroup_position_in_grid "
    "threads_per_threadgroup thread_index_in_simdgroup simdgroup_index_in_threadgroup"
)


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where kernels for the default device run.

    ``MLX_DSV41_BACKEND=cpu`` forces the plain-MLX reference paths even on a GPU machine.
    """
    forced = os.environ.get("MLX_DSV41_BACKEND", "").strip().lower()
    if forced in ("cpu", "reference"):
        return "cpu"
    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def scalar_int32(value) -> mx.array:
    """A kernel's position input as the bodies read it (KX_SCALAR): a 0-d int32. The model binds a
    0-d int32 view (nothing is added to its graph); tests pass ints or [1] arrays."""
    value = value if isinstance(value, mx.array) else mx.array(value)
    return value.astype(mx.int32).reshape(()) if value.ndim else value.astype(mx.int32)


@cache
def float_bits(v: float) -> int:
    """The float32 bits of v as an int template value (bodies read KX_BITS_F32(bits)). MLX names a
    CUDA kernel after its template values, and a negative int would put a '-' in that name, so a
    value with its sign bit set is refused (callers pass non-negative constants)."""
    bits = int(np.array(v, np.float32).view(np.uint32))
    if bits >> 31:
        raise ValueError(f"kernel constant {v!r} has its sign bit set; kernel constants must be non-negative")
    return bits


@dataclass
class Kernel:
    """One kernel body, compiled for Metal or CUDA on first use.

    ``max_threads`` is the launch limit the body is written for (threads per threadgroup); a
    launch above it is refused before it reaches the backend.
    """

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    includes: tuple[str, ...] = ()
    defines: tuple[tuple[str, int], ...] = ()  # named constants the launcher shares with the headers
    max_threads: int = 1024
    examples: Callable[[], list[dict]] | None = None  # call kwargs used to dump sources in CI
    _built: dict = field(default_factory=dict, repr=False)

    def source(self, backend_name: str) -> tuple[str, str]:
        """(header, body) as handed to MLX for ``backend_name``: `whole_source` less the header's
        conditional branches and items the body does not reach, because MLX hashes the whole
        source at every launch (kernels/source_text.py)."""
        header, body = self.whole_source(backend_name)
        return pruned(resolved(header), body), body

    def whole_source(self, backend_name: str) -> tuple[str, str]:
        """(header, body) without comments and indentation, every header item kept (what `source`
        prunes; tests and benchmarks compare the two)."""
        body = minified(metal_ext.body(self.name))
        if backend_name == "metal":
            body = f"// attributes: {_METAL_ATTRIBUTE_NAMES}\n{body}"
        return minified(self.prelude() + metal_ext.header(backend_name, self.includes)), body

    def prelude(self) -> str:
        """``defines`` as #define lines, put before the headers."""
        return "".join(f"#define {name} ({value})\n" for name, value in self.defines)

    def _compiled(self, backend_name: str):
        if backend_name not in self._built:
            header, body = self.source(backend_name)
            common = dict(
                name=self.name,
                input_names=list(self.input_names),
                output_names=list(self.output_names),
                source=body,
                header=header,
            )
            if backend_name == "metal":
                self._built[backend_name] = mx.fast.metal_kernel(**common, compile_options={"math_mode": "safe"})
            elif backend_name == "cuda":  # the header as a file MLX does not hash (kernels/header_files.py)
                self._built[backend_name] = mx.fast.cuda_kernel(**common | {"header": cuda_header(self.name, header)})
            else:
                raise RuntimeError(f"kernel {self.name} needs a GPU backend, not {backend_name!r}")
        return self._built[backend_name]

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        backend_name: str | None = None,
        verbose: bool = False,
    ):
        threads = math.prod(threadgroup)
        if threads > self.max_threads:
            raise ValueError(
                f"kernel {self.name}: threadgroup {tuple(threadgroup)} has {threads} threads, "
                f"over its declared limit of {self.max_threads}"
            )
        fn = self._compiled(backend_name or backend())
        return fn(
            inputs=list(inputs),
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
            grid=tuple(grid),
            threadgroup=tuple(threadgroup),
            template=list(template or []),
            init_value=init_value,
            verbose=verbose,
        )


REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    if kernel.name in REGISTRY:
        raise ValueError(f"kernel {kernel.name} registered twice")
    REGISTRY[kernel.name] = kernel
    return kernel


# Op modules that register kernels; imported by load_all() so CI sees every kernel.
_OP_MODULES = (
    "sparse_attention",
    "exl3",
    "hyper_connections",
    "moe_route",
    "fp32_linear",
    "fake_quant",
    "rope",
    "f16_gemm",
    "mxfp4_gemv",
    "index_select",
)


def load_all() -> dict[str, Kernel]:
    import importlib

    for mod in _OP_MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    return REGISTRY
