"""Scratch outputs held by the caller (docs/design.md#held-scratch): a launch that finishes itself
names the outputs only it reads back (its part sums) `held`, with buffers kept on the module that
keeps its counters; a CUDA launch writes there instead of allocating the outputs, and every
backend returns None for them. Here: the CUDA launch's plumbing against a recording stand-in of
`mx.fast.cuda_kernel`, the refusals, where the buffers are kept, and on the simulator (outputs
start poisoned, so a launch that read scratch it had not written would show it) the same bytes
with the scratch held as without."""

import shutil
from types import SimpleNamespace

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import kernels
from mlx_dsv41.kernels import grid_finish
from mlx_dsv41.kernels import hyper_connections as hc
from mlx_dsv41.kernels import moe_route as mr

HC, DIM = 4, 256
MIX = (2 + HC) * HC
SITE_KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)


def _expand_site_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)

    def f32(*shape, scale=1.0):
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    residual = f32(1, HC, DIM).astype(mx.bfloat16)
    y, m = f32(1, DIM).astype(mx.bfloat16), mx.abs(f32(1, MIX))
    site = (mx.abs(f32(1, MIX)), f32(DIM) + 1, 1e-6, f32(MIX, HC * DIM, scale=0.05), f32(MIX), f32(3))
    return y, residual, m, site


def _expand_site_call():
    y, residual, m, (prev, w, eps, fn, base, scale) = _expand_site_inputs()
    counters = grid_finish.split_counters(1)
    return hc.expand_site_args(y, residual, m, fn, base, scale, prev, w, counters, 20, 1e-6, 1e-6, eps)


class _Recorder:
    """A stand-in of mx.fast.cuda_kernel: records what each built kernel was given."""

    def __init__(self):
        self.built, self.calls = [], []

    def __call__(self, **kw):
        self.built.append(kw)

        def run(**call):
            self.calls.append(call)
            return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

        return run


def test_a_cuda_launch_writes_held_outputs_into_the_held_buffers(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", rec, raising=False)
    k = hc.EXPAND_SITE
    monkeypatch.setattr(k, "_built", {})
    call = grid_finish.held_example(k, _expand_site_call(), ("mm", "parts"))
    held = call["held"]
    assert set(held) == {"mm", "parts"} and all(b.dtype == mx.float32 for b in held.values())
    out = k(**call, backend_name="cuda")
    (built,), (given,) = rec.built, rec.calls
    assert built["input_names"] == [*k.input_names, "mm_held", "parts_held"]
    assert built["output_names"] == ["out", "x", "streams"]
    assert given["inputs"][-2] is held["mm"] and given["inputs"][-1] is held["parts"]
    assert len(given["output_shapes"]) == 3
    assert "float* mm = const_cast<float*>(mm_held);" in built["source"]
    assert "float* parts = const_cast<float*>(parts_held);" in built["source"]
    assert out[0] is None and out[4] is None and all(o is not None for o in out[1:4])
    # the same call builds nothing new; with the switch off the outputs are MLX's, still returned None
    k(**call, backend_name="cuda")
    assert len(rec.built) == 1
    monkeypatch.setattr(kernels, "HOLDS_SCRATCH", False)
    out = k(**call, backend_name="cuda")
    assert rec.built[-1]["output_names"] == list(k.output_names) and "_held" not in rec.built[-1]["source"]
    assert out[0] is None and out[4] is None
    assert grid_finish.held_scratch(SimpleNamespace(), (4,), mx.float32) is None


def test_metal_allocates_held_outputs():
    call = grid_finish.held_example(hc.EXPAND_SITE, _expand_site_call(), ("mm",))
    assert hc.EXPAND_SITE.held_out("metal", call["output_dtypes"], call["held"]) == {}
    assert set(hc.EXPAND_SITE.held_out("cuda", call["output_dtypes"], call["held"])) == {"mm"}


def test_a_held_output_is_refused_unless_it_fits(monkeypatch):
    monkeypatch.setattr(mx.fast, "cuda_kernel", _Recorder(), raising=False)
    k = hc.EXPAND_SITE
    call = _expand_site_call()
    cases = [
        ({"nonsense": mx.zeros((4,))}, "not an output"),
        ({"mm": mx.zeros((MIX,), mx.float16)}, "the output is mlx.core.float32"),
        ({"mm": mx.zeros((MIX - 1,))}, f"holds {MIX - 1} of {MIX} values"),
    ]
    for held, message in cases:
        with pytest.raises(ValueError, match=message):
            k(**call | {"held": held}, backend_name="cuda")
    with pytest.raises(ValueError, match="take no init_value"):
        k(**call | {"held": {"mm": mx.zeros((MIX,))}, "init_value": 0}, backend_name="cuda")


def test_the_buffers_are_kept_per_owner_name_and_shape(monkeypatch):
    owner, other = SimpleNamespace(), SimpleNamespace()
    a = grid_finish.held_scratch(owner, (2, 8), mx.float32, "site.mm")
    assert a is grid_finish.held_scratch(owner, (2, 8), mx.float32, "site.mm")
    assert a is not grid_finish.held_scratch(owner, (2, 8), mx.float32, "site.parts")
    assert a is not grid_finish.held_scratch(owner, (3, 8), mx.float32, "site.mm")
    assert a is not grid_finish.held_scratch(other, (2, 8), mx.float32, "site.mm")
    assert grid_finish.held_scratch(None, (2, 8), mx.float32) is None
    too_big = (grid_finish.SCRATCH_MAX_BYTES // 4 + 1,)
    assert grid_finish.held_scratch(owner, too_big, mx.float32) is None
    call = grid_finish.Scratch(owner, "x").hold(hc.EXPAND_SITE, _expand_site_call(), ("mm", "parts"))
    assert set(call["held"]) == {"mm", "parts"} and call["held"]["mm"].shape == (1, MIX)


def _on_the_simulator(monkeypatch):
    """The ops' CUDA paths, each launch run by the simulator."""
    launchers = {}

    def run(self, **call):
        if self.name not in launchers:
            launchers[self.name] = exl3_sim.launcher(self)
        return launchers[self.name](**{k: v for k, v in call.items() if k not in ("backend_name", "verbose")})

    monkeypatch.setattr(kernels.Kernel, "__call__", run)
    for mod in (hc, mr, hc.fp32_linear):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setitem(grid_finish.GRID_FINISH, "cuda", True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")
def test_held_scratch_gives_the_same_bytes_on_the_simulator(monkeypatch):
    """An expand-site and a router that finish themselves, with their scratch held and not: the
    same bytes, twice over the same held buffers."""
    _on_the_simulator(monkeypatch)
    y, residual, m, site = _expand_site_inputs(1)
    counters = grid_finish.split_counters(1)
    rng = np.random.default_rng(2)
    x = mx.array(rng.normal(0, 1, (1, DIM)).astype(np.float32)).astype(mx.bfloat16)
    w, bias = mx.array(rng.normal(0, 0.1, (16, DIM)).astype(np.float32)), mx.zeros((16,))

    def run(scratch):
        streams, xs, out = hc.expand_site(y, residual, m, *site, **SITE_KW, counters=counters, scratch=scratch)
        idx, wts = mr.gate(x, w, bias, 2, 1.0, 1.0, counters=counters, scratch=scratch)
        return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in (streams, xs, out, idx, wts)]

    plain = run(None)
    scratch = grid_finish.Scratch(SimpleNamespace(), "site")
    for _ in range(2):
        held = run(scratch)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(plain, held))
    kept = scratch.owner._finish_scratch
    assert {k[0] for k in kept} == {"site.mm", "site.parts", "site.logits"}
