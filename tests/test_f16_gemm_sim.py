"""The f16_gemm kernel body (mlx_dsv41/metal_ext/f16_gemm.metal) on the CPU simulator, in its CUDA
configuration (MMA fragments) and its Metal one (per-lane FMAs), with the launch kwargs
mlx_dsv41.kernels.f16_gemm hands to MLX: against float64 a · b (fp16 operands: exact products,
fp32 sums), one b and a stack of b over row spans (an expert's sorted slots), a partial row tile,
several column threadgroups; rows past M (guard rows, poisoned) untouched. The two configurations
agree to fp32 rounding. tests/gpu/test_f16_gemm_gpu.py repeats this on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import f16_gemm as fg

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

GUARD = 3
CASES = [  # M, K, N, spans (None: one b)
    (70, 256, 256, None),
    (133, 128, 128, [(0, 5), (5, 70), (70, 70), (70, 133)]),  # an empty span: an expert with no slots
    (20, 32, 128, None),  # one k step: fewer than the pipeline's buffers
]


def _data(i):
    M, K, N, spans = CASES[i]
    rng = np.random.default_rng(i)
    G = 1 if spans is None else len(spans)
    a = mx.array(rng.standard_normal((M, K)).astype(np.float16))
    b = mx.array((rng.standard_normal((G, K, N)) / np.sqrt(K)).astype(np.float16))
    tiles = fg._dense_tiles(M) if spans is None else mx.array(fg.row_tiles(spans))
    return a, b, tiles, spans


def _want(a, b, spans):
    a64, b64 = np.array(a, np.float64), np.array(b, np.float64)
    spans = spans or [(0, a.shape[0])]
    return np.concatenate([a64[s:e] @ b64[g] for g, (s, e) in enumerate(spans)])


@pytest.fixture(scope="module", params=[True, False], ids=["cuda-mma", "metal-fma"])
def program(request):
    specs = []
    for i in range(len(CASES)):
        a, b, tiles, _ = _data(i)
        specs.append((fg.GEMM, fg.gemm_args(a, b, tiles, guard=GUARD)))
    return exl3_sim.build(specs, mma=request.param)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_matches_float64(program, i):
    a, b, _, spans = _data(i)
    (y,) = program.run(i)
    assert np.all(np.isnan(y[-GUARD:]))  # rows past M keep the 0xFF poison
    want = _want(a, b, spans)
    err = np.abs(y[:-GUARD] - want).max() / np.abs(want).max()
    assert err < 1e-6, err  # exact products, fp32 sums over K <= 256 (one fp16 rounding: 5e-4)


def test_row_tiles_cover_each_span_in_pieces_of_at_most_bm():
    tiles = fg.row_tiles([(0, 5), (5, 5), (5, 200)])
    assert tiles.tolist() == [[0, 5, 0], [5, 69, 2], [69, 133, 2], [133, 197, 2], [197, 200, 2]]


def test_gemm_refuses_what_it_does_not_take():
    a, b = mx.zeros((4, 128), mx.float16), mx.zeros((2, 128, 128), mx.float16)
    with pytest.raises(ValueError, match="must be fp16"):
        fg.gemm(a.astype(mx.float32), b)
    with pytest.raises(ValueError, match="must cover"):
        fg.gemm(a, b, [(0, 2), (2, 3)])


@pytest.fixture
def simulated_cuda_product(monkeypatch):
    """The ops' CUDA product path on this CPU: f16_gemm taken, its launches run on the simulator
    (MMA configuration)."""
    a, b, tiles, _ = _data(1)
    prog = exl3_sim.build([(fg.GEMM, fg.gemm_args(a, b, tiles))], mma=True)
    calls = []

    def launch(**call):
        calls.append(call["grid"])
        return [mx.array(prog.run(0, call)[0])]

    monkeypatch.setattr(fg, "takes_kernel", lambda k, n: True)
    monkeypatch.setattr(fg, "GEMM", launch)
    return calls


def _close_bf16(got, want):
    """bf16 outputs of two fp32 summation orders: most elements equal, the rest one rounding apart."""
    assert np.mean(got == want) > 0.9
    assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max()


@pytest.fixture
def cuda_ops(monkeypatch, simulated_cuda_product):
    """mlx_dsv41.exl3.ops taking its CUDA paths, with W̃ decoded by the reference and the
    transforms' kernels (exl3_rows_in, exl3_rows_out) run on the simulator."""
    from mlx_dsv41.exl3 import ops, reference
    from mlx_dsv41.kernels import exl3 as launch

    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    monkeypatch.setattr(ops, "reconstruct", reference.reconstruct)
    for name in ("ROWS_IN", "ROWS_OUT"):
        monkeypatch.setattr(launch, name, exl3_sim.launcher(getattr(launch, name)))
    return ops


