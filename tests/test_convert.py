"""python -m mlx_dsv41.convert: tiny checkpoints in both real formats convert, load (ours and
mlx-lm's loader) and generate; logits match the model built from the unconverted tensors exactly
and the dequantized float model within the tolerances below; Engram rows arrive intact, 2·columns
rows per token; interrupted runs resume without redoing shards; a second run is a no-op.

Tolerances (teacher-forced, every position of two 16-token sequences):
- converted vs built directly from the source tensors: bit-identical (the conversion is lossless);
- official --dtype bf16 vs the numpy-decoded float model: bit-identical (FP8/FP4 decode exactly);
- every linear / experts module of a converted model vs its float reference, on the same input:
  max |diff| <= 4% of max |ref| for mxfp8 / mxfp4 (MLX's CPU quantized matmul accumulates bf16
  inputs in reduced precision: ~1% per matmul, three chained in an expert) and <= 2% for EXL3
  (its fp16 internals, docs/exl3.md#forward);
- whole-model logits vs the float model: correlation >= 0.95 and top-1 agreement >= 75%; the
  remainder is the model's discrete choices (expert routing, indexer top-k) flipping under those
  rounding differences, which a random tiny model amplifies.
"""

import dataclasses
import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from convert_fixtures import add_tensors, convert_tiny_exl3, edit_tensors, read_tensor, run_cli

import mlx_dsv41
from mlx_dsv41 import layout
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.convert import ConvertError, convert_checkpoint
from mlx_dsv41.convert.safetensors_io import SafetensorsCheckpoint
from mlx_dsv41.engram_store import EngramStore
from mlx_dsv41.loading import checkpoint_kind, is_converted, load_converted
from mlx_dsv41.quant import GroupedLinear
from mlx_dsv41.synthetic_checkpoints import write_official_checkpoint

IDS = mx.array(np.random.default_rng(5).integers(3, 159, (2, 16)))


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    root = tmp_path_factory.mktemp("official")
    ck = write_official_checkpoint(root / "src")
    convert_checkpoint(ck.path, root / "out", progress=False)
    convert_checkpoint(ck.path, root / "out_bf16", dtype="bf16", progress=False)
    return ck, root


@pytest.fixture(scope="module")
def exl3(tmp_path_factory):
    root = tmp_path_factory.mktemp("exl3")
    return convert_tiny_exl3(root), root


def _logits(model):
    return np.array(model(IDS))


def _module_errors(model, reference):
    """max |module(x) - reference_module(x)| / max |reference_module(x)| for every linear and
    experts module, on the same random bf16 input."""
    rng = np.random.default_rng(0)
    ref_modules = dict(reference.named_modules())
    errors = {}
    for name, module in model.named_modules():
        ref = ref_modules.get(name)
        if isinstance(ref, nn.Linear):
            x = mx.array(rng.standard_normal((5, ref.weight.shape[1])), mx.bfloat16)
            a, b = module(x), ref(x)
        elif isinstance(ref, GroupedLinear):
            x = mx.array(rng.standard_normal((5, ref.groups, ref.in_features)), mx.bfloat16)
            a, b = module(x), ref(x)
        elif name.endswith(".ffn.experts"):
            x = mx.array(rng.standard_normal((6, ref.dim)), mx.bfloat16)
            idx = mx.array(rng.integers(0, ref.n_experts, (6, 2)), mx.int32)
            w = mx.array(rng.uniform(0.2, 1.0, (6, 2)), mx.float32)
            a, b = module(x, idx, w), ref(x, idx, w)
        else:
            continue
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        errors[name] = float(np.abs(a - b).max() / np.abs(b).max())
    sites = [
        n for n, m in ref_modules.items() if isinstance(m, (nn.Linear, GroupedLinear)) or n.endswith(".ffn.experts")
    ]
    assert sorted(errors) == sorted(sites)
    return errors


