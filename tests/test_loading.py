"""Plain-weight loading: tiny checkpoints in official names round-trip through safetensors; every
mismatch is a one-line error naming the tensor; dropped tensors are never read."""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dsv41.config import ConfigError
from mlx_dsv41.loading import LoadError, load_model
from mlx_dsv41.model.engram import MemoryRowSource
from mlx_dsv41.quant import stored_format
from mlx_dsv41.synthetic import (
    official_shapes,
    random_engram_tables,
    random_weights,
    synthetic_token_map,
    tiny_args,
    tiny_model,
    write_checkpoint,
)

ARGS = tiny_args()
IDS = mx.array(np.random.default_rng(9).integers(0, 159, (2, 12)))


@pytest.fixture(scope="module")
def weights():
    return random_weights(ARGS, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights):
    """Official layout: weights in shard 1; Engram tables (F8_E4M3 / F8_E8M0) in shard 2; plus
    tensors the text model must drop (MTP, vision, aligner, image embeddings, bias_vl)."""
    extra = {
        "mtp.0.attn_norm.weight": mx.ones((64,), mx.bfloat16),
        "vision.blocks.0.norm1.weight": mx.ones((8,), mx.bfloat16),
        "aligner.w1.weight": mx.ones((4, 4), mx.bfloat16),
        "image_newline": mx.ones((64,), mx.bfloat16),
        "layers.0.ffn.gate.bias_vl": mx.zeros((8,), mx.float32),
    }
    path = tmp_path_factory.mktemp("ckpt")
    return write_checkpoint(path, ARGS, {**weights, **extra}, random_engram_tables(ARGS, seed=0))


def _rows_from_checkpoint(path, layer):
    """Row-source bytes straight from the official table tensors (values then scales)."""
    shard = mx.load(str(path / "model-00002-of-00002.safetensors"))
    values = np.array(shard[f"layers.{layer}.engram.embed.weight"])
    scales = np.array(shard[f"layers.{layer}.engram.embed.scale"])
    assert values.dtype == np.uint8 and scales.shape == (values.shape[0], ARGS.engram_head_dim // 32)
    return np.concatenate([values, scales], axis=1)


def test_round_trip_gives_the_same_logits(checkpoint, weights):
    model = load_model(checkpoint)
    model.set_engram(
        synthetic_token_map(ARGS),
        {L: MemoryRowSource(_rows_from_checkpoint(checkpoint, L)) for L in ARGS.engram_layer_ids},
    )
    direct = tiny_model(ARGS, weights=weights)
    assert np.array_equal(np.array(model(IDS)), np.array(direct(IDS)))
    # Held as stored: fp32 what the release stores fp32; the fp32 linears' bf16 weights stay bf16
    # and are widened where used (docs/numerics.md#fp32-linears).
    params = dict(tree_flatten(model.parameters()))
    assert params["layers.2.attn.compressor.wkv.weight"].dtype == mx.bfloat16  # ratio 2: pooled in fp32
    assert params["layers.4.attn.compressor.wkv.weight"].dtype == mx.bfloat16
    assert params["layers.0.hc_attn_fn"].dtype == mx.float32 and params["head.weight"].dtype == mx.bfloat16
    assert params["layers.0.attn.wq_a.weight"].dtype == mx.bfloat16
    assert params["layers.0.ffn.experts.w1"].shape == (8, 32, 64)


def test_official_names_per_role():
    """docs/checkpoint.md#tensor-names: which layers carry which optional tensors."""
    names = set(official_shapes(ARGS))
    has = lambda layer, t: f"layers.{layer}.{t}" in names  # noqa: E731
    assert has(2, "attn.compressor.wgate.weight") and not has(4, "attn.compressor.wgate.weight")
    assert has(4, "attn.compressor.wkv.weight") and has(4, "attn.indexer.wk.weight")
    assert has(6, "attn.indexer.wq_b.weight") and not has(6, "attn.indexer.wk.weight")
    assert not any(has(3, f"attn.{m}") for m in ("indexer.wq_b.weight", "compressor.wkv.weight"))
    assert not any(has(0, f"attn.{m}") for m in ("indexer.wq_b.weight", "compressor.wkv.weight"))
    assert has(1, "engram.wkv.weight") and has(2, "engram.q_weight") and not has(0, "engram.k_weight")
    assert sum(n.startswith("layers.0.ffn.experts.") for n in names) == 8 * 3


def test_dropped_tensors_are_never_read(tmp_path, weights):
    """A 32 MiB tensor the model drops (an MTP weight) costs no read; loading lazily reads nothing
    until first use, and then only what the model holds."""
    big = mx.zeros((8 * 1024 * 1024,), mx.float32)
    path = write_checkpoint(tmp_path, ARGS, {**weights, "mtp.0.big.weight": big})
    io = Path("/proc/self/io")
    if not io.exists():
        pytest.skip("needs /proc/self/io")
    read = lambda: int(dict(line.split(": ") for line in io.read_text().splitlines())["rchar"])  # noqa: E731
    before = read()
    model = load_model(path, lazy=False)
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert read() - before < held + 4 * 1024 * 1024  # far below the 32 MiB that was skipped


def _variant(tmp_path, weights, change):
    w = dict(weights)
    change(w)
    return write_checkpoint(tmp_path, ARGS, w)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda w: w.pop("layers.3.attn.wq_b.weight"), r"missing tensor layers\.3\.attn\.wq_b\.weight$"),
        (lambda w: w.pop("layers.5.ffn_norm.weight"), r"missing tensor layers\.5\.ffn_norm\.weight$"),
        (lambda w: w.pop("layers.2.ffn.experts.7.w3.weight"), r"missing tensor layers\.2\.ffn\.experts\.7\.w3\.weight"),
        (
            lambda w: w.update({"layers.1.attn.wkv.weight": mx.zeros((64, 63), mx.bfloat16)}),
            r"layers\.1\.attn\.wkv\.weight: expected shape \[64, 64\], got \[64, 63\]",
        ),
        (
            lambda w: w.update({"layers.1.attn_norm.weight": mx.zeros((65,), mx.bfloat16)}),
            r"layers\.1\.attn_norm\.weight: expected shape \[64\], got \[65\]",
        ),
        (
            lambda w: w.update({"layers.0.ffn.experts.3.w2.weight": mx.zeros((64, 31), mx.bfloat16)}),
            r"layers\.0\.ffn\.experts\.3\.w2\.weight: expected a float tensor of shape \[64, 32\]",
        ),
        (
            lambda w: w.update({"layers.6.hc_ffn_fn": w["layers.6.hc_ffn_fn"].astype(mx.bfloat16)}),
            r"layers\.6\.hc_ffn_fn: stored as mlx\.core\.bfloat16, expected float32",
        ),
        (
            lambda w: w.update({"layers.0.attn.attn_sink": w["layers.0.attn.attn_sink"].astype(mx.float16)}),
            r"layers\.0\.attn\.attn_sink: stored as mlx\.core\.float16, expected float32",
        ),
        (lambda w: w.update({"norm.weight": mx.ones((64,), mx.int32)}), r"norm\.weight: expected a float tensor, got"),
        (
            lambda w: w.update({"layers.0.attn.wq_a.weight": mx.ones((32, 64), mx.int32)}),
            r"layers\.0\.attn\.wq_a\.weight has dtype mlx\.core\.int32 and no scales",
        ),
        (
            lambda w: w.update({"layers.3.attn.indexer.wq_b.weight": mx.ones((64, 32), mx.bfloat16)}),
            r"unexpected tensor layers\.3\.attn\.indexer\.wq_b\.weight: not a parameter of this model",
        ),
    ],
)
def test_bad_checkpoints_give_one_line_errors(tmp_path, weights, change, message):
    path = _variant(tmp_path, weights, change)
    with pytest.raises((LoadError, ConfigError)) as err:
        load_model(path)
    assert "\n" not in str(err.value)
    assert re.search(message, str(err.value)), str(err.value)


