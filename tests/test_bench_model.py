"""benchmarks/bench_model.py's DSpark costs (issue 18 item 6) and flash_model.py's DSpark head, on
the CPU in seconds: the demo run end to end (--cpu --dspark-only, one repeat), the on-paper
formula, and the Flash-shaped builder's DSpark formats at small dimensions."""

from __future__ import annotations

import itertools
import json
import sys
import types

import mlx.core as mx
import pytest
from demo_helpers import REPO, cache_dir, demo_checkpoint

from mlx_dsv41.demo import CACHE_ENV
from mlx_dsv41.exl3 import EXL3Linear
from mlx_dsv41.exl3.experts import EXL3Experts, EXL3GroupedLinear
from mlx_dsv41.speculative import SpeculativeDecoder

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_distributed  # noqa: E402
import bench_model  # noqa: E402
import flash_model  # noqa: E402

# bench_distributed.py's --smoke dimensions (the expert count is each test's), with a noise id in its vocabulary
SMALL = {k: v for k, v in bench_distributed.SMOKE.items() if k != "n_routed_experts"} | {"dspark_noise_token_id": 500}


@pytest.fixture(autouse=True)
def cpu():
    with mx.stream(mx.cpu):
        yield


def test_demo_dspark_costs(tmp_path, tmp_path_factory, monkeypatch, capsys):
    demo_checkpoint(tmp_path_factory)
    monkeypatch.setenv(CACHE_ENV, str(cache_dir(tmp_path_factory)))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_model.py",
            "--cpu",
            "--dspark-only",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--prompt",
            "12",
            "--out",
            str(tmp_path),
        ],
    )
    assert bench_model.main() == 0
    out = json.loads((tmp_path / "bench_model.json").read_text())
    (run,) = out["runs"]
    d = run["dspark"]
    assert "decode" not in run and d["block_size"] == 5 and d["position"] == 12
    assert [v["k"] for v in d["verify"]] == list(range(6)) and d["verify"][0]["ms"] > 0
    assert all(v["ratio"] == pytest.approx(v["ms"] / d["step"]["ms"]) for v in d["verify"])
    assert [r["ring_rows"] for r in d["draft"]] == [1, 6]
    assert d["targets"]["draft_pct_of_step"] == pytest.approx(100 * d["draft"][1]["ms"] / d["step"]["ms"])
    assert [p["k"] for p in d["paper"]] == [1, 2, 3, 4, 5]
    p4 = d["paper"][3]
    assert p4["tokens_per_round"] == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3 + 0.8**4)
    round_ms = d["verify"][4]["ms"] + d["draft"][1]["ms"]
    assert p4["round_ms"] == pytest.approx(round_ms) and p4["tokens_per_s"] == pytest.approx(1e3 * 3.3616 / round_ms)
    assert [r["position"] for r in d["steps"]] == [12, 13] and d["steps"][0]["cuda"] is None  # none on the CPU
    assert d["step"]["ms"] == pytest.approx((d["steps"][0]["ms"] + d["steps"][1]["ms"]) / 2)
    text = capsys.readouterr().out
    assert "| verify 1 + 4 |" in text and "On paper at 80 %" in text and text.count("| draft block of 5") == 2


@pytest.mark.parametrize("k, a", [(1, 0.8), (4, 0.8), (5, 0.5), (3, 0.0), (4, 1.0)])
def test_accepted_per_round(k, a):
    """The chain rule: n drafts accepted with probability a^n (1 - a) (n < k) or a^k, and the
    round emits n + 1 tokens; enumerated over every accept/reject pattern."""
    expected = 0.0
    for pattern in itertools.product((True, False), repeat=k):
        prob = 1.0
        for ok in pattern:
            prob *= a if ok else 1 - a
        n = next((j for j, ok in enumerate(pattern) if not ok), k)
        expected += prob * (n + 1)
    assert bench_model.accepted_per_round(k, a) == pytest.approx(expected)


def test_flash_dspark_config():
    args = flash_model.flash_args(40, dspark=True)
    assert (args.dspark_stages, args.dspark_block_size, args.dspark_noise_token_id) == (3, 5, 128799)
    assert args.dspark_target_layer_ids == (37, 38, 39) and args.dspark_markov_rank == 256
    stage = args.dspark_stage_args()
    assert (stage.n_routed_experts, stage.num_experts_per_tok) == (16, 3)
    assert flash_model.flash_args(3, dspark=True).dspark_target_layer_ids == (0, 1, 2)
    small = flash_model.flash_args(8, dspark=True)
    assert small.dspark_target_layer_ids == (5, 6, 7) and small.compress_ratios[8:] == (0, 0, 0)
    assert flash_model.flash_args(8).dspark_stages == 0  # without dspark: no head, as before


def test_flash_dspark_build_formats():
    """The builder's DSpark head at small dimensions: every quantized mtp linear EXL3 at K = 4, the
    markov / confidence heads native fp32, and a speculative round runs."""
    args = flash_model.flash_args(4, experts=8, dspark=True, **SMALL)
    model = flash_model.build(args, seed=1)
    assert len(model.mtp) == 3
    for name, module in model.named_modules():
        if not name.startswith("mtp."):
            continue
        if isinstance(module, EXL3Linear):
            assert module.trellis.shape[-1] == 16 * flash_model.MTP_BITS, name
        elif isinstance(module, EXL3Experts):
            assert module.n_experts == 8 and module.expert_range == (0, 8)
    last, first = model.mtp[-1], model.mtp[0]
    assert isinstance(first.main_proj, EXL3Linear) and isinstance(first.attn.wo_a, EXL3GroupedLinear)
    assert isinstance(first.ffn.experts, EXL3Experts) and isinstance(first.ffn.shared_experts.w2, EXL3Linear)
    assert last.markov_head.head.weight.dtype == mx.float32 and last.confidence_head.proj.weight.dtype == mx.float32
    assert last.markov_head.embed.weight.dtype == mx.bfloat16
    dec = SpeculativeDecoder(model, draft=4)
    dec.prefill([5, 9, 33, 7, 100, 3])
    tokens = dec.round()
    assert 1 <= len(tokens) <= 5 and dec.cache[0].offset == 6 + len(tokens)


def test_a_verify_size_beyond_the_block_is_refused():
    model = types.SimpleNamespace(args=types.SimpleNamespace(dspark_block_size=5))
    with pytest.raises(SystemExit, match=r"--verify-k \[4, 9\]: a verify checks 0 \.\. 5 drafts"):
        bench_model.dspark_costs(model, None, 1, 0, 0.8, [4, 9])
