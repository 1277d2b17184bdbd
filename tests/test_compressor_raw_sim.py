"""The compressor_raw kernel body (mlx_dsv41/metal_ext/compressor_raw.metal, docs/design.md#compressor-raw)
on the CPU simulator, with the launch kwargs mlx_dsv41.kernels.compressor_raw hands to MLX:
- projected rows (dense weights: fp32, bf16, fp16; x fp32 or bf16) have fp32_gemv's bytes (run on the
  simulator too) and are within fp32 rounding of float64 x · wᵀ;
- the open group's rows and the new rings are, byte for byte, what LayerCache.group_inputs returns and
  writes (store_rows) for those projections; likewise for rows given as they are (another format's);
- every phase (pending = offset mod ratio, ratios 2 and 4), batch 2, more new rows than the ring holds;
  outputs start poisoned, guard rows past them and outputs a launch leaves out stay untouched;
- through the model: a Compressor's GPU path (the kernel on the simulator) over several whole groups
  gives the CPU reference's latents and rings within the bound, and the bytes of the GPU path without
  the kernel (fp32_gemv, then group_inputs).
tests/gpu/test_compressor_raw_gpu.py repeats the kernel checks on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from attention_stack import tiny_args

from mlx_dsv41 import kernels
from mlx_dsv41.cache import LayerCache, make_layer_cache
from mlx_dsv41.kernels import compressor_raw as cr
from mlx_dsv41.kernels import fp32_linear as fl
from mlx_dsv41.model.compressor import Compressor
from mlx_dsv41.quant import DenseLinear

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

K, N, GUARD, SLACK = 264, 40, 2, 3  # K: 33 chunks (ranges of 4 or 5 at split 8)
BF, F16, F32 = mx.bfloat16, mx.float16, mx.float32
# (ratio, pending, B, S, trim slack, w dtype, x dtype, N); pending < ratio; None dtypes: rows given
CASES = [
    *[(2, p, 2, 1, SLACK, BF, F32, N) for p in range(2)],
    *[(4, p, 2, 1, SLACK, BF, BF, N) for p in range(4)],
    (2, 1, 1, 2, SLACK, F16, BF, N),
    (2, 0, 2, 3, 0, F32, F32, N),  # ring of 1 row, 3 new rows: only the last is kept
    (4, 3, 1, 8, 1, BF, F32, N),  # 8 rows (MAX_ROWS), a ring of 4
    (2, 1, 1, 2, SLACK, BF, F32, fl.SPLIT_BELOW_N),  # split 1 (4 outputs a SIMD group)
    *[(4, p, 2, 1, SLACK, None, None, N) for p in range(4)],
    (2, 1, 1, 3, 0, None, None, N),
]


def _data(case, seed):
    ratio, P, B, S, slack, w_dtype, x_dtype, n = case
    rng = np.random.default_rng(seed)
    Q = slack + ratio - 1
    pos = 8 * ratio * 5 + 3 * ratio + P  # wraps the ring several times
    rings = [mx.array(rng.standard_normal((B, Q, n)).astype(np.float32)) for _ in range(2)]
    if w_dtype is None:
        kv, gate = (mx.array(rng.standard_normal((B, S, n)).astype(np.float32)) for _ in range(2))
        return dict(position=mx.array(pos, mx.int32), pending=P, raw_kv=rings[0], raw_gate=rings[1], kv=kv, gate=gate)
    x = mx.array(rng.standard_normal((B, S, K)).astype(np.float32)).astype(x_dtype)
    w = [mx.array((rng.standard_normal((n, K)) / np.sqrt(K)).astype(np.float32)).astype(w_dtype) for _ in range(2)]
    return dict(
        position=mx.array(pos, mx.int32), pending=P, raw_kv=rings[0], raw_gate=rings[1], x=x, wkv=w[0], wgate=w[1]
    )


def _call(d, guard=GUARD):
    return cr.args(
        d["position"],
        d["pending"],
        d["raw_kv"],
        d["raw_gate"],
        *(d.get(k) for k in ("x", "wkv", "wgate", "kv", "gate")),
        guard=guard,
    )


def _run(program, i, call):
    """Spec i on `call`, as a CUDA launch sees it: stand-ins of absent inputs poisoned, absent outputs
    checked untouched and returned as None (exl3_sim.launcher's contract)."""
    absent = set(call["absent"])
    inputs = [exl3_sim._poisoned(a) if n in absent else a for n, a in zip(cr.KERNEL.input_names, call["inputs"])]
    outs = program.run(i, call | {"inputs": inputs})
    for name, o in zip(cr.KERNEL.output_names, outs):
        assert name not in absent or (o.view(np.uint8) == 0xFF).all(), f"{name} was written"
    return [None if n in absent else o for n, o in zip(cr.KERNEL.output_names, outs)]


@pytest.fixture(scope="module")
def program():
    specs = []
    for i, case in enumerate(CASES):
        d = _data(case, i)
        specs.append((cr.KERNEL, _call(d)))
        if "x" in d:
            specs.append((fl.GEMV, fl.gemv_args(d["x"], d["wkv"])))
    return exl3_sim.build(specs, mma=True), specs


def _spec(specs, i):
    return [j for j, (k, _) in enumerate(specs) if k is cr.KERNEL][i]


def _reference(case, d, kv, gate):
    """LayerCache.group_inputs on the CPU for these new rows: (rows kv, rows gate, ring kv, ring gate)."""
    ratio, _, _, _, slack, *_ = case
    cache = LayerCache(4, ratio, True, slack)
    cache.offset, cache.raw_kv, cache.raw_gate = int(d["position"].item()), d["raw_kv"], d["raw_gate"]
    cache.bind(d["position"])
    rows = cache.group_inputs(kv, gate)
    return [np.array(a) for a in (*rows, cache.raw_kv, cache.raw_gate)]


def _unguarded(outs, ref):
    """The outputs less their guard rows (checked still poisoned), in the reference's shapes."""
    got = []
    for o, r in zip(outs, ref):
        if o is None:
            got.append(None)
            continue
        assert np.all(np.isnan(o[-GUARD:])), "a guard row was written"
        got.append(o[:-GUARD].reshape(r.shape))
    return got


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_launch_gives_group_inputs_bytes(program, i):
    prog, specs = program
    case, d = CASES[i], _data(CASES[i], i)
    j = _spec(specs, i)
    outs = _run(prog, j, specs[j][1])
    if "x" in d:
        gemv = [prog.run(j + 1, fl.gemv_args(d["x"], w))[0] for w in (d["wkv"], d["wgate"])]
        B, S = d["x"].shape[:2]
        kv, gate = (mx.array(y.reshape(B, S, -1)) for y in gemv)
    else:
        kv, gate = d["kv"], d["gate"]
    ref = _reference(case, d, kv, gate)
    got = _unguarded(outs, ref)
    if got[0] is None:  # given rows, no group open: the rows are the given ones (open_group returns them)
        assert d["pending"] == 0 and "kv" in d
        got[:2] = ref[:2]
    for g, r in zip(got, ref):
        assert g.tobytes() == r.tobytes()
    if "x" in d:  # the projections against float64
        x64 = np.array(d["x"].astype(F32), np.float64)
        for w, rows in ((d["wkv"], got[0]), (d["wgate"], got[1])):
            want = x64 @ np.array(w.astype(F32), np.float64).T
            err = np.abs(rows[:, d["pending"] :] - want).max() / np.abs(want).max()
            assert err < 2e-6, err  # fp32 sums over K = 264 (a bf16 rounding is 4e-3)


def test_nonfinite_inputs_follow_float64(program):
    prog, specs = program
    i = CASES.index((4, 3, 1, 8, 1, BF, F32, N))  # 8 rows: NaN and ±inf in some, the others finite
    d = _data(CASES[i], i)
    raw = np.array(d["x"])
    raw[0, 1, 5], raw[0, 3, 7], raw[0, 6, 100] = np.nan, np.inf, -np.inf
    d["x"] = mx.array(raw)
    outs = _run(prog, _spec(specs, i), _call(d))
    with np.errstate(all="ignore"):
        want = np.array(d["x"], np.float64)[0] @ np.array(d["wkv"].astype(F32), np.float64).T
    rows = outs[0][:-GUARD].reshape(-1, N)[d["pending"] :]
    assert np.array_equal(np.isnan(rows), np.isnan(want)) and np.array_equal(np.isposinf(rows), np.isposinf(want))
    finite = np.isfinite(want)
    assert finite.sum() >= 5 * N
    np.testing.assert_allclose(rows[finite], want[finite], rtol=0, atol=2e-5 * np.abs(want[finite]).max())


def test_bad_inputs_get_a_value_error():
    d = _data(CASES[0], 0)
    with pytest.raises(ValueError, match="weights"):
        cr.open_group(d["position"], 1, d["raw_kv"], d["raw_gate"], x=d["x"], wkv=d["wkv"][:, :8], wgate=d["wgate"])
    with pytest.raises(ValueError, match="raw rings"):
        cr.open_group(d["position"], 1, d["raw_kv"], d["raw_gate"][:1], x=d["x"], wkv=d["wkv"], wgate=d["wgate"])
    with pytest.raises(ValueError, match="pending"):
        cr.open_group(d["position"], 9, d["raw_kv"], d["raw_gate"], x=d["x"], wkv=d["wkv"], wgate=d["wgate"])
    with pytest.raises(ValueError, match="give x"):
        cr.open_group(d["position"], 1, d["raw_kv"], d["raw_gate"], x=d["x"])
    with pytest.raises(ValueError, match="rows must be"):
        cr.open_group(d["position"], 1, d["raw_kv"], d["raw_gate"], kv=d["raw_kv"][:, :1, :8], gate=d["raw_kv"][:, :1])


class _Projection(nn.Module):
    """A linear of another format (not dense to the compressor): fp32_linear of its weight."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def __call__(self, x):
        return fl.linear(x, self.w)


def _compressor(seed: int, dense: bool) -> tuple[Compressor, object]:
    args = tiny_args()
    comp = Compressor(args, 1)
    rng = np.random.default_rng(seed)
    D, Dh = args.hidden_size, args.head_dim
    for name in ("wkv", "wgate"):
        w = mx.array((rng.standard_normal((Dh, D)) / np.sqrt(D)).astype(np.float32)).astype(BF)
        lin = DenseLinear(D, Dh, bias=False) if dense else _Projection(w)
        lin.update({"weight": w}) if dense else None
        setattr(comp, name, lin)
    return comp, args


def _steps(comp, args, chunks, seed):
    """Latents and raw rings after each chunk (token counts) for a batch of 2."""
    cache, rng, out = make_layer_cache(args, 1), np.random.default_rng(seed), []
    for S in chunks:
        x = mx.array(rng.standard_normal((2, S, args.hidden_size)).astype(np.float32)).astype(BF)
        cache.bind(mx.array(cache.offset, mx.int32))
        latent, first = comp(x, cache)
        cache.advance(S)
        out.append(
            [None if latent is None else np.array(latent.astype(F32)), np.array(cache.raw_kv), np.array(cache.raw_gate)]
        )
    return out


CHUNKS = [3, 1, 1, 1, 2, 1, 1, 3, 1, 1]  # every phase, groups completed by 1, 2 and 3 new tokens


@pytest.mark.parametrize("dense", [True, False])
def test_the_compressor_gpu_path_gives_the_reference(monkeypatch, dense):
    comp, args = _compressor(7, dense)
    cpu = _steps(comp, args, CHUNKS, 3)
    sims = {k.name: exl3_sim.launcher(k) for k in (cr.KERNEL, fl.GEMV)}
    calls = []

    def on_sim(self, **call):
        calls.append(self.name)
        return sims[self.name](**call)

    monkeypatch.setattr(kernels.Kernel, "__call__", on_sim)
    monkeypatch.setattr(fl, "backend", lambda: "cuda")
    monkeypatch.setattr(cr, "backend", lambda: "cuda")
    gpu = _steps(comp, args, CHUNKS, 3)
    assert calls.count("compressor_raw") == len(CHUNKS)
    assert calls.count("fp32_gemv") == (0 if dense else 2 * len(CHUNKS))
    monkeypatch.setattr(cr, "backend", lambda: "cpu")  # the GPU path without the kernel
    apart = _steps(comp, args, CHUNKS, 3)
    for step, (g, c, a) in enumerate(zip(gpu, cpu, apart)):
        assert (g[0] is None) == (c[0] is None) == (a[0] is None), step
        for gg, cc, aa in zip(g, c, a):
            if gg is None:
                continue
            assert gg.tobytes() == aa.tobytes(), step  # the kernel's bytes: fp32_gemv's, then group_inputs
            # fp32 sums in another order than the CPU's matmul; the latents are bf16 (one rounding)
            bound = 2**-7 if gg is g[0] else 2e-6
            assert np.abs(gg - cc).max() <= bound * np.abs(cc).max(), step


def test_an_exl3_compressor_takes_two_launches_with_the_bytes_of_its_launches_apart(monkeypatch):
    """EXL3 weights (Flash's compressor, docs/checkpoint.md#exl3-quantized-tensors): one paired
    exl3_gemv from bf16 x with fp32 outputs (no cast) and compressor_raw with the rows given, where
    the step had a cast, two GEMVs and group_inputs' launches: the same latents and rings, byte for
    byte, over every phase (the simulator runs both)."""
    from mlx_dsv41.exl3 import EXL3Linear, ops
    from mlx_dsv41.exl3.synthetic import random_linear_tensors
    from mlx_dsv41.kernels import exl3 as launch
    from mlx_dsv41.kernels import grid_finish

    args = tiny_args(hidden_size=1024, head_dim=128)
    comp = Compressor(args, 1)
    for j, name in enumerate(("wkv", "wgate")):
        setattr(
            comp, name, EXL3Linear.from_stored(random_linear_tensors(1024, 128, 3, "mul1", seed=j, prefix="p"), "p")
        )
    sims = {k.name: exl3_sim.launcher(k, mma=False) for k in (cr.KERNEL, launch.GEMV)}
    calls = []

    def on_sim(self, **call):
        calls.append((self.name, dict(call["template"]).get("PAIR", 0), call["inputs"][0].dtype))
        return sims[self.name](**call)

    monkeypatch.setattr(kernels.Kernel, "__call__", on_sim)
    for module in (cr, ops, launch):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setitem(grid_finish.GRID_FINISH, "cuda", True)
    chunks = [3, 1, 1, 2, 1]
    one = _steps(comp, args, chunks, 4)
    assert [c[0] for c in calls] == ["exl3_gemv", "compressor_raw"] * len(chunks)
    assert all(pair > 0 and dtype == BF for name, pair, dtype in calls if name == "exl3_gemv")
    calls.clear()
    monkeypatch.setattr(cr, "backend", lambda: "cpu")  # the launches apart: cast, two GEMVs, group_inputs
    monkeypatch.setattr(launch, "TUNING", launch.Tuning(paired_gemv=0))
    apart = _steps(comp, args, chunks, 4)
    assert {(name, pair, dtype) for name, pair, dtype in calls} == {("exl3_gemv", 0, F32)}
    for step, (a, b) in enumerate(zip(one, apart)):
        assert (a[0] is None) == (b[0] is None), step
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b) if x is not None), step