def test_official_converts_exactly(official):
    ck, root = official
    model = load_converted(root / "out")
    assert np.array_equal(_logits(model), _logits(ck.source_model()))
    assert type(model.layers[3].ffn.experts).__name__ == "MXExperts"
    assert type(model.layers[3].attn.wq_b).__name__ == "MXLinear" and model.layers[3].attn.wq_b.mode == "mxfp8"
    # dequantized with its scales (docs/numerics.md#dtypes)
    assert model.layers[3].attn.wo_a.weight.dtype == mx.bfloat16
    bf16 = load_converted(root / "out_bf16")
    assert np.array_equal(_logits(bf16), _logits(ck.reference_model()))


def test_official_matches_the_float_model(official):
    ck, root = official
    model, reference = load_converted(root / "out"), ck.reference_model()
    errors = _module_errors(model, reference)
    assert max(errors.values()) <= 0.04, max(errors.items(), key=lambda kv: kv[1])
    a, b = _logits(model), _logits(reference)
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] >= 0.95 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


def test_exl3_converts_exactly_and_matches_the_dequantized_model(exl3):
    ck, root = exl3
    model = load_converted(root / "out")
    assert np.array_equal(_logits(model), _logits(ck.source_model()))
    reference = ck.reference_model()
    errors = _module_errors(model, reference)
    assert max(errors.values()) <= 0.02, max(errors.items(), key=lambda kv: kv[1])
    a, b = _logits(model), _logits(reference)
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] >= 0.95 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


def test_exl3_legacy_sign_fields(exl3, tmp_path):
    """Pre-public EXL3 linears store su / sv (int16 sign bitfields, bit i of word w = sign of
    element 16w+i, docs/exl3.md#stored-tensors) instead of suh / svh: converted as stored, loaded
    the same."""
    ck, root = exl3
    src = shutil.copytree(ck.path, tmp_path / "src")
    prefix, legacy = "layers.0.attn.wq_a", {}
    for side, name in (("suh", "su"), ("svh", "sv")):
        _, values = read_tensor(src, f"{prefix}.{side}")
        bits = (values < 0).reshape(-1, 16).astype(np.uint32) << np.arange(16, dtype=np.uint32)
        legacy[f"{prefix}.{name}"] = ("I16", bits.sum(axis=1).astype(np.uint16).view(np.int16))
    add_tensors(src, f"{prefix}.suh", legacy)
    edit_tensors(src, {f"{prefix}.suh": None, f"{prefix}.svh": None})
    convert_checkpoint(src, tmp_path / "out", engram_from=root / "engram", progress=False)
    model = load_converted(tmp_path / "out")
    assert model.layers[0].attn.wq_a.suh.shape == (128,)
    assert set(np.unique(np.abs(np.array(model.layers[0].attn.wq_a.svh)))) == {1.0}
    assert np.array_equal(_logits(model), _logits(dataclasses.replace(ck, path=src).source_model()))


def test_engram_from_a_partial_download_of_the_release(official, exl3, tmp_path):
    """--engram-from a copy of the official release holding only its Engram shards (its index
    still lists the others): the tables are found by their shards' headers."""
    ck, root = exl3
    release = shutil.copytree(official[0].path, tmp_path / "release")
    for shard in ("model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"):
        (release / shard).unlink()
    convert_checkpoint(ck.path, tmp_path / "out", engram_from=release, progress=False)
    for layer, table in official[0].tables.items():
        with EngramStore(tmp_path / "out" / layout.engram_rows_file(layer)) as store:
            assert np.array_equal(store.read(np.arange(store.rows)), table)


