"""benchmarks/bench_model.py's DSpark costs (issue 18 item 6) and flash_model.py's DSpark head, on
the CPU in seconds: the demo run end to end (--cpu --dspark-only, one repeat), the on-paper
formula, and the Flash-shaped builder's DSpark formats at small dimensions. Its prefill mode
(issue 17 item 1): a demo run beside mlx-lm with the parts profile, the chunked prefill it times
giving the one-pass logits, and sizes that do not fit."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import types

import mlx.core as mx
import numpy as np
import pytest
from demo_helpers import REPO, cache_dir, demo_checkpoint

import mlx_dsv41
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
    markov / confidence heads native bf16, and a speculative round runs."""
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
    # native bf16, as stored: an fp32 linear widens it where used (docs/numerics.md#fp32-linears)
    assert last.markov_head.head.weight.dtype == mx.bfloat16 and last.confidence_head.proj.weight.dtype == mx.bfloat16
    assert last.markov_head.embed.weight.dtype == mx.bfloat16
    dec = SpeculativeDecoder(model, draft=4)
    dec.prefill([5, 9, 33, 7, 100, 3])
    tokens = dec.round()
    assert 1 <= len(tokens) <= 5 and dec.cache[0].offset == 6 + len(tokens)


def test_a_verify_size_beyond_the_block_is_refused():
    model = types.SimpleNamespace(args=types.SimpleNamespace(dspark_block_size=5))
    with pytest.raises(SystemExit, match=r"--verify-k \[4, 9\]: a verify checks 0 \.\. 5 drafts"):
        bench_model.dspark_costs(model, None, 1, 0, 0.8, [4, 9])


# ---------------------------------------------------------------- prefill (issue 17 item 1)