@pytest.mark.parametrize("bias,out_dtype", [(False, None), (True, mx.float32)])
def test_exl3_prefill_linear_on_f16_gemm(cuda_ops, simulated_cuda_product, bias, out_dtype):
    """ops.linear past the GEMV's rows: exl3_rows_in, f16_gemm, exl3_rows_out (with a bias, and
    a float32 output), against the reference linear."""
    from mlx_dsv41.exl3 import reference
    from mlx_dsv41.exl3.synthetic import random_linear_tensors

    t = random_linear_tensors(256, 384, 3, "mul1", seed=5, bias=bias)
    args = (mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"]), "mul1")
    b = mx.array(t["bias"][:300]) if bias else None  # a bias shorter than the padded outputs
    x = mx.array(np.random.default_rng(6).standard_normal((70, 256)).astype(np.float32)).astype(mx.bfloat16)
    got = cuda_ops.linear(x, *args, bias=b, out_features=300 if bias else None, out_dtype=out_dtype)
    want = reference.linear(x, *args, bias=b, out_features=300 if bias else None, out_dtype=out_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert simulated_cuda_product == [(256 * 3, 2, 1)]  # 3 column blocks x 2 row tiles
    if got.dtype == mx.float32:  # two fp32 summation orders: within fp32 noise of the scale
        got, want = np.array(got), np.array(want)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    else:
        _close_bf16(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_prefill_experts_on_f16_gemm(cuda_ops, simulated_cuda_product, monkeypatch):
    """ops.experts_sorted's CUDA path: one f16_gemm launch per projection and batch of experts,
    each expert's slots against its own W̃, mixed K, experts in two batches, a held range."""
    from mlx_dsv41.exl3 import experts_from_stored, reference
    from mlx_dsv41.exl3.synthetic import random_experts_tensors

    tensors = random_experts_tensors(6, 256, 384, bits={"w1": (3, 4), "w3": 3, "w2": (2, 4)}, seed=12)
    ex = experts_from_stored(tensors, "experts", 6, 256, 384, 10.0, (1, 6))
    monkeypatch.setattr(cuda_ops, "EXPERT_GEMM_BYTES", 3 * 2 * 256 * 384)  # 3 experts a batch
    rng = np.random.default_rng(8)
    T = 16
    x = mx.array(rng.standard_normal((T, 256)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.permutation(6)[:3] for _ in range(T)]).astype(np.int32))
    wts = mx.array(rng.uniform(0.1, 1.0, (T, 3)).astype(np.float32))
    got = np.array(ex(x, idx, wts))
    want = np.array(
        reference.experts_by_expert(x, idx, wts, ex.w1, ex.w3, ex.w2, ex.expert_range, 10.0, reference.linear)
    )
    assert len(simulated_cuda_product) == 6  # 5 held experts in batches of 3: 2 batches x 3 projections
    assert np.all(got[np.array(idx) == 0] == 0)
    _close_bf16(got, want)


def test_prefill_grouped_linear_on_f16_gemm(cuda_ops, simulated_cuda_product):
    """ops.grouped's CUDA path for more than FUSED_MAX_TOKENS tokens (wo_a in a prefill): every
    group's W̃ decoded once, one f16_gemm launch over the groups' rows, each group's output as its
    own linear gives it (the reference, per group), mixed K across groups."""
    from mlx_dsv41.exl3 import reference
    from mlx_dsv41.exl3.experts import EXL3GroupedLinear
    from mlx_dsv41.exl3.synthetic import random_linear_tensors

    slices = []
    for g, bits in enumerate((3, 4, 3)):
        t = random_linear_tensors(256, 128, bits, "mul1", seed=20 + g)
        slices.append({k: mx.array(t[k]) for k in ("trellis", "suh", "svh")} | {"codebook": "mul1"})
    layer = EXL3GroupedLinear.from_slices(slices, 256, 128)
    T = 13
    x = mx.array(np.random.default_rng(9).standard_normal((T, 3, 256)).astype(np.float32)).astype(mx.bfloat16)
    got = np.array(layer(x).astype(mx.float32))
    want = np.stack(
        [np.array(reference.linear(x[:, g], *layer.proj.expert(g)).astype(mx.float32)) for g in range(3)], axis=1
    )
    assert got.shape == (T, 3, 128) and len(simulated_cuda_product) == 1
    _close_bf16(got, want)
