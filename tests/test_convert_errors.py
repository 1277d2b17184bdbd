"""Every bad input to `python -m mlx_dsv41.convert` (a fresh process each): exit status 1, one line
`error: ...` on stderr naming what is wrong, no traceback, and nothing loadable left behind."""

import json
import re
import shutil
import struct

import numpy as np
import pytest
from convert_fixtures import add_tensors, edit_tensors, run_cli, shard_of

from mlx_dsv41 import layout
from mlx_dsv41.loading import is_converted
from mlx_dsv41.synthetic import tiny_args
from mlx_dsv41.synthetic_checkpoints import write_engram_shards, write_exl3_checkpoint, write_official_checkpoint


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    write_official_checkpoint(root / "official")
    exl3 = write_exl3_checkpoint(root / "exl3")
    write_engram_shards(root / "engram", exl3.args, exl3.tables)
    return root


@pytest.fixture
def official(sources, tmp_path):
    """A fresh copy of the official checkpoint to break."""
    return shutil.copytree(sources / "official", tmp_path / "src")


def _fails(src, out, message, *extra):
    result = run_cli(src, out, *extra)
    err = result.stderr
    assert result.returncode == 1, (result.returncode, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    assert not is_converted(out) and not is_converted(layout.partial_dir(out))
    return err


def test_missing_shard(official, tmp_path):
    (official / "model-00002-of-00004.safetensors").unlink()
    _fails(official, tmp_path / "out", "shard model-00002-of-00004.safetensors is missing (")


def test_truncated_safetensors(official, tmp_path):
    shard = official / "model-00001-of-00004.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    _fails(official, tmp_path / "out", "model-00001-of-00004.safetensors: truncated")


def test_header_that_lies_about_sizes(official, tmp_path):
    shard = shard_of(official, "norm.weight")
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["norm.weight"]["shape"] = [header["norm.weight"]["shape"][0] * 2]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    shard.write_bytes(raw[:8] + text + raw[8 + n :])
    _fails(official, tmp_path / "out", "tensor 'norm.weight': header lies about its size")


def test_wrong_quant_method(official, tmp_path):
    config = json.loads((official / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (official / "config.json").write_text(json.dumps(config))
    _fails(official, tmp_path / "out", "quantization_config.quant_method 'gptq' is not supported")


@pytest.mark.parametrize(
    "name,new,message",
    [
        (
            "layers.1.attn.wkv.weight",
            ("F8_E4M3", np.ones((64, 96), np.uint8)),
            "layers.1.attn.wkv.weight: shape [64, 96], expected [64, 64]",
        ),
        (
            "layers.1.attn.wkv.scale",
            ("F8_E8M0", np.full((2, 3), 127, np.uint8)),
            "layers.1.attn.wkv.scale: shape [2, 3], expected [2, 2]",
        ),
        (
            "layers.2.attn.attn_sink",
            ("BF16", np.ones(4, np.uint16)),
            "layers.2.attn.attn_sink: dtype BF16, expected F32 (fp32 in the release, docs/numerics.md#dtypes)",
        ),
        (
            "layers.0.ffn.experts.3.w2.weight",
            ("F8_E5M2", np.ones((64, 32), np.uint8)),
            "layers.0.ffn.experts.3.w2.weight: dtype F8_E5M2, expected F8_E4M3",
        ),
        (
            "layers.5.ffn_norm.weight",
            ("I32", np.ones(64, np.int32)),
            "layers.5.ffn_norm.weight: dtype I32, expected F16 or BF16 or F32",
        ),
        ("layers.4.ffn.gate.weight", None, "missing tensor layers.4.ffn.gate.weight"),
    ],
)
def test_wrong_tensor(official, tmp_path, name, new, message):
    edit_tensors(official, {name: new})
    _fails(official, tmp_path / "out", message)


def test_unexpected_tensor(official, tmp_path):
    add_tensors(official, "norm.weight", {"layers.3.attn.indexer.wq_b.weight": ("BF16", np.ones((64, 32), np.uint16))})
    _fails(official, tmp_path / "out", "unexpected tensor layers.3.attn.indexer.wq_b.weight")


def test_missing_engram_tables(sources, tmp_path):
    err = _fails(sources / "exl3", tmp_path / "out", "no Engram table layers.1.engram.embed.weight")
    assert "model-00047-of-00048" in err and "--engram-from" in err
    _fails(
        sources / "exl3",
        tmp_path / "out",
        "no Engram table layers.1.engram.embed.weight",
        "--engram-from",
        sources / "exl3",
    )
    _fails(
        sources / "exl3",
        tmp_path / "out",
        "config.json: header length",
        "--engram-from",
        sources / "official" / "config.json",
    )


def test_missing_engram_shard_of_the_official_release(official, tmp_path):
    (official / "model-00003-of-00004.safetensors").unlink()
    err = _fails(
        official,
        tmp_path / "out",
        "shard model-00003-of-00004.safetensors holding layers.1.engram.embed.weight is missing",
    )
    assert "--engram-from" in err


def test_engram_table_with_the_wrong_row_count(sources, tmp_path):
    ck_args = tiny_args()
    tables = {
        layer: rows[:-1] if layer == 2 else rows
        for layer, rows in write_official_checkpoint(tmp_path / "tmp").tables.items()
    }
    write_engram_shards(tmp_path / "engram", ck_args, tables)
    rows = ck_args.engram_num_embeddings[1]
    _fails(
        sources / "exl3",
        tmp_path / "out",
        f"{rows - 1} rows but the config's engram_num_embeddings for layer 2 is {rows}",
        "--engram-from",
        tmp_path / "engram",
    )


def test_output_that_is_not_ours(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _fails(sources / "official", out, "exists and is not a converted checkpoint")
    assert (out / "notes.txt").read_text() == "mine"
    partial = layout.partial_dir(tmp_path / "out2")
    partial.mkdir()
    (partial / "x").write_text("mine")
    _fails(sources / "official", tmp_path / "out2", "exists and was not written by this conversion")


def test_bad_options(sources, tmp_path):
    _fails(
        sources / "exl3",
        tmp_path / "out",
        "--dtype applies to official FP8/FP4 sources",
        "--dtype",
        "bf16",
        "--engram-from",
        sources / "engram",
    )
    _fails(sources / "official", tmp_path / "out", "dtype 'fp16' is not supported", "--dtype", "fp16")
    _fails(tmp_path / "nowhere", tmp_path / "out", "nowhere: no such directory")


def test_not_enough_disk_space_is_refused_before_writing(sources, tmp_path):
    """The CLI in a fresh process whose disk reports 1 MB free: one line saying how much the
    conversion needs, exit 1, and neither OUT nor OUT.partial created."""
    import subprocess
    import sys

    from convert_fixtures import REPO

    out = tmp_path / "out"
    code = (
        "import shutil, sys; real = shutil.disk_usage; shutil.disk_usage = lambda p: real(p)._replace(free=10**6); "
        "from mlx_dsv41.convert.cli import main; sys.argv[0] = 'convert'; main()"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(sources / "exl3"),
            str(out),
            "--engram-from",
            str(sources / "engram"),
            "--quiet",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert re.fullmatch(
        rf"error: not enough free disk space for {out}: the conversion writes \d+\.\d GB, "
        rf"{tmp_path} has 0\.0 GB free\n",
        r.stderr,
    ), r.stderr
    assert not out.exists() and not layout.partial_dir(out).exists()


def test_the_space_estimate_covers_what_is_written(sources, tmp_path):
    from mlx_dsv41.convert import convert_checkpoint
    from mlx_dsv41.convert.checkpoint import SPACE_MARGIN, output_bytes
    from mlx_dsv41.convert.plan import plan_steps
    from mlx_dsv41.convert.source import open_source

    out = convert_checkpoint(sources / "exl3", tmp_path / "out", engram_from=sources / "engram", progress=False)
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    source = open_source(sources / "exl3", sources / "engram")
    try:
        estimate = output_bytes(source, plan_steps(source, None))
    finally:
        source.close()
    assert written <= estimate <= written + SPACE_MARGIN