def test_layout(official, exl3):
    for (ck, root), kind in ((official, "official"), (exl3, "exl3")):
        out = root / "out"
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
        assert "quantization" not in config and config["model_file"] == "model.py"
        block = config["mlx_dsv41"]
        assert block["format"] == layout.FORMAT and block["source"]["kind"] == kind
        assert block["source"]["quantization_config"]["quant_method"] == {"official": "fp8", "exl3": "exl3"}[kind]
        assert set(block["engram"]["layers"]) == {"1", "2"}
        assert not (out / layout.STATE).exists() and not layout.partial_dir(out).exists()
        assert checkpoint_kind(out) == "converted" and is_converted(out) and checkpoint_kind(ck.path) == kind
        index = json.loads((out / layout.INDEX).read_text())["weight_map"]
        assert sorted(set(index.values())) == [layout.shard_name(i + 1, 2) for i in range(2)]
        assert not any(
            n.startswith(("mtp.", "vision.", "aligner.", "image_")) or "bias_vl" in n or ".engram.embed." in n
            for n in index
        )
        assert ModelArgs.from_dict(config).mlx_dsv41 == block
    formats = json.loads((official[1] / "out" / "config.json").read_text())["mlx_dsv41"]["formats"]
    assert formats["attn.wq_a"] == ["mxfp8"] and formats["attn.wo_a"] == ["bf16"]
    assert formats["ffn.experts.w2"] == ["mxfp4"] and formats["head"] == ["bf16"]
    formats = json.loads((exl3[1] / "out" / "config.json").read_text())["mlx_dsv41"]["formats"]
    assert formats["attn.wo_a.slice"] == ["exl3"] and formats["engram.wkv"] == ["exl3", "f16"]
    assert formats["attn.indexer.weights_proj"] == ["bf16"]


def test_mlx_lm_load_and_generate(official, exl3):
    import mlx_lm

    for _, root in (official, exl3):
        ours, tokenizer = mlx_dsv41.load(root / "out")
        theirs, _ = mlx_lm.load(str(root / "out"), trust_remote_code=True)
        assert type(theirs).__name__ == "ConvertedModel"
        assert np.array_equal(_logits(ours), _logits(theirs))
        steps = list(mlx_lm.stream_generate(theirs, tokenizer, "w3 w4 W5", max_tokens=4))
        assert len(steps) == 4 and all(0 <= s.token < 160 for s in steps)


def test_engram_rows_and_reads_per_token(exl3):
    ck, root = exl3
    args = ck.args
    for i, layer in enumerate(args.engram_layer_ids):
        rows = args.engram_num_embeddings[i]
        with EngramStore(root / "out" / layout.engram_rows_file(layer), expected_rows=rows) as store:
            assert np.array_equal(store.read(np.arange(rows)), ck.tables[layer])
        # and the bytes are the official shard's, as stored
        with SafetensorsCheckpoint(root / "engram", use_index=False) as src:
            values = src.read(f"layers.{layer}.engram.embed.weight")
            assert np.array_equal(ck.tables[layer][:, : args.engram_head_dim], values)
    model, _ = mlx_dsv41.load(root / "out", engram_mode="mmap")
    stores = model.engram_sources
    assert all(s.mode == "mmap" for s in stores.values())
    cache = model.make_cache()
    model(IDS[:1, :10], cache=cache)
    per_token = args.engram_columns  # per Engram layer
    assert [s.stats.rows_requested for s in stores.values()] == [10 * per_token] * 2
    model(IDS[:1, 10:11], cache=cache)
    assert sum(s.stats.rows_requested for s in stores.values()) == 11 * 2 * per_token  # 12 per token here
    flash = ModelArgs()
    assert len(flash.engram_layer_ids) * flash.engram_columns == 48 and flash.engram_row_bytes == 264


def test_interrupted_conversion_resumes(official, tmp_path):
    ck, root = official
    out = tmp_path / "out"
    crashed = run_cli(ck.path, out, env={"MLX_DSV41_CONVERT_CRASH_AFTER": "1"})
    assert crashed.returncode == 75, crashed.stderr
    partial = layout.partial_dir(out)
    assert not out.exists() and not is_converted(partial)
    state = json.loads((partial / layout.STATE).read_text())
    assert list(state["shards"]) == [layout.shard_name(1, 2)]
    first = (partial / layout.shard_name(1, 2)).stat()
    convert_checkpoint(ck.path, out, progress=False)
    again = (out / layout.shard_name(1, 2)).stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not redone
    reference = root / "out"
    for f in sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file()):
        assert (out / f).read_bytes() == (reference / f).read_bytes(), f


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_row_chunked_conversion_writes_the_same_bytes(official, tmp_path, monkeypatch, dtype):
    """Large tensors are converted / copied in row chunks (whole 32-row FP8 tiles): with tiny
    chunks, every output file is byte-identical to the one-piece conversion."""
    from mlx_dsv41.convert import plan

    ck, root = official
    monkeypatch.setattr(plan, "PASS_CHUNK_BYTES", 1000)  # FP8: 32-row tiles; embed: 7 rows
    convert_checkpoint(ck.path, tmp_path / "out", dtype=dtype, progress=False)
    reference = root / ("out" if dtype is None else "out_bf16")
    files = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "out" / f).read_bytes() == (reference / f).read_bytes(), f


