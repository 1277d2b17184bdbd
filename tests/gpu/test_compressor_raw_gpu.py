"""compressor_raw on the GPU (docs/design.md#compressor-raw), with the kernel contract, at Flash's
compressor shapes (5,120 inputs, 512 outputs, a raw ring of 32 + 1 rows):
- the open group's rows and the new rings are the bytes of the launches it replaces: fp32_gemv's
  projections (fp32_linear.linear, bf16 and fp32 weights), then LayerCache.group_inputs (the gather,
  concatenation and dynamic slice updates), at both phases of ratio 2, all four of ratio 4, batch 2
  and several new rows; likewise for rows given as they are (another format's projections);
- the projections within fp32 rounding of float64, NaN / inf where float64 puts them;
- outputs poisoned (NaN) before launch, guard rows untouched, five repeats byte-identical, the
  launch limit declared;
- a Compressor, with dense (bf16) and with EXL3 weights, decodes several whole groups with the same
  latents and rings as with the launches apart."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.cache import LayerCache, make_layer_cache
from mlx_dsv41.kernels import compressor_raw as cr
from mlx_dsv41.kernels import fp32_linear as fl
from mlx_dsv41.model.compressor import Compressor
from mlx_dsv41.quant import DenseLinear

pytestmark = pytest.mark.gpu
K, N, SLACK = 5120, 512, 32


def _data(seed, ratio, pending, B, S, w_dtype=mx.bfloat16, given=False):
    rng = np.random.default_rng(seed)
    Q = SLACK + ratio - 1
    d = dict(position=mx.array(1000 * ratio + pending, mx.int32), pending=pending)
    d["raw_kv"], d["raw_gate"] = (mx.array(rng.standard_normal((B, Q, N)).astype(np.float32)) for _ in range(2))
    if given:
        d["kv"], d["gate"] = (mx.array(rng.standard_normal((B, S, N)).astype(np.float32)) for _ in range(2))
    else:
        d["x"] = mx.array(rng.standard_normal((B, S, K)).astype(np.float32)).astype(mx.bfloat16)
        d["wkv"], d["wgate"] = (
            (mx.random.normal((N, K), key=mx.random.key(seed + j)) * K**-0.5).astype(w_dtype) for j in range(2)
        )
    return d


def _launch(d, **kw):
    names = ("x", "wkv", "wgate", "kv", "gate")
    call = cr.args(d["position"], d["pending"], d["raw_kv"], d["raw_gate"], *(d.get(n) for n in names), **kw)
    return [None if o is None else np.array(o) for o in cr.KERNEL(**call)]


def _reference(ratio, d):
    """fp32_gemv's projections (or the given rows), then LayerCache.group_inputs, on the GPU."""
    if "x" in d:
        kv, gate = (fl.linear(d["x"], d[w]) for w in ("wkv", "wgate"))
    else:
        kv, gate = d["kv"], d["gate"]
    cache = LayerCache(128, ratio, True, SLACK)
    cache.offset, cache.raw_kv, cache.raw_gate = int(d["position"].item()), d["raw_kv"], d["raw_gate"]
    cache.bind(d["position"])
    rows = cache.group_inputs(kv, gate)
    return [np.array(a) for a in (*rows, cache.raw_kv, cache.raw_gate)]


