"""Static instruction counts of the EXL3 CUDA kernels, without a GPU: what ptxas makes of a body.

The EXL3 product kernels are bound by instruction issue (docs/benchmarks.md, EXL3), so the SASS
instructions per decoded 16x16 tile are the figure to watch when changing a body. This script
assembles the CUDA source MLX would JIT for a Flash-shaped launch (tests/kernel_source_check.py),
compiles it for sm_90 with nvcc and disassembles it with nvdisasm, then prints the registers and
threadgroup memory, and for the block loop (the loop with the fewest always-run instructions per
MMA): its instructions per tile by opcode and by the pipe that executes them (Hopper: shifts, masks, byte permutes and
integer adds on the ALU pipe; IMAD, IDP and fp32 on the FMA pipe, packed fp16 on both FMA pipes;
loads and shuffles on the LSU). Kernels without MMAs get their whole-body opcode counts.

    python benchmarks/sass_exl3.py [--kernel gate_up|down|swiglu|finish|gemv] [--bits 3] [--dump]

Needs nvcc (CUDA 12/13) and nvdisasm (on PATH, or `pip install nvidia-cuda-nvdisasm`). Static
counts are a proxy: the loop's trip count and the issue rate come from Nsight Compute on the device
(profile_exl3.py).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # kernel_source_check
import kernel_source_check as source_check  # noqa: E402
from bench_exl3 import HIDDEN, INTER, random_trellis  # noqa: E402

from mlx_dsv41.exl3.experts import EXL3ExpertProjection, EXL3Experts  # noqa: E402
from mlx_dsv41.kernels import exl3 as launch  # noqa: E402

# SASS opcode (first dotted part) -> Hopper pipe, as Nsight Compute names them.
PIPES = {
    "alu": {
        "SHF",
        "LOP3",
        "PRMT",
        "IADD3",
        "ISETP",
        "LEA",
        "SEL",
        "MOV",
        "VIADD",
        "VIADDMNMX",
        "PLOP3",
        "FSEL",
        "IABS",
        "IMNMX",
        "FMNMX",
        "FSETP",
        "POPC",
        "FLO",
    },
    "fma": {"IMAD", "IDP", "FFMA", "FMUL", "FADD", "HADD2", "HMUL2", "HFMA2"},
    "lsu": {"LDS", "STS", "LDG", "STG", "LDGSTS", "SHFL", "LDC", "LD", "ST", "ATOMS", "ATOMG", "RED"},
    "tensor": {"HMMA"},
    "xu": {"MUFU", "I2F", "F2I", "F2F", "F2FP", "I2FP", "FRND"},
}


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for sub in ("cu13", "cu12", "cuda_nvdisasm"):
        p = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / sub / "bin" / "nvdisasm"
        if p.is_file():
            return str(p)
    sys.exit("sass_exl3: nvdisasm not found (pip install nvidia-cuda-nvdisasm, or put it on PATH)")


def flash_call(kernel: str, bits: int):
    """(registered kernel, call kwargs) for one Flash-shaped launch (4 experts: only shapes matter)."""

    def proj(k, n, e=4):
        return EXL3ExpertProjection.from_stacked(
            random_trellis((e, k // 16, n // 16), bits),
            mx.zeros((e, k), mx.float16),
            mx.ones((e, n), mx.float16),
            "mul1",
        )

    ex = EXL3Experts(proj(HIDDEN, INTER), proj(HIDDEN, INTER), proj(INTER, HIDDEN), 4)
    x = mx.zeros((1, HIDDEN), mx.bfloat16)
    indices, weights = mx.array([[0, 1, 2, 3, 0, 1]], mx.int32), mx.ones((1, 6), mx.float32)
    gu = mx.zeros((6, 2, launch.expert_plan(ex.w1)[0], ex.w1.n), mx.float32)
    xh = mx.zeros((6, ex.w1.n // 2), mx.uint32)
    if kernel == "gate_up":
        g = ex.w1.groups[0]
        return launch.EXPERT_GATE_UP, launch.gate_up_args(x, indices, ex.w1, ex.w3, (g.k2, g.codebook), 0)
    if kernel == "swiglu":
        return launch.EXPERT_SWIGLU, launch.swiglu_args(gu, weights, indices, ex.w1, ex.w3, ex.w2, 0, 10.0)
    if kernel == "down":
        return launch.EXPERT_DOWN, launch.down_args(xh, indices, ex.w2, ex.w2.groups[0], 0)
    if kernel == "finish":
        partial = mx.zeros((6, launch.down_plan(ex.w2)[0], ex.w2.n), mx.float32)
        return launch.EXPERT_DOWN_FINISH, launch.down_finish_args(partial, indices, ex.w2, 0)
    # gemv: wq_a (5120x1280), m = 1, the k-split launch
    t = random_trellis((HIDDEN // 16, 1280 // 16), bits)
    call = launch.gemv_args(x, t, mx.zeros((HIDDEN,), mx.float16), mx.ones((1280,), mx.float16), "mul1")[0]
    return launch.GEMV, call


def disassemble(kernel, call) -> tuple[list[str], dict[str, int], str]:
    """(instructions, label -> index, ptxas resource line) of the compiled call."""
    src = source_check.cuda_source(kernel, call)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cu").write_text(src)
        r = subprocess.run(
            [
                "nvcc",
                "-std=c++17",
                "-arch=sm_90",
                "-cubin",
                "-Xptxas",
                "-v",
                "-I",
                str(source_check.STUBS),
                "-o",
                f"{tmp}/k.cubin",
                f"{tmp}/k.cu",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            sys.exit(f"sass_exl3: nvcc failed:\n{r.stderr[:3000]}")
        sass = subprocess.run([nvdisasm(), "-c", f"{tmp}/k.cubin"], capture_output=True, text=True, check=True).stdout
    usage = " ".join(line.split("ptxas info    : ")[-1] for line in r.stderr.splitlines() if "registers" in line)
    return (*parse_listing(sass), usage)


def parse_listing(sass: str) -> tuple[list[str], dict[str, int]]:
    """(instructions, label -> index of the instruction it names) of an nvdisasm -c listing."""
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
        elif re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            ins.append(re.sub(r"^\s+/\*[0-9a-f]+\*/\s*", "", line).rstrip(" ;"))
    return ins, labels


def opcode(instr: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0]


def block_loop(ins: list[str], labels: dict[str, int]) -> tuple[int, int] | None:
    """[first, last] of the block loop: of the backward branches whose body holds an HMMA on its
    always-taken path, the one with the fewest such instructions per HMMA (the steady state: an
    unrolled main loop rather than its tail or an enclosing loop)."""
    best, best_rate = None, None
    for i, s in enumerate(ins):
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", s)
        j = labels.get(m.group(1)) if m else None
        if j is None or j >= i:
            continue
        cold = conditional_regions(ins, labels, j, i)
        hot = [ins[k] for k in range(j, i + 1) if k not in cold]
        mmas = sum("HMMA" in q for q in hot)
        if mmas and (best_rate is None or len(hot) / mmas < best_rate):
            best, best_rate = (j, i), len(hot) / mmas
    return best


def conditional_regions(ins: list[str], labels: dict[str, int], first: int, last: int) -> set[int]:
    """Indices in [first, last] that a forward branch inside that range may skip and that hold no
    HMMA: the block loop's occasional work (xh staging every chunk, the copy issue near the end)."""
    skipped: set[int] = set()
    for i in range(first, last + 1):
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", ins[i])
        j = labels.get(m.group(1)) if m else None
        if j is not None and i < j <= last + 1 and not any("HMMA" in q for q in ins[i + 1 : j]):
            skipped.update(range(i + 1, j))
    return skipped


