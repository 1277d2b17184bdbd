"""Config parsing (HF nested layout), the Flash layer schedule of docs/model.md#layer-roles, and
validation errors."""

import json

import pytest

from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.synthetic import hf_config, tiny_args

QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


def test_hf_nested_config_is_merged():
    cfg = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "quantization_config": QUANT,
        "vision_config": {"hidden_size": 1024},
        "text_config": {
            "model_type": "deepseek_v41_text",
            "hidden_size": 5120,
            "dspark_block_size": 5,
            "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        },
    }
    args = ModelArgs.from_dict(cfg)
    assert args.model_type == "deepseek_v41" and args.quantization_config == QUANT
    assert args.hidden_size == 5120 and isinstance(args.compress_ratios, tuple)
    assert args.engram_columns == 24 and args.engram_row_bytes == 264 and args.engram_index(14) == 1


def test_flash_schedule_matches_spec_table():
    roles = ModelArgs().roles
    assert len(roles) == 40
    full, reindex = {2, 8, 14, 20}, {24, 28, 32, 36}
    for r in roles:
        if r.layer < 2:
            assert (r.ratio, r.mode, r.kv_source, r.index_source) == (0, "window", None, None)
            continue
        assert r.ratio == (2 if r.layer < 20 else 1)
        kv_src = max(s for s in full if s <= r.layer)
        assert r.kv_source == kv_src, r
        if r.layer in full:
            assert r.mode == "full" and r.index_source == r.layer
        elif r.layer in reindex:
            assert r.mode == "reindex" and r.index_source == r.layer and r.kv_source == 20
        else:
            assert r.mode == "reuse"
            assert r.index_source == max(s for s in full | reindex if s <= r.layer)
        assert r.builds_candidates == (r.layer == 20)
        assert r.uses_candidates == (r.layer in reindex)
        assert r.engram == (r.layer == 14)
    assert roles[1].engram


def test_tiny_config_round_trips_through_hf_json():
    args = tiny_args()
    again = ModelArgs.from_dict(json.loads(json.dumps(hf_config(args))))
    assert again == args


def _flash(**text):
    return {"model_type": "deepseek_v41", "text_config": text}


@pytest.mark.parametrize(
    "text,message",
    [
        (
            dict(compress_ratios=[0] * 42),
            r"compress_ratios has 42 entries; expected num_hidden_layers \+ num_nextn_predict_layers = 40 \+ 3 = 43",
        ),
        (dict(compress_ratios=[0, 0, 3] + [2] * 17 + [1] * 20 + [0] * 3), r"compress_ratios may only hold 0, 1 or 2"),
        (dict(kv_source_layer_ids=[1, 2, 8, 14, 20]), r"kv_source_layer_ids: layer 1 has compress ratio 0"),
        (
            dict(index_source_layer_ids=[2, 8, 14, 20, 41]),
            r"index_source_layer_ids: 41 is not a backbone layer \(0\.\.39\)",
        ),
        (dict(candidate_source_layer_id=24), r"candidate_source_layer_id 24 is not a KV source that runs an indexer"),
        (dict(kv_source_layer_ids=[8, 14, 20]), r"layer 2 has compress ratio 2 but no KV source at or before it"),
        (
            dict(kv_source_layer_ids=[2, 8, 14], candidate_source_layer_id=-1),
            r"layer 20 has compress ratio 1 but its KV source 14 has ratio 2",
        ),
        (
            dict(index_source_layer_ids=[8, 14, 20, 24, 28, 32, 36]),
            r"layer 2 reuses a top-k selection, but no index source at or before it reads its KV source 2",
        ),
        (dict(engram_num_embeddings=[1]), r"engram_num_embeddings has 1 entries for 2 engram layers"),
        (
            dict(
                engram_layer_ids=[1, 40],
            ),
            r"engram layer 40 is not a backbone layer",
        ),
        (dict(engram_layer_ids=[1, 1]), r"engram_layer_ids has duplicates: \[1, 1\]"),
        (dict(engram_pad_token_id=129280), r"engram_pad_token_id 129280 is not a token id \(0\.\.129279\)"),
        (dict(norm_topk_prob=False), r"norm_topk_prob must be true"),
        (dict(scoring_func="sigmoid"), r"scoring_func 'sigmoid' is not supported"),
        (dict(index_topk=0), r"index_topk must be positive, got 0"),
        (dict(num_key_value_heads=2), r"num_key_value_heads must be 1"),
        (dict(o_groups=7), r"num_attention_heads 64 is not a multiple of o_groups 7"),
        (dict(tie_word_embeddings=True), r"tie_word_embeddings must be false"),
        (dict(compress_ratios="0,0,2"), r"compress_ratios must be a list, got '0,0,2'"),
    ],
)
def test_validation_errors_are_precise(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        ModelArgs.from_dict(_flash(**text))
    assert "\n" not in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        ModelArgs.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"not valid JSON \(.* at line 1\)"):
        ModelArgs.from_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="text_config must be a JSON object"):
        ModelArgs.from_dict({"text_config": [1]})