def test_directory_errors(tmp_path, checkpoint):
    with pytest.raises(ConfigError, match="no such config file"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(LoadError, match="no \\*\\.safetensors files"):
        load_model(tmp_path)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        LoadError, match="model-00001-of-00002.safetensors: shard listed in model.safetensors.index.json is missing"
    ):
        load_model(tmp_path)
    bad = json.loads((checkpoint / "config.json").read_text())
    bad["text_config"]["compress_ratios"] = bad["text_config"]["compress_ratios"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="compress_ratios has 8 entries; expected"):
        load_model(tmp_path)


def test_expert_range_reads_only_its_experts(tmp_path, weights):
    w = {k: v for k, v in weights.items() if not any(f".ffn.experts.{e}." in k for e in (5, 6, 7))}
    path = write_checkpoint(tmp_path, ARGS, w)
    model = load_model(path, expert_range=(0, 5))
    experts = model.layers[3].ffn.experts
    assert experts.expert_range == (0, 5) and experts.w2.shape == (5, 64, 32)
    with pytest.raises(
        LoadError, match=r"missing tensor layers\.\d\.ffn\.experts\.5\.w1\.weight \(dense expert 5 of 8\)"
    ):
        load_model(path)


def test_sanitize_accepts_its_own_output(weights):
    """A model's own parameters (stacked experts, fp32 copies) load again unchanged: what a
    converted or re-saved checkpoint holds."""
    model = tiny_model(ARGS, weights=weights)
    params = dict(tree_flatten(model.parameters()))
    again = tiny_model(ARGS, weights=params)
    assert np.array_equal(np.array(again(IDS)), np.array(model(IDS)))


