"""Run metal_ext kernel bodies on the CPU (tests only): each body is compiled with g++ against
backend_sim.h (a KX_* backend whose GPU threads are fibers) and launched on the same call kwargs
that mlx_dsv41.kernels would hand to MLX. It exercises the bodies' real code -- indexing, fragment
layouts, barriers, shuffles, exact integer/fp16 arithmetic -- on a machine without a GPU.

    program = build([(kernel, call), ...], mma=True)   # one g++ run for all the specs
    launch = launcher(kernel)                          # kernel(**call) on the simulator
    outputs = program.run(i, call)                       # spec i, possibly with other data

Input and output buffers end at a PROT_NONE page, so reads or writes past their end crash the run.
Outputs start poisoned (0xFF bytes) unless the call has an init_value, as on a GPU they start
uninitialised.
"""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import ml_dtypes
import mlx.core as mx
import numpy as np

from mlx_dsv41 import kernels, metal_ext

HERE = Path(__file__).parent
_C_TYPES = kernels.CUDA_TYPES | {mx.float16: "sim_half", mx.bfloat16: "sim_bf16"}  # the simulator's 16-bit floats
_NP_TYPES = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: ml_dtypes.bfloat16,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.int16: np.int16,
    mx.uint16: np.uint16,
    mx.int8: np.int8,
    mx.uint8: np.uint8,
    mx.bool_: np.bool_,
}

_MAIN = r"""
#include <sys/mman.h>
#include <unistd.h>
static std::vector<unsigned char> sim_file;
static size_t sim_pos = 0;
template <typename T> static T sim_read() {
  T v;
  std::memcpy(&v, sim_file.data() + sim_pos, sizeof(T));
  sim_pos += sizeof(T);
  return v;
}
// A buffer that ends (16-byte rounded) right before an inaccessible page.
static void* sim_guarded(size_t nbytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t need = (nbytes + 15) & ~size_t(15);
  const size_t span = (need + page - 1) / page * page;
  char* base = (char*)mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) sim_fail("mmap");
  mprotect(base + span, page, PROT_NONE);
  return base + span - need;
}
// The next nbytes of the launch file, copied into a guarded buffer.
static void* sim_read_guarded(size_t nbytes) {
  void* p = sim_guarded(nbytes);
  std::memcpy(p, sim_file.data() + sim_pos, nbytes);
  sim_pos += nbytes;
  return p;
}
static std::vector<size_t> sim_out_bytes;
int main(int argc, char** argv) {
  FILE* f = std::fopen(argv[1], "rb");
  std::fseek(f, 0, SEEK_END);
  sim_file.resize(std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(sim_file.data(), 1, sim_file.size(), f) != sim_file.size()) sim_fail("short read");
  std::fclose(f);
  const u32 spec = sim_read<u32>();
  u32 grid[3], tg[3];
  for (auto& g : grid) g = sim_read<u32>();
  for (auto& t : tg) t = sim_read<u32>();
  const u32 n_in = sim_read<u32>();
  for (u32 i = 0; i < n_in; i++) {
    Shape s{};
    const u32 ndim = sim_read<u32>();
    for (u32 d = 0; d < ndim; d++) s[d] = sim_read<int32_t>();
    sim_in.push_back(sim_read_guarded(sim_read<u64>()));
    sim_shape.push_back(s);
    sim_ndim.push_back((int)ndim);
  }
  const u32 n_out = sim_read<u32>();
  for (u32 i = 0; i < n_out; i++) {
    const u64 nbytes = sim_read<u64>();
    sim_out.push_back(sim_read_guarded(nbytes));
    sim_out_bytes.push_back(nbytes);
  }
  sim_launch(grid, tg, sim_specs[spec]);
  FILE* o = std::fopen(argv[2], "wb");
  for (u32 i = 0; i < n_out; i++) std::fwrite(sim_out[i], 1, sim_out_bytes[i], o);
  std::fclose(o);
  return 0;
}
"""


