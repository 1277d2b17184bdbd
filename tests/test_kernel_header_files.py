"""CUDA kernel headers as files on disk (kernels/header_files.py, docs/design.md#kernel-header-files):
the source MLX holds (and hashes at every launch) is one #include line; the file holds exactly the
header text, named by its hash; `inline` and an unwritable directory keep the text."""

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dsv41 import kernels
from mlx_dsv41.kernels import header_files as hf


def test_the_header_is_a_file_named_by_its_text(tmp_path, monkeypatch):
    monkeypatch.setenv(hf.ENV_VAR, str(tmp_path / "h"))
    line = hf.cuda_header("k", "#define A 1\n")
    assert line.startswith('#include "') and line.endswith('"\n') and len(line) < 200
    path = Path(line[len('#include "') : -2])
    assert path.parent == (tmp_path / "h").resolve() and path.read_text() == "#define A 1\n"
    assert hf.cuda_header("k", "#define A 1\n") == line  # the same text: the same file, not rewritten
    other = hf.cuda_header("k", "#define A 2\n")
    assert other != line and Path(other[10:-2]).read_text() == "#define A 2\n"
    assert sorted(p.name.startswith(".") for p in (tmp_path / "h").iterdir()) == [False, False]  # no temp files left


def test_a_damaged_file_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv(hf.ENV_VAR, str(tmp_path))
    line = hf.cuda_header("k", "int x;\n")
    path = line[10:-2]
    open(path, "w").write("int x")  # cut short
    assert hf.cuda_header("k", "int x;\n") == line and open(path).read() == "int x;\n"


def test_inline_and_an_unwritable_directory_keep_the_text(tmp_path, monkeypatch):
    monkeypatch.setenv(hf.ENV_VAR, "inline")
    assert hf.cuda_header("k", "int x;\n") == "int x;\n"
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(hf.ENV_VAR, str(blocker / "sub"))  # a directory under a file cannot be made
    assert hf.cuda_header("k", "int x;\n") == "int x;\n"
    monkeypatch.setenv(hf.ENV_VAR, str(tmp_path / 'a"b'))  # not an #include's path
    assert hf.cuda_header("k", "int x;\n") == "int x;\n"


def test_the_default_directory_is_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.delenv(hf.ENV_VAR, raising=False)
    monkeypatch.setenv("MLX_DSV41_CACHE", str(tmp_path))
    assert hf.directory() == tmp_path / "kernel-headers"


@pytest.mark.parametrize("name", sorted(kernels.load_all()))
def test_every_cuda_kernel_is_handed_its_pruned_header_by_path(name, tmp_path, monkeypatch):
    """What MLX receives for CUDA: the body as Kernel.source gives it and a one-line header whose
    file is Kernel.source's header; Metal gets the text itself."""
    monkeypatch.setenv(hf.ENV_VAR, str(tmp_path))
    got = {}
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: got.setdefault("cuda", kw))
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: got.setdefault("metal", kw))
    k = kernels.REGISTRY[name]
    monkeypatch.setattr(k, "_built", {})
    k._compiled("cuda")
    k._compiled("metal")
    header, body = k.source("cuda")
    assert got["cuda"]["source"] == body and len(got["cuda"]["header"]) < 300
    assert open(got["cuda"]["header"][10:-2]).read() == header
    assert got["metal"]["header"] == k.source("metal")[0]
