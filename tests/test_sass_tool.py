"""benchmarks/sass_exl3.py's reading of an nvdisasm listing: the block loop is the backward
branch around MMAs with the fewest always-run instructions per MMA, and what a forward branch
inside it may skip (staging, copy issue) is set apart from the per-tile count. A synthetic listing
keeps the test independent of nvdisasm."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0020*/              @P0  BRA `(.L_x_1) ;
        /*0030*/                   LDG.E R4, desc[UR4][R6.64] ;
        /*0040*/                   STS [R5], R4 ;
.L_x_1:
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/                   LDS R8, [R9] ;
        /*0070*/                   IMAD R10, R8, -0x7c232ed3, RZ ;
        /*0080*/                   IDP.4A.U8.U8 R10, R10, UR5, R11 ;
        /*0090*/                   HMMA.16816.F32 R12, R16, R20, R12 ;
        /*00a0*/                   IMAD R10, R8, -0x7c232ed3, RZ ;
        /*00b0*/                   HMMA.16816.F32 R12, R16, R20, R12 ;
        /*00c0*/              @P1  BRA `(.L_x_0) ;
        /*00d0*/                   EXIT ;
"""


def load_tool():
    spec = importlib.util.spec_from_file_location("sass_exl3", ROOT / "benchmarks" / "sass_exl3.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_block_loop_and_its_conditional_work():
    tool = load_tool()
    ins, labels = tool.parse_listing(LISTING)
    assert len(ins) == 14 and labels == {".L_x_0": 1, ".L_x_1": 5}
    first, last = tool.block_loop(ins, labels)
    assert (first, last) == (1, 12)
    cold = tool.conditional_regions(ins, labels, first, last)
    assert cold == {3, 4}  # the LDG + STS the forward branch skips
    hot = [ins[i] for i in range(first, last + 1) if i not in cold]
    by_op, by_pipe = tool.mix(hot, 2.0)  # 2 MMAs: per tile
    assert by_op["IMAD"] == 1.0 and by_op["HMMA.16816.F32"] == 1.0 and by_op["BRA"] == 1.0
    assert by_pipe == {"alu": 0.5, "fma": 1.5, "lsu": 0.5, "tensor": 1.0, "other": 1.5}