def _template_decl(name, value):
    if isinstance(value, bool):
        return f"bool {name}", "true" if value else "false"
    if isinstance(value, int):
        return f"int {name}", str(value)
    return f"typename {name}", _C_TYPES[value]


def _signature(kernel, call):
    """(template parameter list, template arguments) of one call: array types, then its template."""
    decls, args = [], []
    for name, arr in zip(kernel.input_names, call["inputs"]):
        decls.append(f"typename T_{name}")
        args.append(_C_TYPES[arr.dtype])
    for name, dtype in zip(kernel.output_names, call["output_dtypes"]):
        decls.append(f"typename T_{name}")
        args.append(_C_TYPES[dtype])
    for tname, value in call.get("template") or []:
        d, a = _template_decl(tname, value)
        decls.append(d)
        args.append(a)
    return decls, args


def _source(specs, mma: bool) -> str:
    parts = [f"#define KX_HAS_MMA_F16 {int(mma)}\n", (HERE / "backend_sim.h").read_text()]
    includes, preludes = [], []
    for kernel, _ in specs:
        includes += [h for h in kernel.includes if h not in includes]
        preludes += [kernel.prelude()] if kernel.prelude() not in preludes else []
    parts += preludes
    parts += [metal_ext.read(h).replace("#pragma once", "") for h in includes]
    bodies = {}
    for kernel, call in specs:
        if kernel.name in bodies:
            continue
        decls, _ = _signature(kernel, call)
        params = [f"const T_{n}* {n}, const Shape {n}_shape, const int {n}_ndim" for n in kernel.input_names]
        params += [f"T_{n}* {n}" for n in kernel.output_names]
        bodies[kernel.name] = (
            f"template <{', '.join(decls)}>\nstatic void sim_body_{kernel.name}({', '.join(params)}) {{\n"
            f"{metal_ext.body(kernel.name)}\n}}\n"
        )
    parts += bodies.values()
    parts.append(
        "static std::vector<void*> sim_in, sim_out;\nstatic std::vector<Shape> sim_shape;\n"
        "static std::vector<int> sim_ndim;\n"
    )
    for i, (kernel, call) in enumerate(specs):
        _, args = _signature(kernel, call)
        call_args = [
            f"(const {_C_TYPES[a.dtype]}*)sim_in[{j}], sim_shape[{j}], sim_ndim[{j}]"
            for j, a in enumerate(call["inputs"])
        ]
        call_args += [f"({_C_TYPES[d]}*)sim_out[{j}]" for j, d in enumerate(call["output_dtypes"])]
        parts.append(
            f"static void sim_spec_{i}() {{ sim_body_{kernel.name}<{', '.join(args)}>({', '.join(call_args)}); }}"
        )
    parts.append(f"static void (*sim_specs[])() = {{{', '.join(f'sim_spec_{i}' for i in range(len(specs)))}}};")
    parts.append(_MAIN)
    return "\n".join(parts)


