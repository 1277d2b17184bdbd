"""Kernel arguments a launch does not use (docs/design.md#absent-arguments): the call names them
`absent`; a CUDA launch leaves them out (the body gets null pointers of their types), Metal and
the simulator take the stand-ins. The simulator poisons the absent inputs (every byte 0xFF) and
checks the absent outputs stay untouched, so every simulator test of a launch that names
arguments absent also checks that its template never touches them; here a launch that does read
an argument named absent is caught, and the CUDA launch's plumbing is checked against a recording
stand-in of `mx.fast.cuda_kernel`."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import kernels
from mlx_dsv41.exl3.synthetic import random_linear_tensors
from mlx_dsv41.kernels import exl3 as launch


def _linear(k: int, n: int, seed: int):
    t = random_linear_tensors(k, n, 3, "mul1", seed=seed)
    return mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"])


def _gemv_call(bias: bool):
    trellis, suh, svh = _linear(256, 256, 3)
    b = mx.array(np.random.default_rng(4).normal(0, 1, 256).astype(np.float16)) if bias else None
    x = mx.array(np.random.default_rng(5).normal(0, 1, (1, 256)).astype(np.float32)).astype(mx.bfloat16)
    return launch.gemv_args(x, trellis, suh, svh, "mul1", b, splits=1)[0]


def test_a_plain_gemv_names_its_stand_ins_absent():
    call = _gemv_call(bias=False)
    assert set(call["absent"]) == {
        *("bias", "counters", "y", "norm_w", "suh2", "trellis2", "svh2", "y2"),
        *("offset", "period", "norm2_w", "window", "window_out"),
    }
    assert "bias" not in _gemv_call(bias=True)["absent"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")
def test_the_simulator_catches_a_read_of_an_absent_input():
    """With the bias read (HAS_BIAS) but named absent, the poisoned bias reaches the output; the
    same call without the false claim gives finite values, and the unused outputs come back None."""
    run = exl3_sim.launcher(launch.GEMV)
    call = _gemv_call(bias=True)
    good = run(**call)
    assert good[1] is None and good[2] is None and good[3] is None
    assert np.isfinite(np.array(good[0].astype(mx.float32))).all()
    bad = run(**call | {"absent": (*call["absent"], "bias")})
    assert np.isnan(np.array(bad[0].astype(mx.float32))).all()


@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")
def test_the_simulator_catches_a_write_to_an_absent_output():
    run = exl3_sim.launcher(launch.GEMV)
    call = _gemv_call(bias=False)
    with pytest.raises(RuntimeError, match="wrote out, an output its call names absent"):
        run(**call | {"absent": (*call["absent"], "out")})


class _Recorder:
    """A stand-in of mx.fast.cuda_kernel: records what each built kernel was given."""

    def __init__(self):
        self.built, self.calls = [], []

    def __call__(self, **kw):
        self.built.append(kw)

        def run(**call):
            self.calls.append((kw, call))
            return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

        return run


def test_a_cuda_launch_leaves_the_absent_arguments_out(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", rec, raising=False)
    k = launch.GEMV
    monkeypatch.setattr(k, "_built", {})
    call = _gemv_call(bias=False)
    out = k(**call, backend_name="cuda")
    (built,), ((_, given),) = rec.built, rec.calls
    absent = set(call["absent"])
    assert built["input_names"] == [n for n in k.input_names if n not in absent]
    assert built["output_names"] == ["out"]
    assert len(given["inputs"]) == len(built["input_names"]) and len(given["output_shapes"]) == 1
    assert given["inputs"][0] is call["inputs"][0]
    assert out[0] is not None and out[1:] == [None, None, None]
    body = built["source"]
    assert "const __half* bias = nullptr;" in body and "float* y2 = nullptr;" in body
    assert "const int trellis2_shape[8] = {1, 1, 1, 1, 1, 1, 1, 1};" in body
    # the same call again builds nothing new; with the switch off it passes the stand-ins
    k(**call, backend_name="cuda")
    assert len(rec.built) == 1
    monkeypatch.setattr(kernels, "LEAVES_OUT_ABSENT", False)
    k(**call, backend_name="cuda")
    assert rec.built[-1]["input_names"] == list(k.input_names) and "nullptr" not in rec.built[-1]["source"]
    assert len(rec.calls[-1][1]["inputs"]) == len(k.input_names)


def test_metal_takes_the_stand_ins(monkeypatch):
    assert launch.GEMV.left_out("metal", [], [], ("bias",)) == ({}, {})
    assert launch.GEMV.left_out("cuda", [], [], ()) == ({}, {})


def test_a_launch_cannot_leave_out_an_unknown_argument_or_its_first_input():
    call = _gemv_call(bias=False)
    for bad in ("nonsense", "x"):
        with pytest.raises(ValueError, match="cannot leave out"):
            launch.GEMV.left_out("cuda", call["inputs"], call["output_dtypes"], (bad,))
