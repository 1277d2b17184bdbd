"""Shared helpers of the converter / loader tests: run the CLI, convert a tiny EXL3 checkpoint,
edit a tiny checkpoint's tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from mlx_dsv41.convert import convert_checkpoint
from mlx_dsv41.convert.safetensors_io import SafetensorsFile
from mlx_dsv41.convert.safetensors_writer import write_safetensors
from mlx_dsv41.synthetic_checkpoints import write_engram_shards, write_exl3_checkpoint

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlx_dsv41.convert ARGS` in a fresh process (no progress bars: --quiet)."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_dsv41.convert", *map(str, args), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def convert_tiny_exl3(root: Path):
    """The tiny EXL3 checkpoint in root/src, its Engram tables as the official release's shards in
    root/engram, and its conversion in root/out; returns the TinyCheckpoint."""
    ck = write_exl3_checkpoint(root / "src")
    write_engram_shards(root / "engram", ck.args, ck.tables)
    convert_checkpoint(ck.path, root / "out", engram_from=root / "engram", progress=False)
    return ck


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / _index(ckpt)["weight_map"][name]


def _shard_tensors(shard: Path) -> dict[str, tuple[str, np.ndarray]]:
    with SafetensorsFile(shard) as f:
        return {n: (f.info(n).dtype, f.read(n)) for n in f.names()}


def edit_tensors(ckpt: Path, changes: dict[str, tuple[str, np.ndarray] | None]) -> None:
    """Rewrite the shards holding the named tensors: replace each with (dtype, raw array), or drop
    it (None); the index follows."""
    index = _index(ckpt)
    for shard in sorted({shard_of(ckpt, name) for name in changes}):
        tensors = _shard_tensors(shard)
        for name, new in changes.items():
            if name in tensors:
                if new is None:
                    del tensors[name]
                    del index["weight_map"][name]
                else:
                    tensors[name] = new
        write_safetensors(shard, tensors)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def read_tensor(ckpt: Path, name: str) -> tuple[str, np.ndarray]:
    with SafetensorsFile(shard_of(ckpt, name)) as f:
        return f.info(name).dtype, f.read(name)


def add_tensors(ckpt: Path, next_to: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Add tensors {name: (dtype, raw array)} to the shard holding `next_to`; the index follows."""
    shard = shard_of(ckpt, next_to)
    write_safetensors(shard, {**_shard_tensors(shard), **tensors})
    index = _index(ckpt)
    index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
