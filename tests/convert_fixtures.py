"""Shared helpers of the converter / loader tests: run the CLI, edit a tiny checkpoint's tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from convert.safetensors_io import SafetensorsFile
from convert.safetensors_writer import write_safetensors

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlx_dsv41.convert ARGS` in a fresh process (no progress bars: --quiet)."""
    return subprocess.run([sys.executable, "-m", "mlx_dsv41.convert", *map(str, args), "--quiet"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})},
                          timeout=120)


def shard_of(ckpt: Path, name: str) -> Path:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return ckpt / weight_map[name]


def edit_tensors(ckpt: Path, changes: dict[str, tuple[str, np.ndarray] | None]) -> None:
    """Rewrite the shards holding the named tensors: replace each with (dtype, raw array), or drop
    it (None); the index follows."""
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted({shard_of(ckpt, name) for name in changes}):
        with SafetensorsFile(shard) as f:
            tensors = {n: (f.info(n).dtype, f.read(n)) for n in f.names()}
        for name, new in changes.items():
            if name in tensors:
                if new is None:
                    del tensors[name]
                    del index["weight_map"][name]
                else:
                    tensors[name] = new
        write_safetensors(shard, tensors)
    index_file.write_text(json.dumps(index))


def read_tensor(ckpt: Path, name: str) -> tuple[str, np.ndarray]:
    with SafetensorsFile(shard_of(ckpt, name)) as f:
        return f.info(name).dtype, f.read(name)


def add_tensors(ckpt: Path, next_to: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Add tensors {name: (dtype, raw array)} to the shard holding `next_to`; the index follows."""
    shard = shard_of(ckpt, next_to)
    with SafetensorsFile(shard) as f:
        stored = {n: (f.info(n).dtype, f.read(n)) for n in f.names()}
    write_safetensors(shard, {**stored, **tensors})
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    index_file.write_text(json.dumps(index))