def test_demo_prefill_beside_mlx_lm_with_parts(tmp_path, tmp_path_factory, monkeypatch, capsys):
    demo_checkpoint(tmp_path_factory)
    monkeypatch.setenv(CACHE_ENV, str(cache_dir(tmp_path_factory)))
    argv = "--cpu --prefill 12 20 --prefill-chunk 8 --repeats 1 --prefill-parts 12 --out".split()
    monkeypatch.setattr(sys, "argv", ["bench_model.py", *argv, str(tmp_path)])
    originals = [(owner, name, vars(owner)[name]) for _, owner, name in bench_model.part_targets()]
    assert bench_model.main() == 0
    out = json.loads((tmp_path / "bench_model_prefill.json").read_text())
    rows = out["rows"]
    assert [(r["label"].split()[0], r["tokens"], r["chunk"]) for r in rows] == [
        ("mlx_dsv41", 12, 8),
        ("mlx-lm", 12, 8),
        ("mlx_dsv41", 20, 8),
        ("mlx-lm", 20, 8),
    ]
    for r in rows:
        assert 0 < r["prefill_s"] < r["ttft_s"] and r["ttft_min_s"] <= r["ttft_s"] and r["repeats"] == 1
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["ttft_s"]) and r["peak_GB"] > 0
    assert all(r["first_run_s"] > 0 for r in rows)  # each size's first pass, left out of the medians
    for ours, theirs in (rows[0:2], rows[2:4]):
        assert theirs["ours_over_mlx_lm"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    parts = out["parts"]
    assert parts["tokens"] == 12 and parts["chunk"] == 8 and parts["cuda"] is None  # no CUPTI on the CPU
    by_name = {p["part"]: p for p in parts["parts"]}
    assert sum(p["ms"] for p in parts["parts"]) <= parts["total_ms"] and parts["other_ms"] >= 0
    assert all(p["ms"] >= 0 for p in parts["parts"])
    # 8 layers x 3 forwards (the first 11 tokens in chunks of 8 and 3, then the last); the demo has Engram layers
    assert by_name["sparse attention kernel"]["calls"] == 24 and by_name["MoE routed experts"]["calls"] == 24
    for name in ("indexer", "linear GEMMs", "mHC", "Engram", "MoE router"):
        assert next(p for n, p in by_name.items() if n.startswith(name))["ms"] > 0, name
    assert [(o, n, vars(o)[n]) for o, n, _ in originals] == originals  # every wrapped call put back
    text = capsys.readouterr().out
    assert (
        text.count("| mlx_dsv41 demo | ") == 2 and "| mlx-lm deepseek_v41 affine 4-bit (demo dims) | 20 | 8 |" in text
    )
    assert "| **total (profiled pass)** |" in text and "ours / mlx-lm" in text
    assert (tmp_path / "bench_model_prefill.md").read_text().strip() == out["table"].strip()


@pytest.mark.parametrize("n, chunk", [(13, 4), (13, 64), (2, 1)])
def test_the_timed_prefill_gives_the_one_pass_logits(tmp_path_factory, n, chunk):
    """What the benchmark times is the real prefill: the chunks, then the last token alone, end in
    the bytes of one forward over the whole prompt."""
    model, _ = mlx_dsv41.load(demo_checkpoint(tmp_path_factory))
    ids = bench_model.random_prompt(model.args.vocab_size, n)
    timings, chunked = bench_model.prefill_pass(model, model.make_cache, ids, chunk)
    whole = model(ids, cache=model.make_cache())[:, -1, :]
    assert np.array_equal(np.array(chunked).view(np.uint32), np.array(whole).view(np.uint32))
    assert 0 <= timings["prefill_s"] <= timings["ttft_s"]


def test_parts_of_the_flash_shaped_formats():
    """flash_model's formats (EXL3 linears, grouped wo_a, EXL3 experts) at small dimensions: the timed
    prefill gives the one-pass bytes, and the profile finds every part there but Engram (off)."""
    args = flash_model.flash_args(4, experts=8, **SMALL)
    model = flash_model.build(args, seed=1)
    ids = bench_model.random_prompt(args.vocab_size, 17)
    chunked = bench_model.prefill_pass(model, model.make_cache, ids, 8)[1]
    whole = model(ids, cache=model.make_cache())[:, -1, :]
    assert np.array_equal(np.array(chunked).view(np.uint32), np.array(whole).view(np.uint32))
    d = bench_model.prefill_parts(model, model.make_cache, ids, 8)
    calls = {p["part"].split(":")[0].split(",")[0]: p["calls"] for p in d["parts"]}
    assert calls["Engram"] == 0 and all(v > 0 for k, v in calls.items() if k != "Engram"), calls
    assert sum(p["ms"] for p in d["parts"]) + d["other_ms"] == pytest.approx(d["total_ms"]) and d["other_ms"] >= 0


class _Fits:
    """A model that runs up to `limit` tokens per forward and fails to allocate beyond."""

    def __init__(self, limit: int, message: str = "[malloc] Unable to allocate 1 TB"):
        self.limit, self.message, self.calls = limit, message, 0

    def __call__(self, ids, cache=None):
        self.calls += 1
        if ids.shape[1] > self.limit:
            raise RuntimeError(self.message)
        return mx.zeros((1, ids.shape[1], 7))


def test_a_size_that_does_not_fit_is_reported_and_the_run_goes_on():
    args = types.SimpleNamespace(vocab_size=300, max_position_embeddings=40)
    small = _Fits(limit=8)
    models = [("ours", small, list, args), ("mlx-lm x", _Fits(limit=100), list, args)]
    a = types.SimpleNamespace(prefill=[5, 30, 50, 9], prefill_chunk=[16], repeats=2)
    rows = list(bench_model.measure_prefill(models, a))
    assert [(r["label"], r["tokens"], "did_not_fit" in r) for r in rows] == [
        ("ours", 5, False),
        ("mlx-lm x", 5, False),
        ("ours", 30, True),
        ("mlx-lm x", 30, False),
        ("ours", 50, True),
        ("mlx-lm x", 50, True),
        ("ours", 9, False),
        ("mlx-lm x", 9, False),
    ]
    assert rows[2]["did_not_fit"] == "RuntimeError: [malloc] Unable to allocate 1 TB"
    assert rows[4]["did_not_fit"] == "50 tokens > max_position_embeddings 40"
    assert "ours_over_mlx_lm" not in rows[3] and rows[7]["ours_over_mlx_lm"] > 0
    assert "first_run_s" in rows[0] and "first_run_s" in rows[6] and "first_run_s" not in rows[2]
    assert "did not fit: RuntimeError" in bench_model.prefill_line(rows[2])
    with pytest.raises(RuntimeError, match="a bug"):  # a failure that is not about memory is not hidden
        bench_model.prefill_row(_Fits(0, "a bug"), list, mx.zeros((1, 3), mx.int32), 16, 1)


def test_prefill_options():
    ap = argparse.ArgumentParser()
    a = types.SimpleNamespace(
        quick=True,
        repeats=None,
        prefill_chunk=None,
        prefill=[64],
        prefill_parts=None,
        compiled=False,
        dspark_only=False,
    )
    bench_model.check_prefill_args(ap, a)
    assert (a.repeats, a.prefill_chunk, a.dspark) == (1, [2048], False)  # generate's --prefill-step-size default
    a.compiled = True
    with pytest.raises(SystemExit):
        bench_model.check_prefill_args(ap, a)


def test_load_reports_the_peak_and_the_head_as_stored(tmp_path, monkeypatch, capsys):
    """--load (issue 16 item 5) on a converted tiny official checkpoint: the head held bf16 and a
    peak at the parameters' own bytes (the experts are stacked at load)."""
    from mlx_dsv41.convert import convert_checkpoint
    from mlx_dsv41.synthetic_checkpoints import write_official_checkpoint

    ck = write_official_checkpoint(tmp_path / "src")
    convert_checkpoint(ck.path, tmp_path / "conv", progress=False)
    monkeypatch.setattr(
        sys, "argv", ["bench_model.py", "--cpu", "--load", str(tmp_path / "conv"), "--out", str(tmp_path)]
    )
    assert bench_model.main() == 0
    result = json.loads((tmp_path / "bench_model_load.json").read_text())["load"]
    assert result["head"]["dtype"] == "bfloat16" and result["params_GB"] > 0
    assert result["peak_over_params"] <= 1.05
    assert "| peak / parameters |" in capsys.readouterr().out


def test_whole_kernel_sources_swaps_the_sources_and_puts_them_back():
    """--whole-kernel-sources (the A/B of pruning): inside, every kernel compiles from its whole
    headers and no kernel object built from the pruned ones is kept; afterwards the pruned sources
    are back."""
    from mlx_dsv41 import kernels

    k = kernels.load_all()["exl3_gemv"]
    pruned = k.source("cuda")
    k._built["cuda"] = object()  # stands in for a kernel object MLX built from the pruned source
    with bench_model.whole_kernel_sources():
        assert k.source("cuda") == k.whole_source("cuda") and not k._built
        assert len("".join(k.source("cuda"))) > len("".join(pruned))
    assert k.source("cuda") == pruned and not k._built


def test_exl3_tuning_changes_the_plan_inside_and_refuses_unknown_fields():
    """--exl3-tuning (an A/B of the EXL3 launch plan): inside, the dense plan uses the changed
    Tuning (dense_single_blocks=1: one exl3_gemv launch, k unsplit); afterwards the default is back;
    a field Tuning does not have is refused with one line."""
    from mlx_dsv41.kernels import exl3 as exl3_kernels

    default = exl3_kernels.TUNING
    assert exl3_kernels.dense_plan(32, 8, default)[0] > 1  # a narrow output splits k by default
    with bench_model.exl3_tuning(["dense_single_blocks=1"]) as changed:
        assert changed == "dense_single_blocks=1"
        assert exl3_kernels.dense_plan(32, 8, exl3_kernels.TUNING) == (1, 32)
    assert exl3_kernels.TUNING is default
    with pytest.raises(SystemExit, match="FIELD=INT"):
        with bench_model.exl3_tuning(["no_such_field=3"]):
            pass


def test_the_kernel_timeline_counts_overlapping_launches_once():
    """bench_model's busy time: the union of the kernels' intervals (µs in, ms out); the span runs
    from the first start to the last end, gaps included; the sum would count overlaps twice."""
    busy, span = bench_model.kernel_timeline([(20, 25), (0, 10), (5, 12), (24, 30), (40, 41)])
    assert (round(busy, 6), round(span, 6)) == (0.023, 0.041)
    assert bench_model.kernel_timeline([]) == (None, None)


@pytest.mark.parametrize("ab_first", [False, True])
def test_the_ab_runs_come_after_or_before_the_default_run_with_their_switch_set(monkeypatch, ab_first):
    """--ab-first runs the A/B runs (here --kernel-stand-ins) before our default run; each run sees
    its own setting of the switch, and the switch is back afterwards."""
    from mlx_dsv41 import kernels

    seen = []
    monkeypatch.setattr(
        bench_model,
        "measure",
        lambda label, build, a, n: seen.append((label, kernels.LEAVES_OUT_ABSENT)) or {"label": label},
    )
    flags = ("whole_kernel_sources", "inline_kernel_headers", "separate_ring_writes", "separate_launches")
    flags += (
        "host_counters",
        "host_position",
        "indexer_reference",
        "attention_builds_index_list",
        "separate_compressor",
    )
    a = argparse.Namespace(
        compiled=False, exl3_tuning=[], kernel_stand_ins=True, ab_first=ab_first, **dict.fromkeys(flags, False)
    )
    runs = bench_model.ours_runs("ours", None, a, 8)
    base = [(label, True) for label, _ in seen if "stand-ins" not in label]
    ab = [(label, False) for label, _ in seen if "stand-ins" in label]
    assert len(base) == len(ab) == 1 and seen == (ab + base if ab_first else base + ab)
    assert [r["label"] for r in runs] == [label for label, _ in seen] and kernels.LEAVES_OUT_ABSENT


def test_paired_rounds_alternate_the_models_each_under_its_own_environment(monkeypatch):
    """paired_rounds.run: after each model's prefill and warm-up, round after round every model
    decodes its block in turn (sync, then pipelined) with its own environment set only meanwhile;
    each ratio is the median of the rounds' reference ms over the model's, and the main thread's CPU
    time is counted apart from the others'."""
    import threading

    import paired_rounds

    monkeypatch.delenv("PAIRED_ROUNDS_PROBE", raising=False)
    calls = []

    def model(name):
        def forward(ids, cache):
            calls.append((name, ids.shape[1], paired_rounds.os.environ.get("PAIRED_ROUNDS_PROBE")))
            cache.append(ids.shape[1])
            return mx.random.normal((1, ids.shape[1], 16))

        return forward

    a = paired_rounds.Contender("a", model("a"), [], {"PAIRED_ROUNDS_PROBE": "1"})
    b = paired_rounds.Contender("b", model("b"), [])
    prompt = mx.zeros((1, 5), mx.int32)
    out = paired_rounds.run([a, b], prompt, rounds=3, steps=2, warmup=1)
    assert "PAIRED_ROUNDS_PROBE" not in paired_rounds.os.environ
    assert calls[:4] == [("a", 5, "1"), ("a", 1, "1"), ("b", 5, None), ("b", 1, None)]
    # each round: a's 2 sync steps and 1 + 2 pipelined, then b's
    per_round = [("a", 1, "1")] * 5 + [("b", 1, None)] * 5
    assert calls[4:] == per_round * 3
    for c in (a, b):
        assert all(len(v) == 3 for v in c.runs.values())
        for mode in ("sync", "pipelined"):
            ratios = sorted(r / m for m, r in zip(c.runs[mode], b.runs[mode]))
            assert out["models"][c.name][f"{mode}_ratio_median"] == pytest.approx(ratios[1])
    assert out["models"]["b"]["pipelined_ratio_median"] == pytest.approx(1.0)
    assert threading.get_native_id() in paired_rounds.thread_cpu_s()
    text = paired_rounds.table(out)
    assert text.count("\n| a |") == 1 and text.count("\n| b |") == 1 and "3 x 2 tokens" in text


def test_cpu_time_split_classes_and_its_refusal_without_perf(monkeypatch, capsys):
    """cpu_time_split.py puts a perf sample in the first class whose library or symbol it names, and
    refuses in one line, exit 2, where `perf` is not installed."""
    import cpu_time_split

    assert cpu_time_split.classify("7f00 mlx::core::detail::compile_replace (/x/libmlx.so)") == "MLX compiled replay"
    assert cpu_time_split.classify("7f00 mlx::core::eval_impl (/x/libmlx.so)").startswith("MLX (graph walk")
    assert cpu_time_split.classify("7f00 _int_malloc (/lib/libc.so.6)").startswith("libc")
    assert cpu_time_split.classify("7f00 sgemm_ (/x/libblas-1.so.3)") == "BLAS"
    assert cpu_time_split.classify("7f00 _PyEval_EvalFrameDefault (/x/libpython3.11.so)") == "Python"
    assert cpu_time_split.classify("7f00 Bf2IAsType (/tmp/libBf2IAsType_contiguous.so)").startswith("fused")
    monkeypatch.setattr(cpu_time_split.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["cpu_time_split.py"])
    assert cpu_time_split.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "perf" in err


@pytest.mark.parametrize("compiled", [False, True])
def test_demo_rounds_take_the_default_mode_or_both(monkeypatch, compiled):
    """bench_model's rounds: the demo as the backend runs it (the CPU: eagerly) or, with --compiled,
    eagerly and compiled (each its own instance and switch), then mlx-lm as the reference."""
    from mlx_dsv41.model import compiled_step

    monkeypatch.delenv(compiled_step.ENV_VAR, raising=False)
    made = []

    class Fake:
        args = types.SimpleNamespace(vocab_size=300)

        def make_cache(self):
            return []

    monkeypatch.setattr(bench_model, "ours_demo", lambda a: made.append(Fake()) or (made[-1], Fake.args))
    monkeypatch.setattr(bench_model, "mlx_lm_model", lambda args, bits, seed: Fake())
    seen = {}
    monkeypatch.setattr(bench_model.paired_rounds, "run", lambda cs, p, r, s: seen.update(cs=cs, r=r, s=s) or {})
    a = argparse.Namespace(compiled=compiled, seed=0, prompt=64, rounds=3, round_steps=5)
    bench_model.demo_rounds(a)
    names = [c.name for c in seen["cs"]]
    ours = ["mlx_dsv41 demo eager", "mlx_dsv41 demo compiled"] if compiled else ["mlx_dsv41 demo eager"]
    assert names == [*ours, "mlx-lm deepseek_v41 affine 4-bit (demo dims)"] and (seen["r"], seen["s"]) == (3, 5)
    assert [c.env for c in seen["cs"][:-1]] == [{compiled_step.ENV_VAR: v} for v in (("0", "1") if compiled else ("",))]
    assert len(made) == len(ours) and compiled_step.ENV_VAR not in bench_model.os.environ


def test_cpu_time_split_says_in_one_line_when_its_child_dies(tmp_path, monkeypatch, capsys):
    """A decoding child that exits before its warm-up ends: one line, exit 1, no traceback; and
    --steps 0 is refused."""
    import cpu_time_split

    dies = tmp_path / "dies.py"
    dies.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setattr(cpu_time_split, "__file__", str(dies))
    monkeypatch.setattr(cpu_time_split.shutil, "which", lambda name: "/usr/bin/perf")
    monkeypatch.setattr(sys, "argv", ["cpu_time_split.py", "--steps", "3", "--out", str(tmp_path)])
    assert cpu_time_split.main() == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exited (3) before its warm-up" in err
    monkeypatch.setattr(sys, "argv", ["cpu_time_split.py", "--steps", "0"])
    with pytest.raises(SystemExit) as e:
        cpu_time_split.main()
    assert e.value.code == 2
