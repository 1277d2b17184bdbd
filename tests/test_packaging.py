"""Everything pip installs is under the `mlx_dsv41` namespace (docs/design.md#one-namespace).

`python -m` puts the working directory first on the import path, so a top-level module of ours
named like a user's file (an exllamav3 checkout has a `convert.py`) would be shadowed by it. The
wheel holds only the package (and the cache hook, which must sit at the top of site-packages),
and none of the stand-in headers that only CI compiles against.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from mlx_dsv41.demo import CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent
# Files the wheel may hold outside mlx_dsv41/: the mlx-lm cache hook and its .pth (setup.py).
TOP_LEVEL_ALLOWED = {"mlx_dsv41_cache_hook.py", "mlx_dsv41_cache_hook.pth"}


def _foreign_dir(tmp_path: Path) -> Path:
    """A working directory holding a `convert.py` and a `metal_ext.py` that fail when imported."""
    here = tmp_path / "foreign"
    here.mkdir()
    for name in ("convert", "metal_ext"):
        (here / f"{name}.py").write_text(f'raise RuntimeError("imported the foreign {name}.py")\n')
    return here


def _run_in(cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_front_ends_ignore_foreign_modules_in_the_working_directory(tmp_path):
    """The demo is built from scratch there (tiny checkpoints, the converter, the kernels'
    registry) and generates; the converter's command line answers --help."""
    cwd = _foreign_dir(tmp_path)
    # PYTHONPATH: this checkout, whether or not it is installed; CACHE_ENV: a fresh demo.
    env = {**os.environ, "PYTHONPATH": str(ROOT), CACHE_ENV: str(tmp_path / "cache")}
    r = _run_in(cwd, env, "-m", "mlx_dsv41.generate", "--demo", "--prompt", "Hello", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "cache").is_dir()  # the demo was built here, through the converter
    r = _run_in(cwd, env, "-m", "mlx_dsv41.convert", "--help")
    assert r.returncode == 0 and "Usage: python -m mlx_dsv41.convert" in r.stdout, r.stderr[-3000:]


def _source_copy(dest: Path) -> Path:
    """The checkout's files (tracked, or untracked and not ignored) copied to dest, so that the
    build's outputs (build/, *.egg-info) do not land in the checkout."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_wheel_holds_only_the_package(tmp_path):
    src = _source_copy(tmp_path / "src")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mlx_dsv41-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith(("mlx_dsv41/", "mlx_dsv41-")) and n not in TOP_LEVEL_ALLOWED]
    assert not outside, outside
    assert TOP_LEVEL_ALLOWED <= set(names)  # the hook still ships (mlx_dsv41_cache_hook.py says why)
    dist_info = {n.split("/")[0] for n in names if n.startswith("mlx_dsv41-")}
    assert len(dist_info) == 1 and dist_info.pop().endswith(".dist-info")
    # The kernel sources the loaders read at run time are there; the CI stand-ins are not.
    sources = {Path(n).name for n in names if n.startswith("mlx_dsv41/metal_ext/")}
    on_disk = {p.name for p in (ROOT / "mlx_dsv41" / "metal_ext").iterdir() if p.suffix in (".metal", ".h")}
    assert on_disk and on_disk <= sources
    stubs = {p.name for p in (ROOT / "tests" / "kernel_stubs").rglob("*") if p.is_file()}
    assert stubs and not stubs & {Path(n).name for n in names}
    assert not [n for n in names if "kernel_stub" in n or "source_check" in n or "/ci/" in n]


def test_console_scripts_resolve():
    """Every [project.scripts] entry names a callable that exists (pip writes the script blind)."""
    import importlib
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr, None)), f"{name} = {target!r}"
