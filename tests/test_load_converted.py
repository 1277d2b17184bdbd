"""mlx_dsv41.load on converted directories: what a directory is (`checkpoint_kind`), and every
broken converted directory gives a one-line LoadError naming the file."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from convert_fixtures import convert_tiny_exl3

import mlx_dsv41
from mlx_dsv41 import layout
from mlx_dsv41.loading import LoadError, checkpoint_kind, is_converted


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    convert_tiny_exl3(root)
    return root


@pytest.fixture
def broken(converted, tmp_path):
    return shutil.copytree(converted / "out", tmp_path / "out")


def _fails(path, message, **kwargs):
    with pytest.raises(LoadError) as err:
        mlx_dsv41.load(path, **kwargs)
    assert "\n" not in str(err.value) and message in str(err.value), str(err.value)


def test_load_returns_a_working_pair(converted):
    model, tokenizer = mlx_dsv41.load(converted / "out", lazy=True)
    ids = tokenizer.encode("w3 w4 W5 w7")
    assert ids == [3, 4, 122, 7]  # "W5" is the uppercase variant 122 (mlx_dsv41.synthetic_checkpoints)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, 4, 160) and np.isfinite(np.array(logits)).all()
    assert tokenizer.eos_token_ids == {1}


def test_load_prints_no_transformers_warning(converted):
    """transformers' "You are using a model of type ..." (its config class has no deepseek_v41) is
    dropped: the load is silent, in a fresh process with transformers' default verbosity."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    code = f"import mlx_dsv41; mlx_dsv41.load({str(converted / 'out')!r}, lazy=True)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_converted_tokenizer_renders_the_official_chat_encoding(converted):
    from mlx_dsv41 import chat

    _, tokenizer = mlx_dsv41.load(converted / "out", lazy=True)
    messages = [{"role": "user", "content": "w3 w4"}]
    for thinking in (True, False):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert rendered == chat.render(messages, thinking=thinking)


def test_kinds(converted, tmp_path):
    assert checkpoint_kind(converted / "out") == "converted" and checkpoint_kind(converted / "src") == "exl3"
    assert not is_converted(converted / "src") and not is_converted(tmp_path)
    with pytest.raises(LoadError, match="no config.json"):
        checkpoint_kind(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(LoadError, match="model_type 'llama' is not DeepSeek-V4.1"):
        checkpoint_kind(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(LoadError, match="config.json: not valid JSON"):
        checkpoint_kind(tmp_path)


def test_unconverted_sources_say_how_to_convert(converted):
    _fails(
        converted / "src",
        "is an exl3 checkpoint, not a converted one; convert it first: "
        f"python -m mlx_dsv41.convert {converted / 'src'} OUT --engram-from",
    )


def test_missing_shard(broken):
    (broken / layout.shard_name(2, 2)).unlink()
    _fails(broken, f"{layout.shard_name(2, 2)}: shard listed in model.safetensors.index.json is missing")


def test_truncated_shard(broken):
    shard = broken / layout.shard_name(1, 2)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    _fails(broken, f"{layout.shard_name(1, 2)}: truncated")


def test_missing_row_file(broken):
    (broken / layout.engram_rows_file(2)).unlink()
    _fails(broken, "engram.layers.2.rows: no Engram row file")


def test_swapped_row_files(broken):
    a, b = broken / layout.engram_rows_file(1), broken / layout.engram_rows_file(2)
    a.rename(broken / "tmp")
    b.rename(a)
    _fails(broken, "engram.layers.1.rows: holds Engram layer 2, expected layer 1")


def test_row_file_of_another_conversion(broken):
    config = json.loads((broken / "config.json").read_text())
    config["mlx_dsv41"]["engram"]["layers"]["1"]["data_sha256"] = "0" * 64
    (broken / "config.json").write_text(json.dumps(config))
    _fails(broken, "engram.layers.1.rows: its checksum differs from the one recorded in config.json")


def test_token_map_not_of_this_tokenizer(broken):
    tok = broken / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"w3"', '"w3x"'))
    _fails(broken, "engram_token_map.json: was not built from this directory's tokenizer.json")
    (broken / layout.TOKEN_MAP).write_text("[1, 2]")
    _fails(broken, "engram_token_map.json: not a token map of format 1")
    (broken / layout.TOKEN_MAP).unlink()
    _fails(broken, "engram_token_map.json: missing")


def test_unfinished_conversion(broken):
    (broken / layout.STATE).write_text("{}")
    _fails(broken, "unfinished conversion; rerun `python -m mlx_dsv41.convert`")


def test_newer_layout_version(broken):
    config = json.loads((broken / "config.json").read_text())
    config["mlx_dsv41"]["format_version"] = 99
    (broken / "config.json").write_text(json.dumps(config))
    _fails(broken, "converted layout version 99, this mlx_dsv41 reads version 1")


def test_bad_engram_mode_and_missing_directory(converted, tmp_path):
    _fails(converted / "out", "mode 'fast' is not one of", engram_mode="fast")
    _fails(tmp_path / "nope", "nope: no such directory")