def test_stored_format_detection():
    f = lambda **t: stored_format({f"p.{k}": v for k, v in t.items()}, "p")  # noqa: E731
    assert f(weight=mx.zeros((4, 4), mx.bfloat16)) == "dense"
    assert f(trellis=mx.zeros((1, 1, 48), mx.int16), suh=mx.zeros(16), svh=mx.zeros(16)) == "exl3"
    assert f(weight=mx.zeros((32, 32), mx.uint8), scale=mx.zeros((1, 1), mx.uint8)) == "fp8"
    assert f(weight=mx.zeros((32, 16), mx.int8), scale=mx.zeros((32, 1), mx.uint8)) == "fp4"
    assert f(weight=mx.zeros((32, 4), mx.uint32), scales=mx.zeros((32, 1), mx.uint8)) == "mlx_quantized"
    with pytest.raises(ValueError, match="missing tensor p.weight"):
        f()
    with pytest.raises(ValueError, match=r"p: stored tensors \['p.suh'\] match no known linear format"):
        f(suh=mx.zeros(16))
    with pytest.raises(ValueError, match="has a .scale but dtype"):
        f(weight=mx.zeros((4, 4), mx.bfloat16), scale=mx.zeros((1, 1), mx.uint8))


def test_exl3_tensors_load_through_the_seam(weights):
    """Per-tensor formats: EXL3 linears (one of them the head), wo_a stored as EXL3 slices and one
    layer's EXL3 experts, beside dense tensors, load into their EXL3 modules; the model then tracks
    a dense model holding the same weights dequantized (EXL3 runs its own fp16 internals)."""
    from mlx_dsv41 import exl3  # the project's own package: an import error must fail, not skip
    from mlx_dsv41.exl3.synthetic import random_experts_tensors, random_linear_tensors

    mixed, dense = dict(weights), dict(weights)

    def as_exl3(prefix, d_in, d_out, seed, store):
        t = {k: mx.array(v) for k, v in random_linear_tensors(d_in, d_out, 4, prefix=prefix, seed=seed).items()}
        store.update(t)
        w = exl3.dequantize(
            t[f"{prefix}.trellis"], t[f"{prefix}.suh"], t[f"{prefix}.svh"], exl3.codebook_from_markers(t, prefix)
        )
        return w[:d_in, :d_out].T.astype(mx.bfloat16)  # [out, in], as a dense checkpoint holds it

    for prefix, d_in, d_out in (("layers.0.attn.wq_a", 64, 32), ("layers.1.engram.wkv", 192, 320), ("head", 64, 160)):
        del mixed[f"{prefix}.weight"]
        dense[f"{prefix}.weight"] = as_exl3(prefix, d_in, d_out, 1, mixed)
    del mixed["layers.0.attn.wo_a.weight"]
    dense["layers.0.attn.wo_a.weight"] = mx.concatenate(
        [as_exl3(f"layers.0.attn.wo_a.slice.{g}", 128, 32, 2 + g, mixed) for g in range(2)]
    )
    experts = {
        k: mx.array(v) for k, v in random_experts_tensors(8, 64, 32, bits=4, prefix="layers.5.ffn.experts").items()
    }
    for k in [k for k in mixed if k.startswith("layers.5.ffn.experts.")]:
        del mixed[k]
    mixed.update(experts)
    for e in range(8):
        for proj, (d_in, d_out) in {"w1": (64, 32), "w3": (64, 32), "w2": (32, 64)}.items():
            p = f"layers.5.ffn.experts.{e}.{proj}"
            w = exl3.dequantize(
                experts[f"{p}.trellis"],
                experts[f"{p}.suh"],
                experts[f"{p}.svh"],
                exl3.codebook_from_markers(experts, p),
            )
            dense[f"{p}.weight"] = w[:d_in, :d_out].T.astype(mx.bfloat16)

    model, reference = tiny_model(ARGS, weights=mixed), tiny_model(ARGS, weights=dense)
    assert isinstance(model.layers[0].attn.wq_a, exl3.EXL3Linear) and isinstance(model.head, exl3.EXL3Linear)
    wo_a = model.layers[0].attn.wo_a  # the two slices as one grouped EXL3 linear (one K: one group)
    assert isinstance(wo_a, exl3.EXL3GroupedLinear) and wo_a.groups == 2 and len(wo_a.proj.groups) == 1
    assert isinstance(model.layers[5].ffn.experts, exl3.EXL3Experts)
    assert type(model.layers[4].ffn.experts).__name__ == "DenseExperts"
    ids = IDS[:, :8]
    a, b = np.array(model(ids)), np.array(reference(ids))
    assert a.dtype == np.float32 and np.isfinite(a).all()
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99 and (a.argmax(-1) == b.argmax(-1)).mean() > 0.7


def test_mlx_lm_load_model_builds_the_same_model(checkpoint, weights):
    """mlx-lm's own loader (class injection, docs/mlx.md#external-model) goes through our from_dict,
    sanitize and load_weights and gives the model `load_model` gives."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from mlx_dsv41.config import ModelArgs
    from mlx_dsv41.model.deepseek_v41 import Model

    model, _ = mlx_lm_load_model(checkpoint, get_model_classes=lambda config: (Model, ModelArgs))
    ours = load_model(checkpoint)
    for m in (model, ours):
        m.set_engram(
            synthetic_token_map(ARGS),
            {L: MemoryRowSource(_rows_from_checkpoint(checkpoint, L)) for L in ARGS.engram_layer_ids},
        )
    assert np.array_equal(np.array(model(IDS)), np.array(ours(IDS)))