def test_unfinished_work_of_other_options_is_discarded(official, tmp_path):
    ck, root = official
    out = tmp_path / "out"
    assert run_cli(ck.path, out, env={"MLX_DSV41_CONVERT_CRASH_AFTER": "1"}).returncode == 75
    convert_checkpoint(ck.path, out, dtype="bf16", progress=False)  # not a resume: other options
    assert (out / layout.shard_name(1, 2)).read_bytes() == (root / "out_bf16" / layout.shard_name(1, 2)).read_bytes()


def test_finished_but_not_renamed_is_completed(official, tmp_path):
    """A crash between marking OUT.partial complete and renaming it: the rerun only renames."""
    ck, root = official
    shutil.copytree(root / "out", layout.partial_dir(tmp_path / "out"))
    convert_checkpoint(ck.path, tmp_path / "out", progress=False)
    assert is_converted(tmp_path / "out") and not layout.partial_dir(tmp_path / "out").exists()
    layout.partial_dir(tmp_path / "empty").mkdir()  # a partial directory with nothing in it is reused
    convert_checkpoint(ck.path, tmp_path / "empty", progress=False)
    assert is_converted(tmp_path / "empty")


def test_second_run_is_a_no_op(official, tmp_path):
    ck, _ = official
    out = tmp_path / "out"
    convert_checkpoint(ck.path, out, progress=False)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    result = run_cli(ck.path, out)
    assert result.returncode == 0 and not result.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    with pytest.raises(ConvertError, match="already holds a conversion of .*another source or other options"):
        convert_checkpoint(ck.path, out, dtype="bf16", progress=False)


def test_empty_output_directory_is_used(official, tmp_path):
    ck, _ = official
    (tmp_path / "out").mkdir()
    convert_checkpoint(ck.path, tmp_path / "out", progress=False)
    assert is_converted(tmp_path / "out")


def test_progress_and_peak_memory_report(official, tmp_path, capfd):
    ck, _ = official
    convert_checkpoint(ck.path, tmp_path / "out", progress=True)
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"converted {ck.path} -> {tmp_path / 'out'}: ") and "peak RSS" in err[-1]


def test_expert_range_reads_only_its_experts(official):
    """A rank holding experts 2..5 of 8 reads the other experts' tensors not at all."""
    _, root = official
    io = "/proc/self/io"
    if not os.path.exists(io):
        pytest.skip("needs /proc/self/io")
    read = lambda: int(dict(line.split(": ") for line in open(io).read().splitlines())["rchar"])  # noqa: E731
    index = json.loads((root / "out" / layout.INDEX).read_text())["weight_map"]
    with SafetensorsCheckpoint(root / "out") as ckpt:
        expert_bytes = sum(ckpt.info(n).nbytes for n in index if ".ffn.experts." in n)
    sizes = {}
    for rng in (None, (2, 6)):
        before = read()
        model, _ = mlx_dsv41.load(root / "out", expert_range=rng)
        sizes[rng] = read() - before
        experts = model.layers[0].ffn.experts
        assert experts.expert_range == (rng or (0, 8)) and experts.w1.weight.shape[0] == (4 if rng else 8)
    skipped = sizes[None] - sizes[(2, 6)]
    assert abs(skipped - expert_bytes / 2) < 0.05 * expert_bytes, (skipped, expert_bytes)