def mix(body: list[str], per: float) -> tuple[dict, dict]:
    ops_ = collections.Counter(opcode(s) for s in body)
    pipes = collections.Counter()
    for op, n in ops_.items():
        pipes[next((p for p, names in PIPES.items() if op.split(".")[0] in names), "other")] += n
    return (
        {k: round(v / per, 2) for k, v in ops_.most_common()},
        {k: round(v / per, 2) for k, v in pipes.most_common()},
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("gate_up", "down", "swiglu", "finish", "gemv"), default="gate_up")
    ap.add_argument("--bits", type=int, default=3, choices=range(1, 9), metavar="K", help="K of the trellis (1..8)")
    ap.add_argument("--dump", action="store_true", help="print the loop's (or the body's) instructions")
    args = ap.parse_args(argv)
    if shutil.which("nvcc") is None:
        sys.exit("sass_exl3: nvcc not found")
    kernel, call = flash_call(args.kernel, args.bits)
    ins, labels, usage = disassemble(kernel, call)
    print(f"{kernel.name}: template {call.get('template')}, grid {call['grid']}, threadgroup {call['threadgroup']}")
    print(f"ptxas: {usage}; {len(ins)} instructions in all")
    loop = block_loop(ins, labels)
    if loop is None:
        body, per, what = ins, 1.0, "whole body"
    else:
        cold = conditional_regions(ins, labels, *loop)
        body = [ins[i] for i in range(loop[0], loop[1] + 1) if i not in cold]
        per = float(sum(opcode(s).startswith("HMMA") for s in body))
        what = (
            f"block loop: {loop[1] - loop[0] + 1} instructions, {int(per)} tiles (MMAs), {len(cold)} in "
            f"branches it may skip (staging, copy issue); the rest per tile"
        )
    by_op, by_pipe = mix(body, per)
    print(f"{what}: {round(len(body) / per, 2)}")
    print("  by pipe:", by_pipe)
    print("  by opcode:", by_op)
    if args.dump:
        print("\n".join(body))


if __name__ == "__main__":
    main()
