"""The EXL3 kernel bodies (mlx_dsv41/metal_ext/exl3_*.metal) run on the CPU simulator (tests/exl3_sim) with
the exact launch kwargs mlx_dsv41.kernels.exl3 hands to MLX: reconstruct bit-exact for every K and
codebook, the GEMV (both the CUDA configuration -- tensor-core MMAs, the trellis streamed through a
threadgroup ring by asynchronous copies -- and the Metal one -- per-lane FMAs, tiles read from
device memory) and the expert kernels against the plain-MLX reference, for every launch shape
(launch.Tuning); outputs start poisoned and guard rows past the shape must stay untouched. The GPU
tests (tests/gpu/test_exl3_kernels.py) repeat this on the device."""

import shutil

import exl3_sim
import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest
from exl3_numpy import rel_err

from mlx_dsv41.exl3 import EXL3Experts, EXL3Linear, reference
from mlx_dsv41.exl3.synthetic import random_experts_tensors, random_linear_tensors
from mlx_dsv41.kernels import exl3 as launch

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

BITS = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS = (1.5, 2.5, 3.5)


def with_input(call, i, array, kernel=None):
    """call with input i (an index, or a name of kernel's inputs) replaced by array."""
    call = dict(call, inputs=list(call["inputs"]))
    call["inputs"][kernel.input_names.index(i) if kernel else i] = array
    return call


# ------------------------------------------------------------------------------------ reconstruct

RECONSTRUCT_CASES = [(b, cb) for b in BITS for cb in ("3inst", "mcg", "mul1")] + [(b, "mul1") for b in HALF_BITS]


@pytest.fixture(scope="module")
def reconstruct_runs():
    rng = np.random.default_rng(0)
    cases = []
    for i, (bits, codebook) in enumerate(RECONSTRUCT_CASES):
        trellis = mx.array(rng.integers(-(1 << 15), 1 << 15, (2 + i % 3, 16, int(16 * bits)), dtype=np.int16))
        cases.append((trellis, codebook, launch.reconstruct_args(trellis, codebook, guard_rows=3)))
    program = exl3_sim.build([(launch.RECONSTRUCT, c[2]) for c in cases], mma=True)
    return [(trellis, codebook, program.run(i)[0]) for i, (trellis, codebook, _) in enumerate(cases)]


@pytest.mark.parametrize("case", range(len(RECONSTRUCT_CASES)), ids=[f"K{b}-{c}" for b, c in RECONSTRUCT_CASES])
def test_reconstruct_bit_exact(reconstruct_runs, case):
    trellis, codebook, out = reconstruct_runs[case]
    k = trellis.shape[0] * 16
    want = np.array(reference.reconstruct(trellis, codebook)).view(np.uint16)
    assert np.array_equal(out[:k].view(np.uint16), want)
    assert np.all(out[k:].view(np.uint16) == 0xFFFF)  # guard rows: still the poison


# ------------------------------------------------------------------------------------------ GEMV

# (m, in, out, bits, codebook, x dtype, out dtype, splits, tuning, bias): fused and split, every
# launch shape (SIMD groups per threadgroup x tile columns per group, trellis ring depth), M =
# 1/2/4/8 templates with rows to spare, several xh chunks (M = 8, k > 1024), padded inputs, every
# codebook, half-integer K.
T = launch.Tuning
GEMV_CASES = [
    (1, 256, 256, 3, "mul1", mx.bfloat16, mx.float32, 1, T(), False),
    (1, 512, 128, 2, "mul1", mx.bfloat16, mx.bfloat16, 4, T(warps=16, nc=2), True),
    (2, 384, 256, 6, "3inst", mx.bfloat16, mx.bfloat16, 1, T(nc=8), True),
    (3, 250, 384, 4, "mcg", mx.float16, mx.float32, 2, T(nc=2), True),
    (5, 512, 256, 2.5, "mul1", mx.float32, mx.float32, 3, T(warps=16, nc=4), False),
    (8, 256, 128, 5, "mul1", mx.bfloat16, mx.float32, None, T(), True),
    (8, 1280, 128, 3, "mul1", mx.bfloat16, mx.bfloat16, 1, T(ring_words=1), True),  # 2 xh chunks, 2 stages
    (8, 128, 256, 8, "mcg", mx.float16, mx.float16, 1, T(nc=8), False),
    (4, 640, 128, 3.5, "mul1", mx.bfloat16, mx.float32, 2, T(ring_words=3 * 256 * 7), False),  # 3 stages
    (8, 384, 256, 4, "mul1", mx.bfloat16, mx.bfloat16, 1, T(warps=4, nc=2), True),  # 4 groups, 8 rows
    (1, 512, 256, 3, "mul1", mx.bfloat16, mx.float32, 2, T(warps=4), False),
    (2, 256, 128, 2, "mcg", mx.float16, mx.float16, 1, T(warps=4, nc=8), False),
]


def gemv_case(i):
    m, in_f, out_f, bits, codebook, dtype, out_dtype, splits, tuning, bias = GEMV_CASES[i]
    t = random_linear_tensors(in_f, out_f, bits, codebook, seed=10 + i, bias=bias)
    args = (
        mx.array(t["trellis"]),
        mx.array(t["suh"]),
        mx.array(t["svh"]),
        codebook,
        mx.array(t["bias"]) if bias else None,
    )
    x = (mx.random.normal((m, in_f), key=mx.random.key(i)) * 2).astype(dtype)
    calls = launch.gemv_args(x, *args[:4], args[4], out_dtype, splits=splits, tuning=tuning, guard_rows=2)
    return x, args, out_dtype, calls


@pytest.fixture(scope="module", params=[True, False], ids=["mma", "fma"])
def gemv_runs(request):
    cases = [gemv_case(i) for i in range(len(GEMV_CASES))]
    specs = []
    for *_, calls in cases:
        specs.append((launch.GEMV, calls[0]))
        if len(calls) == 2:
            partial_shape = calls[0]["output_shapes"][0]
            specs.append(
                (launch.GEMV_OUT, with_input(calls[1], 0, mx.zeros((partial_shape[0] - 2, *partial_shape[1:]))))
            )
    program = exl3_sim.build(specs, mma=request.param)
    runs, spec = [], 0
    for x, args, out_dtype, calls in cases:
        out = program.run(spec)[0]
        spec += 1
        partial = None
        if len(calls) == 2:
            partial = out
            out = program.run(spec, with_input(calls[1], 0, mx.array(partial[:-2])))[0]
            spec += 1
        runs.append((x, args, out_dtype, calls, partial, out))
    return runs


def test_gemv_cases_cover_every_variant():
    seen = set()
    for i in range(len(GEMV_CASES)):
        call = gemv_case(i)[3][0]
        template = dict(call["template"])
        seen.add(("fused", template["FUSED"]))
        seen.add(("shape", template["NW"], template["NC"]))
        seen.add(("stages", template["STAGES"]))
        seen.add(("M", template["M"]))
        seen.add(("OUT", template["FUSED"], GEMV_CASES[i][6]))
        if template["M"] * call["inputs"][0].shape[1] > 64 * 128:
            seen.add("xh chunks")
    assert {("fused", True), ("fused", False), ("M", 1), ("M", 2), ("M", 4), ("M", 8), "xh chunks"} <= seen
    assert {("shape", w, nc) for w, nc in ((4, 2), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8), (16, 2), (16, 4))} <= seen
    assert {("stages", s) for s in (2, 3, 4)} <= seen
    assert {("OUT", fused, dtype) for fused in (True, False) for dtype in (mx.float32, mx.bfloat16)} <= seen
    assert ("OUT", True, mx.float16) in seen