class Program:
    def __init__(self, path: Path, specs):
        self.path, self.specs = path, specs

    def run(self, index: int, call: dict | None = None) -> list[np.ndarray]:
        """Outputs of spec ``index`` launched on ``call`` (default: the spec's own call kwargs)."""
        kernel, spec_call = self.specs[index]
        call = spec_call if call is None else call
        if _signature(kernel, call) != _signature(kernel, spec_call):
            raise ValueError("call does not match the compiled spec (dtypes or template differ)")
        blob = [struct.pack("<I", index), struct.pack("<3I", *call["grid"]), struct.pack("<3I", *call["threadgroup"])]
        blob.append(struct.pack("<I", len(call["inputs"])))
        for a in call["inputs"]:
            data = _to_numpy(a).tobytes()
            blob += [
                struct.pack("<I", a.ndim),
                struct.pack(f"<{a.ndim}i", *a.shape),
                struct.pack("<Q", len(data)),
                data,
            ]
        blob.append(struct.pack("<I", len(call["output_shapes"])))
        outs = []
        for shape, dtype in zip(call["output_shapes"], call["output_dtypes"]):
            np_type = _NP_TYPES[dtype]
            size = int(np.prod(shape))
            if call.get("init_value") is None:
                init = np.full(size * np.dtype(np_type).itemsize, 0xFF, np.uint8)
            else:
                init = np.full(size, call["init_value"], np.float64).astype(np_type)
            data = init.tobytes()
            blob += [struct.pack("<Q", len(data)), data]
            outs.append((shape, np_type, len(data)))
        with tempfile.TemporaryDirectory() as tmp:
            launch, result = Path(tmp) / "launch.bin", Path(tmp) / "out.bin"
            launch.write_bytes(b"".join(blob))
            r = subprocess.run([str(self.path), str(launch), str(result)], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"simulated {kernel.name} failed (rc {r.returncode}): {r.stderr[-2000:]}")
            raw = result.read_bytes()
        arrays, pos = [], 0
        for shape, np_type, nbytes in outs:
            arrays.append(np.frombuffer(raw[pos : pos + nbytes], np_type).reshape(shape).copy())
            pos += nbytes
        return arrays


def launcher(kernel, mma: bool = True):
    """A stand-in for ``kernel(**call)`` that runs every call on the simulator, building one program
    per signature (dtypes, template) on first use: to run an op's GPU path on this CPU."""
    programs = {}

    def launch(**call):
        sig = repr(_signature(kernel, call))
        if sig not in programs:
            programs[sig] = build([(kernel, call)], mma)
        # What a CUDA launch leaves out (kernels.Kernel: `absent`): the inputs' stand-ins poisoned
        # (every byte 0xFF), the outputs checked untouched and returned as None, as CUDA returns them.
        absent = set(call.get("absent", ()))
        inputs = [_poisoned(a) if n in absent else a for n, a in zip(kernel.input_names, call["inputs"])]
        outs = programs[sig].run(0, call | {"inputs": inputs})
        for name, o in zip(kernel.output_names, outs):
            if name in absent and call.get("init_value") is None and (o.view(np.uint8) != 0xFF).any():
                raise RuntimeError(f"simulated {kernel.name} wrote {name}, an output its call names absent")
        return [
            None if n in absent else mx.array(o.view(np.uint16)).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o)
            for n, o, d in zip(kernel.output_names, outs, call["output_dtypes"])
        ]

    return launch


def _poisoned(a: mx.array) -> mx.array:
    """a's dtype and shape, every byte 0xFF (NaN in the float dtypes)."""
    raw = np.full(a.nbytes, 0xFF, np.uint8)
    if a.dtype == mx.bfloat16:
        return mx.array(raw.view(np.uint16).reshape(a.shape)).view(mx.bfloat16)
    return mx.array(raw.view(_NP_TYPES[a.dtype]).reshape(a.shape))


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def build(specs, mma: bool) -> Program:
    """Compile one simulator for the (kernel, call kwargs) specs (cached by source hash)."""
    source = _source(specs, mma)
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    cache = Path(tempfile.gettempdir()) / "mlx_dsv41_exl3_sim"
    cache.mkdir(exist_ok=True)
    binary = cache / f"sim_{digest}"
    if not binary.exists():
        cxx = shutil.which("g++")
        if cxx is None:
            raise RuntimeError("the kernel simulator needs g++")
        src = cache / f"sim_{digest}.cpp"
        src.write_text(source)
        tmp_bin = cache / f"sim_{digest}.tmp"
        r = subprocess.run(
            [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-w", "-o", str(tmp_bin), str(src)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"simulator build failed:\n{r.stderr[:6000]}")
        tmp_bin.rename(binary)
    return Program(binary, specs)