CASES = [  # ratio, pending, B, S, w dtype, given rows
    *[(2, p, 1, 1, mx.bfloat16, False) for p in range(2)],
    *[(4, p, 2, 1, mx.bfloat16, False) for p in range(4)],
    (2, 1, 2, 3, mx.float32, False),
    (2, 0, 1, 8, mx.bfloat16, False),
    *[(2, p, 1, 1, None, True) for p in range(2)],
    (4, 3, 2, 2, None, True),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_launch_gives_the_bytes_of_the_launches_it_replaces(i):
    ratio, pending, B, S, w_dtype, given = CASES[i]
    d = _data(i, ratio, pending, B, S, w_dtype, given)
    got = cr.open_group(
        d["position"],
        pending,
        d["raw_kv"],
        d["raw_gate"],
        **{k: d[k] for k in d if k in ("x", "wkv", "wgate", "kv", "gate")},
    )
    assert got is not None
    ref = _reference(ratio, d)
    for g, r in zip(got, ref):
        assert np.array(g).tobytes() == r.tobytes()
    if not given:
        x64 = np.array(d["x"].astype(mx.float32), np.float64)
        for w, rows in ((d["wkv"], ref[0]), (d["wgate"], ref[1])):
            want = x64 @ np.array(w.astype(mx.float32), np.float64).T
            assert np.abs(rows[:, pending:] - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("given", [False, True])
def test_contract_poison_guards_repeats_and_limit(given):
    d = _data(20, 2, 1, 2, 3, given=given)
    runs = [_launch(d, init_value=float("nan"), guard=2) for _ in range(5)]
    for run in runs:
        for o, o0 in zip(run, runs[0]):
            assert np.array_equal(o.view(np.uint32), o0.view(np.uint32))
    for o in runs[0]:
        assert np.all(np.isnan(o[-2:])) and not np.any(np.isnan(o[:-2]))  # guard rows keep the poison
    call = cr.args(
        d["position"], 1, d["raw_kv"], d["raw_gate"], *(d.get(n) for n in ("x", "wkv", "wgate", "kv", "gate"))
    )
    with pytest.raises(ValueError, match="declared limit"):
        cr.KERNEL(**dict(call, threadgroup=(512, 1, 1)))


def test_nonfinite_inputs_follow_float64():
    d = _data(21, 2, 0, 1, 8)
    raw = np.array(d["x"].astype(mx.float32))
    raw[0, 1, 5], raw[0, 3, 700], raw[0, 6, 4000] = np.nan, np.inf, -np.inf
    d["x"] = mx.array(raw)
    rows = _launch(d)[0][0]
    with np.errstate(all="ignore"):
        want = np.array(d["x"], np.float64)[0] @ np.array(d["wkv"].astype(mx.float32), np.float64).T
    assert np.array_equal(np.isnan(rows), np.isnan(want)) and np.array_equal(np.isposinf(rows), np.isposinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(rows[finite], want[finite], rtol=0, atol=1e-4)


def _decode(comp, args):
    """Latents and the kv ring after each of several chunks (every phase, whole groups), batch 2."""
    cache, rng, out = make_layer_cache(args, 1), np.random.default_rng(5), []
    for S in [3, 1, 1, 1, 2, 1, 1, 3, 1, 1]:
        x = mx.array(rng.standard_normal((2, S, args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
        cache.bind(mx.array(cache.offset, mx.int32))
        latent, _ = comp(x, cache)
        cache.advance(S)
        out.append([None if latent is None else np.array(latent.astype(mx.float32)), np.array(cache.raw_kv)])
    return out


def _same(one, apart):
    for a, b in zip(one, apart):
        assert (a[0] is None) == (b[0] is None)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b) if x is not None)


def test_a_compressor_decodes_with_the_bytes_of_the_launches_apart(monkeypatch):
    from attention_stack import tiny_args

    args = tiny_args(hidden_size=K, head_dim=N)
    comp = Compressor(args, 1)
    for j, name in enumerate(("wkv", "wgate")):
        lin = DenseLinear(K, N, bias=False)
        lin.update({"weight": (mx.random.normal((N, K), key=mx.random.key(j)) * K**-0.5).astype(mx.bfloat16)})
        setattr(comp, name, lin)
    one = _decode(comp, args)
    monkeypatch.setattr(cr, "backend", lambda: "cpu")  # the compressor's launches apart
    _same(one, _decode(comp, args))


def test_an_exl3_compressor_decodes_with_the_bytes_of_the_launches_apart(monkeypatch):
    """Flash's compressor (EXL3, K = 5): the paired exl3_gemv from bf16 x with fp32 outputs and the
    given-rows launch, against the cast, the two GEMVs and group_inputs' launches."""
    from attention_stack import tiny_args

    from mlx_dsv41.exl3 import EXL3Linear
    from mlx_dsv41.exl3.synthetic import random_linear_tensors
    from mlx_dsv41.kernels import exl3 as launch

    args = tiny_args(hidden_size=K, head_dim=N)
    comp = Compressor(args, 1)
    for j, name in enumerate(("wkv", "wgate")):
        setattr(comp, name, EXL3Linear.from_stored(random_linear_tensors(K, N, 5, "mul1", seed=j, prefix="p"), "p"))
    one = _decode(comp, args)
    monkeypatch.setattr(cr, "backend", lambda: "cpu")
    monkeypatch.setattr(launch, "TUNING", launch.Tuning(paired_gemv=0))
    _same(one, _decode(comp, args))