@pytest.mark.parametrize("case", range(len(GEMV_CASES)))
def test_gemv_matches_reference(gemv_runs, case):
    x, (trellis, suh, svh, codebook, bias), out_dtype, calls, partial, out = gemv_runs[case]
    m = x.shape[0]
    assert len(calls) == (1 if dict(calls[0]["template"])["FUSED"] else 2)
    if partial is not None:
        assert np.all(np.isnan(partial[-2:]))  # guard splits untouched
        assert not np.any(np.isnan(partial[:-2]))
    guard = out[m:].astype(np.float32)
    assert np.all(np.isnan(guard))
    y = out[:m].astype(np.float32)
    want = np.array(reference.linear(x, trellis, suh, svh, codebook, bias, out_dtype=out_dtype).astype(mx.float32))
    # Same math, other summation orders: fp16 xh may round differently at a tie-break boundary.
    out_eps = {mx.float32: 0.0, mx.float16: 2**-11, mx.bfloat16: 2**-8}[out_dtype]
    assert rel_err(y, want) < 1e-4 + out_eps


def test_launch_plans():
    # Narrow outputs split k until the launch has dense_split_warps SIMD groups (two launches),
    # wide ones run in one launch; splits cover k exactly once.
    t = launch.Tuning(warps=8, dense_split_warps=2112, dense_single_blocks=128)  # 264 threadgroups
    assert launch.dense_plan(40, 4, t) == (40, 1)  # wkv 5120x512: one block per threadgroup
    assert launch.dense_plan(40, 10, t) == (20, 2)  # wq_a 5120x1280
    assert launch.dense_plan(10, 256, t) == (1, 10)  # wq_b 1280x32768: one launch
    assert launch.dense_plan(40, 1010, t) == (1, 40)  # head
    # splits = ceil(264 / n_blocks) capped at k_blocks, then evened out: per = ceil(k / splits).
    assert launch.dense_plan(64, 40, t) == (7, 10)  # wo_b 8192x5120: 7 splits, the last one of 4 blocks
    assert launch.dense_plan(18, 40, t) == (6, 3)  # expert w2 2304x5120
    assert launch.dense_plan(40, 18, t) == (14, 3)  # expert w1/w3 5120x2304
    assert launch.dense_plan(32, 8, t) == (32, 1)  # wo_a group 4096x1024
    assert launch.dense_plan(40, 4, launch.Tuning(warps=16, dense_split_warps=640)) == (
        10,
        4,
    )  # SIMD groups, not threadgroups
    for warps, nc in ((16, 8), (2, 4), (8, 3)):
        with pytest.raises(ValueError, match=f"warps {warps} x nc {nc}"):
            launch.Tuning(warps=warps, nc=nc)
    for role in ("gate_up_warps", "down_warps"):
        with pytest.raises(ValueError, match="warps 16 x nc 8"):
            launch.Tuning(nc=8, **{role: 16})
    # xh staging sized to the threadgroup's k range (rows x blocks x 64 words), 16 KiB at most.
    xsw = [dict(t.template(8, 6, rows, blocks))["XSW"] for rows, blocks in ((1, 1), (1, 18), (1, 40), (8, 2), (8, 40))]
    assert xsw == [1024, 2048, 4096, 1024, 4096]
    assert [t.stages(k2) for k2 in (2, 6, 8, 10, 16)] == [4, 4, 3, 2, 2]
    # Metal: no trellis ring, at most 8 KiB of xh, 32 KiB of threadgroup memory in all.
    assert dict(t.template(8, 6, 8, 40, "metal"))["XSW"] == 2048
    with pytest.raises(ValueError, match="threadgroup memory on metal"):
        launch.Tuning(nc=8).template(8, 6, 8, 40, "metal")


# --------------------------------------------------------------------------------------- experts

EXPERT_CASES = [
    # hidden, inter, bits, codebook, expert_range, T, top_k, tuning (None: the default)
    (
        256,
        384,
        {"w1": (3, 2), "w3": 3, "w2": (2, 3, 4)},
        "mul1",
        (1, 5),
        2,
        3,
        T(gate_up_warps=16, nc=2, down_warps=4, gate_up_split_warps=8, down_split_warps=8),
    ),
    (200, 300, {"w1": 2.5, "w3": 2.5, "w2": 4}, {"w1": "mul1", "w3": "mul1", "w2": ("mcg", "3inst")}, None, 1, 6, None),
]


