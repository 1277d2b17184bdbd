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


# The C types MLX's CUDA backend declares each input and output with (`const T* name`, `T* name`).
CUDA_TYPES = {
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int16: "int16_t",
    mx.uint16: "uint16_t",
    mx.int8: "int8_t",
    mx.uint8: "uint8_t",
    mx.int64: "int64_t",
    mx.uint64: "uint64_t",
    mx.bool_: "bool",
}
# Whether CUDA launches leave out the arguments a call names absent (docs/design.md#absent-arguments);
# MLX_DSV41_KERNEL_STAND_INS=1 (a process) or bench_model.py's --kernel-stand-ins (a run) turns it off.
LEAVES_OUT_ABSENT = os.environ.get("MLX_DSV41_KERNEL_STAND_INS", "").strip() != "1"


def absent_prelude(body: str, inputs: dict, outputs: dict) -> str:
    """The lines a CUDA body is given for the arguments its launch leaves out (name -> dtype of the
    stand-in a full launch would pass; none: ""): a null pointer of the declared type, and where the body
    names the argument's shape, ndim or strides, eight ones, 1 and eight ones. A template that
    never reads or writes the argument compiles to what it did with the stand-in; one that did
    would fault rather than read another argument's bytes."""
    lines = []
    # Locals of the body's outermost block, where a full launch has its parameters: the body never
    # declares these names there, and shadows them in inner blocks as it does the parameters.
    for name, dtype in inputs.items():
        lines.append(f"const {CUDA_TYPES[dtype]}* {name} = nullptr;")
    for name, dtype in outputs.items():
        lines.append(f"{CUDA_TYPES[dtype]}* {name} = nullptr;")
    for name in inputs:
        if f"{name}_shape" in body:
            lines.append(f"const int {name}_shape[8] = {{1, 1, 1, 1, 1, 1, 1, 1}};")
        if f"{name}_strides" in body:
            lines.append(f"const int64_t {name}_strides[8] = {{1, 1, 1, 1, 1, 1, 1, 1}};")
        if f"{name}_ndim" in body:
            lines.append(f"const int {name}_ndim = 1;")
    return "".join(line + "\n" for line in lines)


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

    def left_out(self, backend_name: str, inputs, output_dtypes, absent) -> tuple[dict, dict]:
        """(inputs, outputs) a launch on ``backend_name`` leaves out, name -> the stand-in's dtype:
        the call's ``absent`` names on CUDA (docs/design.md#absent-arguments), none elsewhere (Metal
        and the tests' simulator take the stand-ins)."""
        if not absent or backend_name != "cuda" or not LEAVES_OUT_ABSENT:
            return {}, {}
        unknown = set(absent) - set(self.input_names) - set(self.output_names)
        if unknown or self.input_names[0] in absent:
            raise ValueError(f"kernel {self.name}: cannot leave out {sorted(unknown) or self.input_names[0]}")
        ins = {n: a.dtype for n, a in zip(self.input_names, inputs) if n in absent}
        outs = {n: d for n, d in zip(self.output_names, output_dtypes) if n in absent}
        return ins, outs

    def variant_source(self, backend_name: str, left_out: tuple[dict, dict]) -> tuple[str, str]:
        """(header, body) of a launch that leaves out ``left_out`` (what `left_out` returns)."""
        header, body = self.source(backend_name)
        return header, absent_prelude(body, *left_out) + body

    def _compiled(self, backend_name: str, left_out: tuple[dict, dict] = ({}, {})):
        key = (backend_name, tuple(left_out[0].items()), tuple(left_out[1].items()))
        if key not in self._built:
            header, body = self.variant_source(backend_name, left_out)
            common = dict(
                name=self.name,
                input_names=[n for n in self.input_names if n not in left_out[0]],
                output_names=[n for n in self.output_names if n not in left_out[1]],
                source=body,
                header=header,
            )
            if backend_name == "metal":
                self._built[key] = mx.fast.metal_kernel(**common, compile_options={"math_mode": "safe"})
            elif backend_name == "cuda":  # the header as a file MLX does not hash (kernels/header_files.py)
                self._built[key] = mx.fast.cuda_kernel(**common | {"header": cuda_header(self.name, header)})
            else:
                raise RuntimeError(f"kernel {self.name} needs a GPU backend, not {backend_name!r}")
        return self._built[key]

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
        absent=(),
        backend_name: str | None = None,
        verbose: bool = False,
    ):
        """The launch. ``absent``: names of inputs and outputs the template never reads or writes;
        ``inputs`` and ``output_shapes`` still hold stand-ins for them (what Metal and the tests'
        simulator are given), a CUDA launch leaves them out and returns None for such outputs."""
        threads = math.prod(threadgroup)
        if threads > self.max_threads:
            raise ValueError(
                f"kernel {self.name}: threadgroup {tuple(threadgroup)} has {threads} threads, "
                f"over its declared limit of {self.max_threads}"
            )
        backend_name = backend_name or backend()
        left_out = self.left_out(backend_name, inputs, output_dtypes, absent)
        fn = self._compiled(backend_name, left_out)
        kept = [n not in left_out[1] for n in self.output_names]
        outs = iter(
            fn(
                inputs=[a for n, a in zip(self.input_names, inputs) if n not in left_out[0]],
                output_shapes=[tuple(s) for s, k in zip(output_shapes, kept) if k],
                output_dtypes=[d for d, k in zip(output_dtypes, kept) if k],
                grid=tuple(grid),
                threadgroup=tuple(threadgroup),
                template=list(template or []),
                init_value=init_value,
                verbose=verbose,
            )
        )
        return [next(outs) if k else None for k in kept]


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
    "compressor_raw",
)


def load_all() -> dict[str, Kernel]:
    import importlib

    for mod in _OP_MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    return REGISTRY
