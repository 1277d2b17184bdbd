"""The built-in demo checkpoint: deterministic, written in the real EXL3 + official Engram formats
(read back with the strict safetensors reader), covering every layer role at head_dim 512, with
DeepSeek's special tokens at their ids; converted and loaded through the real path."""

import hashlib
import json

import numpy as np
import pytest
from demo_helpers import demo_checkpoint

import mlx_dsv41
from mlx_dsv41 import chat, demo
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.convert.safetensors_io import SafetensorsCheckpoint
from mlx_dsv41.engram_store import EngramStore
from mlx_dsv41.exl3.codebook import MARKER_VALUES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    converted = demo_checkpoint(tmp_path_factory)
    return converted.parent / "exl3", converted.parent / "official-engram", converted


def _digests(directory):
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_two_builds_are_byte_identical(built, tmp_path):
    exl3, engram, _ = built
    again_exl3, again_engram = demo.write_sources(tmp_path)
    assert _digests(again_exl3) == _digests(exl3)
    assert _digests(again_engram) == _digests(engram)


def test_config_covers_every_role_at_head_dim_512(built):
    args = ModelArgs.from_file(built[0] / "config.json")
    assert args.head_dim == 512 and args.hc_mult == 4
    modes = {(r.mode, r.ratio) for r in args.roles}
    assert modes == {("window", 0), ("full", 2), ("reuse", 2), ("full", 1), ("reuse", 1), ("reindex", 1)}
    assert any(r.builds_candidates for r in args.roles) and any(r.uses_candidates for r in args.roles)
    assert len(args.engram_layer_ids) == 2
    assert {args.role(i).mode for i in args.engram_layer_ids} == {"window", "full"}


def test_tokenizer_has_deepseek_special_tokens_at_their_ids(built):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(built[0] / "tokenizer.json"))
    args = ModelArgs.from_file(built[0] / "config.json")
    assert [tok.id_to_token(i) for i in range(3)] == [chat.BOS, chat.EOS, demo.PAD]
    assert tok.get_vocab_size(with_added_tokens=True) == args.vocab_size
    assert tok.token_to_id(demo.IMAGE) == args.image_token_id
    ids = chat.control_token_ids(tok)
    assert len(set(ids.values())) == len(chat.CONTROL_TOKENS)
    assert tok.encode("hi").ids[0] == 0  # BOS added, as mlx-lm expects
    config = json.loads((built[0] / "tokenizer_config.json").read_text())
    assert config["chat_template_type"] == chat.TEMPLATE_TYPE