def expert_chain(ex, x, indices, weights, tuning, finish=None, shared=None, init_value=None):
    """The launch kwargs exl3_experts issues, with zero stand-ins for chained inputs and a guard row
    on every output (poisoned with ``init_value`` where given). ``finish`` = (y's dtype, add): the
    last gate_up and down launches finish themselves (FINISH; no swiglu and down_finish calls: None
    in their places). ``shared`` (the shared expert's (w1, w3, w2) single experts; with finish =
    (float32, None)): launch.run_moe's calls, the last launches serving its slots too."""
    lo, T = ex.expert_range[0], indices.shape[0]
    slots = indices.size + (0 if shared is None else T)
    keys, groups = launch.gate_up_keys(ex.w1, ex.w3), ex.w2.groups
    common = dict(tuning=tuning, guard=1, init_value=init_value)
    gu_calls, prev = [], None
    for key in keys:
        last = finish and key == keys[-1]
        fin = (weights, ex.w2, ex.swiglu_limit, launch.split_counters(slots * ex.w1.n // 128)) if last else None
        sh = shared if last else None
        call = launch.gate_up_args(x, indices, ex.w1, ex.w3, key, lo, prev=prev, finish=fin, shared=sh, **common)
        gu_calls.append(call)
        shape = call["output_shapes"][0]
        prev = mx.zeros((shape[0] - 1, *shape[1:]))
    gu = prev
    swiglu = launch.swiglu_args(gu, weights, indices, ex.w1, ex.w3, ex.w2, lo, ex.swiglu_limit, guard=1)
    xh = mx.zeros((slots, ex.w1.n // 2), mx.uint32)
    down_calls, prev = [], None
    for group in groups:
        last = finish and group is groups[-1]
        fin = (*finish, launch.split_counters(slots * ex.w2.n // 128)) if last else None
        per_token = (shared[2], x.dtype, launch.split_counters(T * ex.w2.n // 128)) if last and shared else None
        call = launch.down_args(xh, indices, ex.w2, group, lo, prev=prev, finish=fin, shared=per_token, **common)
        down_calls.append(call)
        shape = call["output_shapes"][0]
        prev = mx.zeros((shape[0] - 1, *shape[1:]))
    out_dtype, add = finish or (mx.float32, None)
    done = launch.down_finish_args(prev, indices, ex.w2, lo, guard=1, out_dtype=out_dtype, add=add)
    return gu_calls, None if finish else swiglu, down_calls, None if finish else done


def run_chain(program, spec, calls):
    """Run expert_chain's calls (the specs from `spec` on, in order) on the simulator, feeding each
    launch its predecessors' outputs: (the calls' outputs, each as the simulator returns them, the
    specs used)."""
    gu_calls, swiglu, down_calls, done = calls
    outs, gu = [], None
    for call in gu_calls:
        outs.append(
            program.run(spec, call if gu is None else with_input(call, "prev", mx.array(gu), launch.EXPERT_GATE_UP))
        )
        gu, spec = outs[-1][0][:-1], spec + 1
    if swiglu is None:
        xh = outs[-1][1][:-1]
    else:
        outs.append(program.run(spec, with_input(swiglu, "gu", mx.array(gu), launch.EXPERT_SWIGLU)))
        xh, spec = outs[-1][0][:-1], spec + 1
    partial = None
    for call in down_calls:
        call = with_input(call, "xh", mx.array(xh), launch.EXPERT_DOWN)
        if partial is not None:
            call = with_input(call, "prev", mx.array(partial), launch.EXPERT_DOWN)
        outs.append(program.run(spec, call))
        partial, spec = outs[-1][0][:-1], spec + 1
    if done is not None:
        outs.append(program.run(spec, with_input(done, "partial", mx.array(partial), launch.EXPERT_DOWN_FINISH)))
        spec += 1
    return outs, spec


def chain_specs(calls) -> list:
    gu_calls, swiglu, down_calls, done = calls
    specs = [(launch.EXPERT_GATE_UP, c) for c in gu_calls]
    specs += [] if swiglu is None else [(launch.EXPERT_SWIGLU, swiglu)]
    specs += [(launch.EXPERT_DOWN, c) for c in down_calls]
    return specs + ([] if done is None else [(launch.EXPERT_DOWN_FINISH, done)])


@pytest.fixture(scope="module", params=[True, False], ids=["mma", "fma"])
def expert_runs(request):
    cases = [(*expert_case(i), EXPERT_CASES[i][-1]) for i in range(len(EXPERT_CASES))]
    chains = [expert_chain(ex, x, indices, weights, tuning) for ex, x, indices, weights, tuning in cases]
    program = exl3_sim.build([s for calls in chains for s in chain_specs(calls)], mma=request.param)
    runs, spec = [], 0
    for (ex, x, indices, weights, _), calls in zip(cases, chains):
        outs, spec = run_chain(program, spec, calls)
        for out in outs:
            assert_guarded(out[0])
        runs.append((ex, x, indices, weights, calls[0], calls[2], outs[-1][0][:-1]))
    return runs


def expert_case(i: int):
    """EXPERT_CASES[i]'s experts (6, seeded), x, routing and routing weights."""
    hidden, inter, bits, codebook, expert_range, tokens, top_k, _ = EXPERT_CASES[i]
    n_experts = 6
    tensors = random_experts_tensors(n_experts, hidden, inter, bits, codebook, seed=20 + i)
    ex = EXL3Experts.from_tensors(tensors, "experts", n_experts, expert_range, hidden, inter)
    rng = np.random.default_rng(i)
    x = mx.array(rng.normal(0, 2, (tokens, hidden)).astype(np.float32)).astype(mx.bfloat16)
    indices = mx.array(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(tokens)]).astype(np.int32))
    weights = mx.array(rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32))
    return ex, x, indices, weights


def assert_guarded(out):
    """A simulator output with a guard row (the last): the guard keeps its poison (NaN; 0xFFFFFFFF
    words), every other float is written."""
    if out.dtype == np.uint32:
        assert np.all(out[-1] == 0xFFFFFFFF)
    else:
        assert np.all(np.isnan(out[-1].astype(np.float32))) and not np.any(np.isnan(out[:-1].astype(np.float32)))


@pytest.mark.parametrize("case", range(len(EXPERT_CASES)))
def test_expert_launches_that_finish_themselves_give_the_separate_kernels_bytes(case):
    """FINISH (CUDA's launch plan, launch.expert_finish): the last exl3_expert_gate_up launch also
    does exl3_expert_swiglu's work and the last exl3_expert_down launch exl3_expert_down_finish's,
    through the same functions (exl3_swiglu_block, exl3_down_finish_block): xh and y are the
    separate kernels' bytes, every launch's partials are unchanged, guard rows keep their poison."""
    ex, x, indices, weights = expert_case(case)
    assert_finish_gives_the_separate_bytes(ex, x, indices, weights, EXPERT_CASES[case][-1])


def test_finishing_launches_add_more_splits_than_they_hold_at_once():
    """k split 10 ways (more than EXL3_SPLIT_CHUNK: the finishing threadgroup holds 8 splits'
    partials at a time and loads the rest chunk by chunk): still the separate kernels' bytes."""
    tensors = random_experts_tensors(3, 1280, 1280, bits={"w1": 3, "w3": (3, 2), "w2": 3}, seed=7)
    ex = EXL3Experts.from_tensors(tensors, "experts", 3, None, 1280, 1280)
    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(0, 2, (1, 1280)).astype(np.float32)).astype(mx.bfloat16)
    indices, weights = mx.array([[2, 0]], mx.int32), mx.array([[0.7, 0.4]], mx.float32)
    tuning = T(gate_up_split_warps=8 * 2 * 6 * 10 * 10, down_split_warps=8 * 6 * 10 * 10)
    assert launch.expert_plan(ex.w1, tuning) == (10, 1) and launch.down_plan(ex.w2, tuning) == (10, 1)
    y = assert_finish_gives_the_separate_bytes(ex, x, indices, weights, tuning)
    want = np.array(
        reference.experts_by_expert(
            x, indices, weights, ex.w1, ex.w3, ex.w2, ex.expert_range, ex.swiglu_limit, reference.linear
        )
    )
    for s in range(2):  # every split counted once: as test_experts_match_reference
        assert rel_err(y[s], want[0, s]) < 1e-3 + 2**-8


def assert_finish_gives_the_separate_bytes(ex, x, indices, weights, tuning):
    """The FINISH chain's xh and y are the separate chain's bytes (partials too, guards kept): y."""
    two = expert_chain(ex, x, indices, weights, tuning)
    one = expert_chain(ex, x, indices, weights, tuning, finish=(mx.float32, None))
    assert all(dict(c[-1]["template"])["FINISH"] for c in (one[0], one[2])) and one[1] is one[3] is None
    program = exl3_sim.build(chain_specs(two) + chain_specs(one), mma=False)
    outs_two, spec = run_chain(program, 0, two)
    outs_one, _ = run_chain(program, spec, one)
    n_gu, n_down = len(two[0]), len(two[2])
    assert len(outs_two) == n_gu + n_down + 2 and len(outs_one) == n_gu + n_down and n_gu + n_down > 2

    def same(a, b):
        return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))

    partials_two = [o[0] for o in outs_two[:n_gu] + outs_two[n_gu + 1 : -1]]
    assert all(same(a, o[0]) for a, o in zip(partials_two, outs_one))
    xh_two, xh_one = outs_two[n_gu][0], outs_one[n_gu - 1][1]
    y_two, y_one = outs_two[-1][0], outs_one[-1][1]
    assert same(xh_one, xh_two) and same(y_one, y_two)
    assert_guarded(xh_one)
    assert_guarded(y_one)
    assert np.count_nonzero(y_one[:-1]) > y_one[:-1].size // 4
    return y_one[:-1]


@pytest.mark.parametrize("add", [False, True], ids=["bf16", "bf16+routed"])
def test_a_finishing_down_launch_stores_bf16_and_adds_the_routed_slots_as_the_finish_kernel(add):
    """The shared expert's chain (one slot per token) with FINISH: y in bf16 (a grouped linear's
    output dtype) and, with the routed slots to add (ADD), the MoE's output, each the bytes of
    exl3_expert_down_finish."""
    from types import SimpleNamespace

    lin = [
        EXL3Linear.from_stored(random_linear_tensors(i, o, b, seed=s, prefix="p"), "p")
        for i, o, b, s in ((256, 384, 3, 1), (256, 384, 4, 2), (384, 256, 3, 3))
    ]
    ex = SimpleNamespace(
        w1=lin[0].as_single_expert(),
        w3=lin[1].as_single_expert(),
        w2=lin[2].as_single_expert(),
        expert_range=(0, 1),
        swiglu_limit=7.0,
    )
    T = 3
    rng = np.random.default_rng(11)
    x = mx.array(rng.normal(0, 2, (T, 256)).astype(np.float32)).astype(mx.bfloat16)
    indices, weights = mx.zeros((T, 1), mx.int32), mx.ones((T, 1), mx.float32)
    routed = mx.array(rng.normal(0, 1, (T, 6, 256)).astype(np.float32)) if add else None
    two = expert_chain(ex, x, indices, weights, None)
    two = (
        *two[:3],
        launch.down_finish_args(
            mx.zeros(two[3]["inputs"][0].shape), indices, ex.w2, 0, guard=1, out_dtype=mx.bfloat16, add=routed
        ),
    )
    one = expert_chain(ex, x, indices, weights, None, finish=(mx.bfloat16, routed))
    program = exl3_sim.build(chain_specs(two) + chain_specs(one), mma=False)
    outs_two, spec = run_chain(program, 0, two)
    outs_one, _ = run_chain(program, spec, one)
    y_two, y_one = outs_two[-1][0], outs_one[-1][1]
    assert y_one.dtype == ml_dtypes.bfloat16 and np.array_equal(y_one.view(np.uint16), y_two.view(np.uint16))
    assert_guarded(y_one)
    assert np.count_nonzero(y_one[:-1].astype(np.float32)) > y_one[:-1].size // 2


def test_launch_constants_are_template_values():
    """k splits, the held expert range and the SwiGLU limit travel as template values, never as
    small host arrays (docs/design.md "Launch constants"); a limit <= 0 (no clamp) is passed as 0."""
    from mlx_dsv41.kernels import float_bits

    tensors = random_experts_tensors(4, 256, 384, bits={"w1": 3, "w3": 3, "w2": 4}, seed=3)
    ex = EXL3Experts.from_tensors(tensors, "experts", 4, (1, 4))
    x = mx.zeros((1, 256), mx.bfloat16)
    indices, weights = mx.array([[1, 3]], mx.int32), mx.array([[0.5, 0.5]], mx.float32)
    key = (ex.w1.groups[0].k2, ex.w1.groups[0].codebook)
    gu = launch.gate_up_args(x, indices, ex.w1, ex.w3, key, 1)
    splits, per_split = launch.expert_plan(ex.w1)
    assert {k: v for k, v in gu["template"] if k in ("LO", "PER_SPLIT", "SPLITS")} == {
        "LO": 1,
        "PER_SPLIT": per_split,
        "SPLITS": splits,
    }
    partial = mx.zeros(gu["output_shapes"][0], mx.float32)
    for limit, bits in ((10.0, 0x41200000), (0.0, 0), (-1.0, 0), (-0.0, 0)):
        mid = dict(launch.swiglu_args(partial, weights, indices, ex.w1, ex.w3, ex.w2, 1, limit)["template"])
        assert (mid["LO"], mid["INTER"], mid["LIMIT_BITS"]) == (1, 384, bits)
    d_splits, d_per_split = launch.down_plan(ex.w2)
    xh = mx.zeros((2, ex.w1.n // 2), mx.uint32)
    down = dict(launch.down_args(xh, indices, ex.w2, ex.w2.groups[0], 1)["template"])
    assert (down["LO"], down["PER_SPLIT"], down["SPLITS"]) == (1, d_per_split, d_splits)
    t = random_linear_tensors(256, 256, 3, "mul1", seed=1)
    gemv = launch.gemv_args(x, mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"]), "mul1", splits=2)
    assert dict(gemv[0]["template"])["PER_SPLIT"] == 1
    # x, suh, trellis, svh, bias, the FINISH counters (a constant stand-in without FINISH), NORM's
    # weight, PAIR's suh2, trellis2, svh2 and ROPE's / RING's offset, period, norm2_w, window (without
    # them: svh, suh, trellis, svh, a 0-d constant offset, svh x 3, never read); eps, the pair's column
    # blocks and k split, RING's eps and quantization are template values
    inputs = gemv[0]["inputs"]
    assert len(inputs) == len(launch.GEMV.input_names) == 14
    assert [inputs[i] is inputs[j] for i, j in ((6, 3), (7, 1), (8, 2), (9, 3), (11, 3), (12, 3), (13, 3))] == [
        True
    ] * 7
    assert inputs[10].shape == () and inputs[10].dtype == mx.int32
    template = dict(gemv[0]["template"])
    assert [template[k] for k in ("EPS_BITS", "PAIR", "PER_SPLIT2", "ROPE", "RING", "EPS2_BITS")] == [0] * 6
    assert float_bits(0.5) == 0x3F000000
    with pytest.raises(ValueError, match="sign bit set"):
        float_bits(-1.0)


@pytest.mark.parametrize("case", range(len(EXPERT_CASES)))
def test_experts_match_reference(expert_runs, case):
    ex, x, indices, weights, gu_calls, down_calls, y = expert_runs[case]
    n_down = len(down_calls)
    assert down_calls[0]["output_shapes"][0][1] == (1, 3)[case]  # w2's k splits: one, then three
    n_gate_up = len(gu_calls)
    assert gu_calls[0]["output_shapes"][0][2] == case + 1  # k splits: one, then two
    assert n_gate_up == len(launch.gate_up_keys(ex.w1, ex.w3)) and n_down == len(ex.w2.groups)
    assert n_gate_up + n_down > 2  # mixed groups are exercised
    T, top_k = indices.shape
    y = y[:, : ex.w2.out_features].reshape(T, top_k, -1)
    want = np.array(
        reference.experts_by_expert(
            x, indices, weights, ex.w1, ex.w3, ex.w2, ex.expert_range, ex.swiglu_limit, reference.linear
        )
    )
    lo, hi = ex.expert_range
    idx = np.array(indices)
    outside = (idx < lo) | (idx >= hi)
    assert np.all(y[outside] == 0) and np.all(want[outside] == 0)
    for t, s in zip(*np.nonzero(~outside)):
        # A bf16 boundary flip of g, u, h or y moves one element by 2^-8; the rest is summation order.
        assert rel_err(y[t, s], want[t, s]) < 1e-3 + 2**-8


# ---------------------------------------------------------------------------------- grouped linear


@pytest.fixture(scope="module", params=[True, False], ids=["mma", "fma"])
def grouped_run(request):
    """wo_a-like: 4 groups of 300 -> 200 (padded 384 -> 256), mixed K, through exl3_expert_down per
    (K, codebook) group (each forming its groups' xh from x: STAGE_X) and exl3_expert_down_finish, as
    launch.run_grouped issues them off CUDA."""
    from mlx_dsv41.exl3 import EXL3GroupedLinear
    from mlx_dsv41.exl3.stored import linear_tensors

    bits = (3, 2, 3, 4)
    slices = [
        linear_tensors(
            {k: mx.array(v) for k, v in random_linear_tensors(300, 200, b, "mul1", seed=40 + g, prefix="s").items()},
            "s",
        )
        for g, b in enumerate(bits)
    ]
    layer = EXL3GroupedLinear.from_slices(slices, 300, 200)
    T, G = 3, len(bits)
    x = mx.array(np.random.default_rng(5).normal(0, 2, (T, G, 300)).astype(np.float32)).astype(mx.bfloat16)
    indices = mx.broadcast_to(mx.arange(G, dtype=mx.int32), (T, G))
    proj = layer.proj
    calls, prev = [], None
    for group in proj.groups:
        call = launch.down_args(x.reshape(T * G, 300), indices, proj, group, 0, prev=prev, guard=1)
        assert dict(call["template"])["STAGE_X"]
        calls.append((launch.EXPERT_DOWN, call))
        shape = call["output_shapes"][0]
        prev = mx.zeros((shape[0] - 1, *shape[1:]))
    finish = launch.down_finish_args(prev, indices, proj, 0, guard=1, out_dtype=mx.bfloat16)  # as run_grouped
    calls.append((launch.EXPERT_DOWN_FINISH, finish))
    program = exl3_sim.build(calls, mma=request.param)
    partial = None
    for i in range(len(calls) - 1):
        call = (
            calls[i][1] if partial is None else with_input(calls[i][1], "prev", mx.array(partial), launch.EXPERT_DOWN)
        )
        out = program.run(i, call)[0]
        assert_guarded(out)
        partial = out[:-1]
    y = program.run(len(calls) - 1, with_input(calls[-1][1], "partial", mx.array(partial), launch.EXPERT_DOWN_FINISH))
    y = y[0].astype(np.float32)
    assert np.all(np.isnan(y[-1]))
    return layer, x, y[:-1, :200].reshape(T, G, 200), len(proj.groups)


def test_grouped_linear_on_the_gpu_path_takes_the_model_s_shape(grouped_run, monkeypatch):
    """The layer's GPU path (launch.run_grouped: exl3_expert_down per group, the last finishing
    itself as on CUDA, on the simulator) from x [B, S, G, in] as Attention.output hands it: the
    bytes of the same rows given as [T, G, in], and of the separate launches' fixture."""
    from mlx_dsv41.exl3 import ops

    layer, x, y, _ = grouped_run
    for mod in (ops, launch):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    for name in ("EXPERT_DOWN", "EXPERT_DOWN_FINISH"):
        monkeypatch.setattr(launch, name, exl3_sim.launcher(getattr(launch, name)))
    flat = np.array(layer(x).astype(mx.float32))
    model_shape = np.array(layer(x.reshape(1, *x.shape)).astype(mx.float32))
    assert model_shape.shape == (1, *flat.shape) and np.array_equal(model_shape[0], flat)
    assert np.array_equal(flat, y)


@pytest.mark.parametrize("out", [200, 256])
def test_a_grouped_linear_of_the_attention_output_s_shape_gives_the_grouped_bytes(out, monkeypatch):
    """quant.grouped_flat (Attention.output: wo_a of o [B, S, H, D], the output [B, S, G · out]) on
    the GPU path, the last launch finishing itself as on CUDA, on the simulator: the bytes of the
    layer on x [B, S, G, in], then reshaped. out = 256 fills whole tiles: x and the output go to the
    launches in those shapes (no reshape node); 200 does not (the reshaped path)."""
    from mlx_dsv41.exl3 import EXL3GroupedLinear, ops
    from mlx_dsv41.exl3.stored import linear_tensors
    from mlx_dsv41.quant import grouped_flat

    slices = [
        linear_tensors(
            {k: mx.array(v) for k, v in random_linear_tensors(256, out, b, "mul1", seed=60 + g, prefix="s").items()},
            "s",
        )
        for g, b in enumerate((3, 2))
    ]
    layer = EXL3GroupedLinear.from_slices(slices, 256, out)
    for mod in (ops, launch):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setattr(launch, "expert_finish", lambda: True)
    for name in ("EXPERT_DOWN", "EXPERT_DOWN_FINISH"):
        monkeypatch.setattr(launch, name, exl3_sim.launcher(getattr(launch, name)))
    o = mx.array(np.random.default_rng(9).normal(0, 2, (1, 2, 4, 128)).astype(np.float32)).astype(mx.bfloat16)
    got = grouped_flat(layer, o, 2)
    want = layer(o.reshape(1, 2, 2, 256)).reshape(1, 2, 2 * out)
    assert got.shape == (1, 2, 2 * out) and got.dtype == mx.bfloat16
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_grouped_linear_matches_each_group_alone(grouped_run):
    """Every group's output is its own linear's (the reference, bf16): only summation order differs."""
    layer, x, y, n_groups = grouped_run
    assert n_groups == 3  # K 2, 3 and 4: one down launch each
    for g in range(x.shape[1]):
        want = np.array(reference.linear(x[:, g], *layer.proj.expert(g), out_features=200).astype(mx.float32))
        assert rel_err(y[:, g], want) < 1e-3 + 2**-8
    assert np.array_equal(
        np.array(layer(x).astype(mx.float32)),  # the CPU path is the reference itself
        np.stack(
            [
                np.array(reference.linear(x[:, g], *layer.proj.expert(g), out_features=200).astype(mx.float32))
                for g in range(x.shape[1])
            ],
            axis=1,
        ),
    )


def test_the_shared_experts_finish_adds_the_routed_slots_in_slot_order():
    """exl3_expert_down_finish with ADD (the shared expert's last launch): bf16((Σ_s routed[t, s] in
    slot order) + its own bf16 output), fp32 sums as quant.combine_moe adds them; guard row kept."""
    w2 = EXL3Linear.from_stored(random_linear_tensors(384, 256, 3, seed=9, prefix="p"), "p").as_single_expert()
    T, k = 3, 6
    rng = np.random.default_rng(4)
    one = mx.zeros((T, 1), mx.int32)
    partial = mx.array(rng.normal(0, 1, (T, launch.down_plan(w2)[0], w2.n)).astype(np.float32))
    routed = mx.array(rng.normal(0, 1, (T, k, w2.n)).astype(np.float32))
    alone = launch.down_finish_args(partial, one, w2, 0, guard=1)
    added = launch.down_finish_args(partial, one, w2, 0, guard=1, out_dtype=mx.bfloat16, add=routed)
    program = exl3_sim.build([(launch.EXPERT_DOWN_FINISH, alone), (launch.EXPERT_DOWN_FINISH, added)], mma=False)
    y, combined = program.run(0)[0], program.run(1)[0].astype(np.float32)
    assert np.all(np.isnan(combined[-1])) and np.all(np.isnan(y[-1]))
    r = np.array(routed)
    acc = r[:, 0]
    for s in range(1, k):
        acc = (acc + r[:, s]).astype(np.float32)
    want = (acc + y[:-1]).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(combined[:-1], want) and np.count_nonzero(want) > want.size // 2


@pytest.mark.parametrize("mma", [True, False], ids=["mma", "fma"])
@pytest.mark.parametrize("tuning", [None, T(gate_up_warps=4, nc=8, gate_up_split_warps=8, down_split_warps=8)])
def test_the_shared_expert_in_the_routed_launches_gives_the_bytes_of_its_own_launches(tuning, mma):
    """launch.run_moe (docs/design.md#shared-in-routed): the shared expert's slots ride in the routed
    experts' last gate_up and down launches, at its own K and codebook (here 4 and mcg beside
    routed groups of K 3 / 2 mul1), and the down launch adds the slots itself. Every output is the
    bytes of the routed chain followed by the shared expert's own chain with ADD: the routed and
    shared partials and xh rows, the routed y rows, and the MoE's output; guard rows keep their
    poison. A mutation that drops a routed slot from the sum, or reads the shared slot's tiles
    from the routed stack, fails it."""
    from types import SimpleNamespace

    n_experts, hidden, inter, T_, top_k = 4, 256, 384, 3, 2
    tensors = random_experts_tensors(n_experts, hidden, inter, {"w1": (3, 2), "w3": 3, "w2": (2, 3)}, "mul1", seed=31)
    ex = EXL3Experts.from_tensors(tensors, "experts", n_experts, (1, 4), hidden, inter, swiglu_limit=7.0)
    lin = [
        EXL3Linear.from_stored(random_linear_tensors(i, o, 4, "mcg", seed=s, prefix="p"), "p")
        for i, o, s in ((hidden, inter, 41), (hidden, inter, 42), (inter, hidden, 43))
    ]
    shared = tuple(w.as_single_expert() for w in lin)
    one = SimpleNamespace(w1=shared[0], w3=shared[1], w2=shared[2], expert_range=(0, 1), swiglu_limit=7.0)
    rng = np.random.default_rng(12)
    x = mx.array(rng.normal(0, 2, (T_, hidden)).astype(np.float32)).astype(mx.bfloat16)
    indices = mx.array([[1, 3], [0, 2], [2, 1]], mx.int32)  # expert 0 is outside the held range (1, 4)
    weights = mx.array(rng.uniform(0.1, 1.0, (T_, top_k)).astype(np.float32))
    one_idx, one_w = launch.shared_routing(T_)

    routed = expert_chain(ex, x, indices, weights, tuning, finish=(mx.float32, None))
    placeholder = mx.zeros((T_, top_k, hidden), mx.float32)
    alone = expert_chain(one, x, one_idx, one_w, tuning, finish=(mx.bfloat16, placeholder))
    merged = expert_chain(ex, x, indices, weights, tuning, finish=(mx.float32, None), shared=shared)
    program = exl3_sim.build(chain_specs(routed) + chain_specs(alone) + chain_specs(merged), mma=mma)
    outs_r, spec = run_chain(program, 0, routed)
    y_r = outs_r[-1][1][:-1]
    alone[2][-1] = with_input(alone[2][-1], "add", mx.array(y_r.reshape(T_, top_k, hidden)), launch.EXPERT_DOWN)
    outs_s, spec = run_chain(program, spec, alone)
    outs_m, _ = run_chain(program, spec, merged)

    def same(a, b):
        return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))

    slots = indices.size
    n_gu = len(merged[0])
    gu_r, gu_s, gu_m = outs_r[n_gu - 1][0][:-1], outs_s[-2][0][:-1], outs_m[n_gu - 1][0][:-1]
    assert same(gu_m[:slots], gu_r) and same(gu_m[slots:], gu_s)
    xh_r, xh_s, xh_m = outs_r[n_gu - 1][1][:-1], outs_s[-2][1][:-1], outs_m[n_gu - 1][1][:-1]
    assert same(xh_m[:slots], xh_r) and same(xh_m[slots:], xh_s)
    assert_guarded(outs_m[n_gu - 1][1])
    y_m, moe_m, moe_s = outs_m[-1][1], outs_m[-1][2], outs_s[-1][1]
    assert same(y_m[:slots], y_r)
    assert same(moe_m[:-1], moe_s[:-1]) and moe_m.dtype == ml_dtypes.bfloat16
    assert_guarded(y_m)
    assert_guarded(moe_m)
    assert np.count_nonzero(moe_m[:-1].astype(np.float32)) > moe_m[:-1].size // 2


@pytest.mark.parametrize("m, splits", [(1, 3), (2, 8), (5, 5)])
def test_a_k_split_gemv_that_finishes_itself_gives_the_two_launch_bytes(monkeypatch, m, splits):
    """exl3_gemv with FINISH (CUDA's one launch for a k-split linear): the last threadgroup of each
    column block adds the splits with exl3_gemv_out's operations (exl3_finish_row), so y is the
    bytes of exl3_gemv + exl3_gemv_out; the partial sums are the same too."""
    monkeypatch.setattr(launch, "backend", lambda: "cuda")
    t = random_linear_tensors(1024, 384, 3, "mul1", seed=m, bias=True)
    trellis, suh, svh, bias = (mx.array(t[k]) for k in ("trellis", "suh", "svh", "bias"))
    x = mx.array(np.random.default_rng(m).normal(0, 1, (m, 1024)).astype(np.float32)).astype(mx.bfloat16)
    two = launch.gemv_args(x, trellis, suh, svh, "mul1", bias.astype(mx.float16), mx.bfloat16, splits=splits)
    one = launch.gemv_args(
        x,
        trellis,
        suh,
        svh,
        "mul1",
        bias.astype(mx.float16),
        mx.bfloat16,
        splits=splits,
        counters=launch.split_counters(3),
    )
    assert len(two) == 2 and len(one) == 1 and dict(one[0]["template"])["FINISH"]
    shape = two[0]["output_shapes"][0]
    two[1]["inputs"][0] = mx.zeros(shape, mx.float32)  # the partial sums' place (filled in below)
    program = exl3_sim.build([(launch.GEMV, two[0]), (launch.GEMV_OUT, two[1]), (launch.GEMV, one[0])], mma=False)
    partial = program.run(0)[0]
    y_two = program.run(1, with_input(two[1], "partial", mx.array(partial), launch.GEMV_OUT))[0]
    partial_one, y_one, _, _ = program.run(2)
    assert np.array_equal(partial_one.view(np.uint32), partial.view(np.uint32))
    assert np.array_equal(y_one.view(np.uint16), y_two.view(np.uint16))
    assert np.count_nonzero(y_one.astype(np.float32)) > y_one.size // 2


@pytest.mark.parametrize(
    "m, splits, dtype, nonfinite", [(1, 3, mx.bfloat16, False), (2, 8, mx.bfloat16, True), (5, 5, mx.float32, False)]
)
def test_a_normed_gemv_gives_the_gemv_then_rms_norm_bytes(monkeypatch, m, splits, dtype, nonfinite):
    """exl3_gemv with NORM (docs/design.md#normed-linear): the last column block to finish replaces
    y by its RMSNorm with hc_collapse_norm's operations, so y is the bytes of the k-split launch that
    finishes itself, then kernels.hyper_connections.rms_norm (hc_collapse_norm over one stream);
    rows past m keep their poison, and a NaN in a row of x makes that row NaN and leaves the others
    finite. The comparison is not blind: the norm with its weights reversed gives other bytes.
    (That the counters are 0 again is checked on the GPU: the simulator runs on copies.)"""
    from mlx_dsv41.kernels import hyper_connections as hc

    monkeypatch.setattr(launch, "backend", lambda: "cuda")
    t = random_linear_tensors(1024, 384, 3, "mul1", seed=20 + m, bias=False)
    trellis, suh, svh = (mx.array(t[k]) for k in ("trellis", "suh", "svh"))
    rng = np.random.default_rng(m)
    xs = rng.normal(0, 1, (m, 1024)).astype(np.float32)
    if nonfinite:
        xs[1, 17] = np.nan
    x = mx.array(xs).astype(dtype)
    weight = mx.array(rng.normal(1, 0.5, 384).astype(np.float32)).astype(mx.bfloat16)
    eps = 1e-6
    plain = launch.gemv_args(
        x, trellis, suh, svh, "mul1", None, dtype, splits=splits, counters=launch.split_counters(3)
    )
    normed = launch.gemv_args(
        x,
        trellis,
        suh,
        svh,
        "mul1",
        None,
        dtype,
        splits=splits,
        counters=launch.split_counters(4),
        guard_rows=2,
        norm=(weight, eps),
    )
    assert dict(normed[0]["template"])["NORM"] and len(normed) == 1
    y_plain = mx.zeros((m, 384), dtype)
    norm = hc.collapse_norm_args(y_plain, mx.ones((m, 1)), weight, eps, hc=1)
    program = exl3_sim.build([(launch.GEMV, plain[0]), (hc.COLLAPSE_NORM, norm), (launch.GEMV, normed[0])], mma=False)
    y = program.run(0)[1]
    call = dict(norm, inputs=[mx.array(y.astype(np.float32)).astype(dtype), *norm["inputs"][1:]])
    (want,) = program.run(1, call)
    _, got, _, _ = program.run(2)
    view = np.uint16 if dtype == mx.bfloat16 else np.uint32
    assert np.array_equal(got[:m].view(view), want.view(view))
    assert np.all(np.isnan(got[m:].astype(np.float32)))  # guard rows untouched
    finite = np.isfinite(got[:m].astype(np.float32)).all(axis=1)
    assert list(finite) == [not (nonfinite and r == 1) for r in range(m)]
    swapped = dict(norm, inputs=[call["inputs"][0], norm["inputs"][1], weight[::-1]])
    (other,) = program.run(1, swapped)
    assert not np.array_equal(got[:m].view(view), other.view(view))


def test_where_the_shared_expert_rides_in_the_routed_launches(monkeypatch):
    """exl3.ops.shared_fits, the choice quant.fused_moe makes (docs/design.md#shared-in-routed):
    only where the expert launches finish themselves (a GPU backend with grid finish, here
    pretended), Tuning.shared_in_routed is on, the tokens fit the fused kernels, and the shared
    expert's three EXL3 linears have the routed experts' shapes and SwiGLU limit."""
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.quant import fused_moe

    tensors = random_experts_tensors(3, 256, 384, 3, seed=5)
    ex = EXL3Experts.from_tensors(tensors, "experts", 3, None, 256, 384, swiglu_limit=7.0)

    def linears(inter):
        dims = ((256, inter, 1), (256, inter, 2), (inter, 256, 3))
        return [EXL3Linear.from_stored(random_linear_tensors(i, o, 4, seed=s, prefix="p"), "p") for i, o, s in dims]

    fits, narrow = linears(384), linears(256)
    x = mx.zeros((2, 256), mx.bfloat16)
    assert not ops.shared_fits(ex, *fits, 7.0, 2, x.dtype)  # the CPU: computed apart
    assert fused_moe(ex, *fits, 7.0, x, mx.zeros((2, 2), mx.int32), mx.ones((2, 2))) is None
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    monkeypatch.setattr(launch, "expert_finish", lambda tuning=None: True)
    assert ops.shared_fits(ex, *fits, 7.0, 2, x.dtype)
    assert not ops.shared_fits(ex, *fits, 10.0, 2, x.dtype)  # another SwiGLU limit
    assert not ops.shared_fits(ex, *narrow, 7.0, 2, x.dtype)  # another intermediate size
    assert not ops.shared_fits(ex, *fits, 7.0, ops.FUSED_MAX_TOKENS + 1, x.dtype)  # a prefill
    assert not ops.shared_fits(ex, *fits, 7.0, 2, mx.float16)
    monkeypatch.setattr(launch, "TUNING", launch.Tuning(shared_in_routed=0))
    assert not ops.shared_fits(ex, *fits, 7.0, 2, x.dtype)


@pytest.mark.parametrize("k", [256, 4096])
def test_a_linear_writes_its_output_in_the_shape_asked_for(k, monkeypatch):
    """EXL3Linear.into (quant.linear_into: the queries' heads [B, S, H, D]) on the GPU path on the
    simulator (k 256: one fused launch; 4096: k split, the launch finishing itself): the output in
    that shape, the bytes of the plain call, and no reshape where the kernel writes it so."""
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.exl3.stored import linear_tensors
    from mlx_dsv41.quant import linear_into

    t = random_linear_tensors(k, 384, 3, "mul1", seed=k, prefix="w")
    layer = EXL3Linear.from_stored({key: mx.array(v) for key, v in t.items()}, "w")
    assert linear_tensors({key: mx.array(v) for key, v in t.items()}, "w")["codebook"] == "mul1"
    for mod in (ops, launch):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    for name in ("GEMV", "GEMV_OUT"):
        monkeypatch.setattr(launch, name, exl3_sim.launcher(getattr(launch, name)))
    x = mx.array(np.random.default_rng(k).normal(0, 1, (1, 2, k)).astype(np.float32)).astype(mx.bfloat16)
    heads = linear_into(layer, x, (1, 2, 4, 96))
    plain = layer(x)
    assert heads.shape == (1, 2, 4, 96) and plain.shape == (1, 2, 384)
    assert np.array_equal(np.array(heads.view(mx.uint16)).reshape(1, 2, 384), np.array(plain.view(mx.uint16)))
    calls = launch.gemv_args(x, layer.trellis, layer.suh, layer.svh, "mul1", out_shape=(1, 2, 4, 96))
    assert (1, 2, 4, 96) in [shape for call in calls for shape in call["output_shapes"]]


@pytest.mark.parametrize(
    "m, n2, norm, dtype", [(1, 128, True, mx.float32), (2, 384, False, mx.bfloat16), (5, 256, True, mx.float32)]
)
def test_two_linears_of_one_input_in_one_gemv_give_their_own_launches_bytes(monkeypatch, m, n2, norm, dtype):
    """exl3_gemv with PAIR (docs/design.md#paired-linears; Flash's wq_a and wkv): column blocks past
    the first linear's are a second linear's of the same x, each with its own launch's k split, so
    y and y2 are the bytes of each linear's own k-split launch that finishes itself (y normed as
    NORM norms it, where asked); rows past m keep their poison. With a small split target the
    plans differ where n2 is 128 (8 splits of one 128-block against the first's 4 of two), so the
    grid has 8 and the first linear's threadgroups past its 4 return at once. float32 outputs show
    a changed order of sums that bf16 would round away (a pair taking the first's plan for both fails
    the first case)."""
    monkeypatch.setattr(launch, "backend", lambda: "cuda")
    tuning = launch.Tuning(dense_split_warps=96)
    ts = [random_linear_tensors(1024, n, 3, "mul1", seed=50 + m + n + i) for i, n in enumerate((384, n2))]
    (t1, s1, v1), (t2, s2, v2) = [[mx.array(t[k]) for k in ("trellis", "suh", "svh")] for t in ts]
    rng = np.random.default_rng(m)
    x = mx.array(rng.normal(0, 1, (m, 1024)).astype(np.float32)).astype(dtype)
    weight = mx.array(rng.normal(1, 0.5, 384).astype(np.float32))
    nrm = (weight, 1e-6) if norm else None
    common = dict(tuning=tuning, counters=launch.split_counters((384 + n2) // 128 + 1))
    one = launch.gemv_args(
        x, t1, s1, v1, "mul1", None, dtype, guard_rows=2, norm=nrm, pair=(t2, s2, v2, "mul1"), **common
    )
    apart = [
        launch.gemv_args(x, t1, s1, v1, "mul1", None, dtype, norm=nrm, **common),
        launch.gemv_args(x, t2, s2, v2, "mul1", None, dtype, **common),
    ]
    plans = [dict(a[0]["template"])["PER_SPLIT"] for a in apart]
    assert dict(one[0]["template"])["PAIR"] == 3 and len(one) == 1 and (plans[0] != plans[1]) == (n2 == 128)
    program = exl3_sim.build([(launch.GEMV, one[0]), (launch.GEMV, apart[0][0]), (launch.GEMV, apart[1][0])], mma=False)
    partial, y, y2, _ = program.run(0)
    want, want2 = program.run(1)[1], program.run(2)[1]
    view = np.uint16 if dtype == mx.bfloat16 else np.uint32
    assert np.array_equal(y[:m].view(view), want.view(view)) and np.array_equal(y2[:m].view(view), want2.view(view))
    assert np.all(np.isnan(y[m:].astype(np.float32))) and np.all(np.isnan(y2[m:].astype(np.float32)))
    splits = max(a[0]["grid"][1] for a in apart)
    assert partial.shape == (splits + 2, m, 384 + n2) and np.all(np.isnan(partial[splits:]))
    assert np.count_nonzero(y2[:m].astype(np.float32)) > y2[:m].size // 2


def test_a_paired_gemv_refuses_linears_that_differ(monkeypatch):
    """PAIR only for linears whose own launches it can hold side by side (paired_gemv_fits and
    gemv_args agree): other bits, codebook, k, a bias, more than 8 rows, a k left unsplit or the
    tuning's switch off are refused."""
    monkeypatch.setattr(launch, "backend", lambda: "cuda")

    def arrays(k, n, bits=3, codebook="mul1"):
        t = random_linear_tensors(k, n, bits, codebook, seed=k + n + bits)
        return mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"]), codebook, None

    x = mx.zeros((1, 1024), mx.bfloat16)
    first = arrays(1024, 384)
    assert launch.paired_gemv_fits(x, first, arrays(1024, 256))
    bias = mx.zeros((384,), mx.float16)
    others = [
        arrays(1024, 256, bits=4),
        arrays(1024, 256, codebook="mcg"),
        arrays(512, 256),
        arrays(1024, 256)[:4] + (bias[:256],),
    ]
    for second in others:
        assert not launch.paired_gemv_fits(x, first, second)
        with pytest.raises(ValueError, match="PAIR"):
            launch.gemv_args(x, *first[:4], second[4], counters=launch.split_counters(8), pair=second[:4])
    assert not launch.paired_gemv_fits(mx.zeros((9, 1024), mx.bfloat16), first, arrays(1024, 256))
    assert not launch.paired_gemv_fits(x, first, arrays(1024, 256), launch.Tuning(paired_gemv=0))
    assert not launch.paired_gemv_fits(x, first, arrays(1024, 256), launch.Tuning(dense_single_blocks=3))  # k unsplit


def test_a_linear_and_its_norm_take_one_launch_only_where_the_gemv_can_norm(monkeypatch):
    """quant.normed_linear (docs/design.md#normed-linear): on the CPU norm(linear(x)), the bytes of
    the two calls; on a GPU with grid finish one exl3_gemv launch with NORM for a k-split linear of
    at most 8 rows, and the two launches (exl3_gemv, hc_collapse_norm) where the plan does not split
    k, the rows do not fit, the tuning turns FINISH or NORM off or the outputs are padded."""
    import mlx_dsv41.kernels as kernels
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.kernels import grid_finish
    from mlx_dsv41.kernels import hyper_connections as hc
    from mlx_dsv41.model.norm import RMSNorm
    from mlx_dsv41.quant import normed_linear

    def make(out_f, seed):
        lin = EXL3Linear.from_stored(random_linear_tensors(1024, out_f, 3, "mul1", seed=seed, prefix="p"), "p")
        norm = RMSNorm(out_f, 1e-6)
        norm.weight = mx.array(np.random.default_rng(seed).normal(1, 0.5, out_f).astype(np.float32))
        return lin, norm

    lin, norm = make(384, 1)
    x = mx.array(np.random.default_rng(2).normal(0, 1, (2, 1024)).astype(np.float32)).astype(mx.bfloat16)
    assert np.array_equal(np.array(normed_linear(lin, norm, x).view(mx.uint16)), np.array(norm(lin(x)).view(mx.uint16)))
    seen = []

    def record(self, **call):
        seen.append((self.name, dict(call.get("template", ())).get("NORM")))
        return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

    monkeypatch.setattr(kernels.Kernel, "__call__", record)
    for module in (ops, launch, hc):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setitem(grid_finish.GRID_FINISH, "cuda", True)
    padded = EXL3Linear.from_stored(random_linear_tensors(1024, 300, 3, "mul1", seed=4, prefix="p"), "p", 1024, 300)
    padded_norm = RMSNorm(300, 1e-6)
    cases = [
        (lin, norm, x, None, [("exl3_gemv", True)]),
        (lin, norm, mx.zeros((9, 1024), mx.bfloat16), None, None),  # 9 rows: the many-row path
        (lin, norm, x, launch.Tuning(finish_splits=0), [("exl3_gemv", False), ("exl3_gemv_out", None)]),
        (lin, norm, x, launch.Tuning(normed_gemv=0), [("exl3_gemv", False)]),  # the A/B switch
        (lin, norm, x, launch.Tuning(dense_single_blocks=2), [("exl3_gemv", False)]),  # k not split
        (padded, padded_norm, x, None, [("exl3_gemv", False)]),
    ]
    for linear, rms, rows, tuning, gemv in cases:
        seen.clear()
        if tuning is not None:
            monkeypatch.setattr(launch, "TUNING", tuning)
        y = normed_linear(linear, rms, rows)
        monkeypatch.setattr(launch, "TUNING", launch.Tuning())
        assert y.shape == (*rows.shape[:-1], rms.weight.shape[0]) and y.dtype == rows.dtype
        if gemv is None:
            assert ("hc_collapse_norm", None) in seen and ("exl3_gemv", True) not in seen
        else:
            assert seen == gemv + ([] if gemv[0][1] else [("hc_collapse_norm", None)])


def test_two_linears_of_one_input_take_one_launch_only_where_the_gemv_can_pair(monkeypatch):
    """quant.paired_linears (docs/design.md#paired-linears): on the CPU (norm(first(x)), second(x)),
    the bytes of the separate calls; on a GPU with grid finish one exl3_gemv launch with PAIR (and
    NORM for the first's norm; with NORM tuned off the pair, then hc_collapse_norm); apart where
    the formats differ or the linears do not pair."""
    import mlx_dsv41.kernels as kernels
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.kernels import grid_finish
    from mlx_dsv41.kernels import hyper_connections as hc
    from mlx_dsv41.model.norm import RMSNorm
    from mlx_dsv41.quant import DenseLinear, paired_linears

    def make(out_f, seed, bits=3):
        return EXL3Linear.from_stored(random_linear_tensors(1024, out_f, bits, "mul1", seed=seed, prefix="p"), "p")

    first, second, norm = make(384, 1), make(256, 2), RMSNorm(384, 1e-6)
    norm.weight = mx.array(np.random.default_rng(3).normal(1, 0.5, 384).astype(np.float32))
    x = mx.array(np.random.default_rng(4).normal(0, 1, (2, 1024)).astype(np.float32)).astype(mx.bfloat16)
    y, y2 = paired_linears(first, second, x, norm)
    bits = lambda a: np.array(a.view(mx.uint16))  # noqa: E731
    assert np.array_equal(bits(y), bits(norm(first(x)))) and np.array_equal(bits(y2), bits(second(x)))
    seen = []

    def record(self, **call):
        t = dict(call.get("template", ()))
        seen.append((self.name, t.get("PAIR"), t.get("NORM")))
        return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

    monkeypatch.setattr(kernels.Kernel, "__call__", record)
    for module in (ops, launch, hc):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setitem(grid_finish.GRID_FINISH, "cuda", True)
    dense = DenseLinear(1024, 256)
    cases = [
        (second, norm, None, [("exl3_gemv", 3, True)]),
        (second, None, None, [("exl3_gemv", 3, False)]),
        (second, norm, launch.Tuning(normed_gemv=0), [("exl3_gemv", 3, False), ("hc_collapse_norm", None, None)]),
        (second, norm, launch.Tuning(paired_gemv=0), [("exl3_gemv", 0, True), ("exl3_gemv", 0, False)]),
        (make(256, 5, bits=4), norm, None, [("exl3_gemv", 0, True), ("exl3_gemv", 0, False)]),
        (dense, norm, None, [("exl3_gemv", 0, True)]),  # then MLX's matmul
    ]
    for other, rms, tuning, want in cases:
        seen.clear()
        monkeypatch.setattr(launch, "TUNING", tuning or launch.Tuning())
        y, y2 = paired_linears(first, other, x, rms)
        assert seen == want and y.shape == (2, 384) and y2.shape == (2, 256)


def test_the_moe_reads_and_writes_the_model_s_rows_as_they_are(monkeypatch):
    """model/moe.py's MoE on the GPU path (the router's moe_gate, then the routed experts' launches
    with the shared expert in them: docs/design.md#shared-in-routed), all on the simulator: x [B, S,
    D] goes to the kernels as it is and the output comes back as [B, S, D] (no reshape node either
    way), with the bytes of the same launches on the flattened rows [T, D]; the CPU path's bytes
    (the model's reference) within the shared expert's own rounding of them is not asked here,
    tests/gpu/test_model_gpu.py holds the GPU model."""
    import mlx_dsv41.kernels as kernels
    from mlx_dsv41.exl3 import ops
    from mlx_dsv41.kernels import fp32_linear, grid_finish
    from mlx_dsv41.kernels import moe_route as mr
    from mlx_dsv41.model.moe import MoE
    from mlx_dsv41.synthetic import tiny_args

    args = tiny_args(hidden_size=256, moe_intermediate_size=384, n_routed_experts=4, num_experts_per_tok=2)
    moe = MoE(args)
    moe.experts = EXL3Experts.from_tensors(
        random_experts_tensors(4, 256, 384, {"w1": 3, "w3": 3, "w2": 3}, "mul1", seed=7),
        "experts",
        4,
        None,
        256,
        384,
        swiglu_limit=args.swiglu_limit,
    )
    for i, name in enumerate(("w1", "w3", "w2")):
        i_f, o_f = (384, 256) if name == "w2" else (256, 384)
        setattr(
            moe.shared_experts,
            name,
            EXL3Linear.from_stored(random_linear_tensors(i_f, o_f, 3, seed=20 + i, prefix="p"), "p"),
        )
    mx.eval(moe.parameters())
    for module in (ops, launch, mr, fp32_linear):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setitem(grid_finish.GRID_FINISH, "cuda", True)
    sims, seen = {}, []

    def run_on_sim(self, **call):
        seen.append((self.name, tuple(tuple(a.shape) for a in call["inputs"][:1]), tuple(call["output_shapes"][-1])))
        sims.setdefault(self.name, {})
        key = repr(exl3_sim._signature(self, call))
        if key not in sims[self.name]:
            sims[self.name][key] = exl3_sim.build([(self, call)], mma=True)
        outs = sims[self.name][key].run(0, call)
        return [
            mx.array(o.view(np.uint16)).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o)
            for o, d in zip(outs, call["output_dtypes"])
        ]

    monkeypatch.setattr(kernels.Kernel, "__call__", run_on_sim)
    x = mx.array(np.random.default_rng(3).normal(0, 1, (2, 3, 256)).astype(np.float32)).astype(mx.bfloat16)
    y = moe(x)
    names = [s[0] for s in seen]
    assert y.shape == (2, 3, 256) and "moe_gate" in names and "exl3_expert_down" in names
    assert all(s[1] == ((2, 3, 256),) for s in seen if s[0] in ("moe_gate", "exl3_expert_gate_up"))
    assert seen[-1][2] == (2, 3, 256)  # the MoE's output, written in x's shape
    flat_indices, flat_weights = moe.gate(x.reshape(6, 256))
    want = launch.run_moe(
        x.reshape(6, 256),
        flat_indices,
        flat_weights,
        moe.experts.w1,
        moe.experts.w3,
        moe.experts.w2,
        0,
        moe.experts.swiglu_limit,
        tuple(w.as_single_expert() for w in (moe.shared_experts.w1, moe.shared_experts.w3, moe.shared_experts.w2)),
    )
    assert want.shape == (6, 256)
    assert np.array_equal(np.array(y.view(mx.uint16)).reshape(6, 256), np.array(want.view(mx.uint16)))
    assert np.count_nonzero(np.array(y.astype(mx.float32))) > y.size // 2