def test_exl3_source_is_the_exllamav3_layout(built):
    exl3 = built[0]
    config = json.loads((exl3 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3"
    args = ModelArgs.from_dict(config)
    storage = json.loads((exl3 / "quantization_config.json").read_text())["tensor_storage"]
    markers = {name: np.array(v, np.uint32).view(np.int32) for name, v in MARKER_VALUES.items()}
    with SafetensorsCheckpoint(exl3) as ckpt:
        names = set(ckpt.weight_map)
        assert not any(".engram.embed." in n for n in names)  # EXL3 packs carry no Engram tables
        assert not any(n.startswith("layers.0.ffn.experts.w") for n in names)  # per expert, never stacked
        assert {p for p in storage} == {n.rsplit(".", 1)[0] for n in names if n.endswith(".trellis")}

        def k_of(prefix):
            info = ckpt.info(f"{prefix}.trellis")
            assert info.dtype == "I16" and ckpt.info(f"{prefix}.suh").dtype == "F16"
            assert ckpt.info(f"{prefix}.svh").dtype == "F16"
            present = [m for m in markers if f"{prefix}.{m}" in names]
            assert len(present) <= 1  # none: 3INST
            for m in present:
                assert ckpt.info(f"{prefix}.{m}").shape == () and ckpt.read(f"{prefix}.{m}").reshape(()) == markers[m]
            assert storage[prefix]["bits_per_weight"] == info.shape[-1] / 16
            return info.shape[-1] // 16

        assert k_of("layers.0.attn.wq_a") == 5
        assert [k_of(f"layers.0.attn.wo_a.slice.{g}") for g in range(args.o_groups)] == [5] * args.o_groups
        assert k_of("layers.2.attn.indexer.wk") == 8
        assert k_of("layers.2.attn.compressor.wgate") == 5
        assert k_of("head") == 6
        assert k_of("layers.0.ffn.shared_experts.w2") == 4
        assert {k_of(f"layers.0.ffn.experts.{e}.w1") for e in range(args.n_routed_experts)} == {3}
        assert sorted({k_of(f"layers.0.ffn.experts.{e}.w2") for e in range(args.n_routed_experts)}) == [2, 3]
        first, second = args.engram_layer_ids
        assert k_of(f"layers.{first}.engram.wkv") == 4
        assert ckpt.info(f"layers.{second}.engram.wkv.weight").dtype == "F16"  # upstream: unquantized
        trellis = ckpt.info("layers.0.attn.wq_b.trellis")
        assert trellis.shape == (args.q_lora_rank // 16, args.num_attention_heads * args.head_dim // 16, 80)
        assert {m for n in names for m in markers if n.endswith("." + m)} == {"mul1", "mcg"}
        native = {
            "embed.weight": "BF16",
            "layers.0.attn_norm.weight": "BF16",
            "layers.0.ffn.gate.weight": "BF16",
            "layers.0.ffn.gate.bias": "F32",
            "layers.0.attn.attn_sink": "F32",
            "layers.0.hc_attn_fn": "F32",
            "layers.2.attn.indexer.weights_proj.weight": "BF16",
            "layers.1.engram.q_weight": "BF16",
        }
        for name, dtype in native.items():
            assert ckpt.info(name).dtype == dtype, name


def test_engram_tables_are_in_the_official_format(built):
    args = ModelArgs.from_file(built[0] / "config.json")
    with SafetensorsCheckpoint(built[1], use_index=False) as ckpt:
        assert sorted(p.name for p in ckpt.shards()) == [
            "model-00047-of-00048.safetensors",
            "model-00048-of-00048.safetensors",
        ]
        for layer, rows in zip(args.engram_layer_ids, args.engram_num_embeddings):
            w = ckpt.info(f"layers.{layer}.engram.embed.weight")
            s = ckpt.info(f"layers.{layer}.engram.embed.scale")
            assert (w.dtype, w.shape) == ("F8_E4M3", (rows, args.engram_head_dim))
            assert (s.dtype, s.shape) == ("F8_E8M0", (rows, args.engram_head_dim // 32))
            values = ckpt.read(w.name)
            assert not ((values & 0x7F) == 0x7F).any()  # no e4m3 NaN codes
            assert values.std() > 0


def test_converted_demo_loads_through_the_real_path(built):
    _, engram, converted = built
    assert mlx_dsv41.loading.checkpoint_kind(converted) == "converted"
    assert mlx_dsv41.loading.checkpoint_kind(built[0]) == "exl3"
    model, tokenizer = mlx_dsv41.load(converted, lazy=True)
    sources = model.engram_sources
    assert sorted(sources) == list(model.args.engram_layer_ids)
    assert all(isinstance(s, EngramStore) for s in sources.values())  # rows come from SSD files
    with SafetensorsCheckpoint(engram, use_index=False) as ckpt:
        for layer, store in sources.items():
            want = np.concatenate(
                [
                    ckpt.read(f"layers.{layer}.engram.embed.weight")[[0, 7, -1]],
                    ckpt.read(f"layers.{layer}.engram.embed.scale")[[0, 7, -1]],
                ],
                axis=1,
            )
            rows = store.read(np.array([0, 7, store.header.rows - 1]))
            assert np.array_equal(rows, want)


def test_ensure_demo_builds_once(built, monkeypatch):
    converted = built[2]
    stamp = (converted / "config.json").stat().st_mtime_ns
    monkeypatch.setattr(demo, "write_sources", lambda *a, **k: pytest.fail("rebuilt an existing demo"))
    assert demo.ensure_demo(converted.parent, progress=False) == converted
    assert (converted / "config.json").stat().st_mtime_ns == stamp


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path))
    assert demo.demo_root() == tmp_path / f"demo-v{demo.DEMO_VERSION}"
    monkeypatch.delenv(demo.CACHE_ENV)
    assert demo.demo_root().parent.name == "mlx_dsv41" and ".cache" in demo.demo_root().parts
