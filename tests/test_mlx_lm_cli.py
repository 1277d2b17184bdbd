"""mlx-lm's own command lines on the demo checkpoint (`--trust-remote-code`, subprocesses): a prompt
cache saved by `mlx_lm cache_prompt` continues in `mlx_lm generate --prompt-cache-file` exactly
as one prefill would (the cache classes reach mlx-lm through mlx_dsv41_cache_hook.pth), `mlx_lm
chat` runs, and without mlx_dsv41 the checkpoint says how to install it from its source."""

import re
import subprocess
import sys
from pathlib import Path

from demo_helpers import REPO, demo_checkpoint, detokenize, greedy

from mlx_dsv41 import chat

TOKENS = 4


def mlx_lm(env, *args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm", *args],
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_prompt_cache_hook_is_installed_and_imports_nothing():
    """Any program that imports mlx_lm.models.cache finds stand-ins for our classes there, and
    mlx_dsv41 itself stays unimported until a file of ours is read."""
    site = [Path(p) for p in sys.path if p.endswith("site-packages")]
    assert any((p / "mlx_dsv41_cache_hook.pth").is_file() for p in site), (
        "mlx_dsv41_cache_hook.pth is not installed: reinstall the package (pip install -e .)"
    )
    code = (
        "import sys, mlx_lm.models.cache as c; "
        "print(c.LayerCache.mlx_dsv41_stand_in, c.EngramHistory.mlx_dsv41_stand_in, 'mlx_dsv41' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["True", "True", "False"], r.stderr


def test_cache_prompt_then_generate_from_the_file(env, loaded, tmp_path_factory, tmp_path):
    """`cache_prompt` caches [user: P] (mlx-lm's chat template: no answer header); `generate`
    appends S and the header (its "<query>" trick) and must continue exactly like a fresh prefill."""
    model, tokenizer = loaded
    path, file = demo_checkpoint(tmp_path_factory), tmp_path / "prompt.safetensors"
    cached, suffix = "The cat sat on the mat.", " What did the cat do?"
    r = mlx_lm(
        env,
        "cache_prompt",
        "--model",
        str(path),
        "--trust-remote-code",
        "--prompt",
        cached,
        "--prompt-cache-file",
        str(file),
    )
    assert r.returncode == 0 and file.is_file(), r.stderr
    r = mlx_lm(
        env,
        "generate",
        "--prompt-cache-file",
        str(file),
        "--trust-remote-code",
        "--prompt",
        suffix,
        "--max-tokens",
        str(TOKENS),
    )
    assert r.returncode == 0, r.stderr
    prefix = chat.encode(tokenizer, [{"role": "user", "content": cached}], add_generation_prompt=False)
    ids = prefix + chat.encode_continuation(tokenizer, suffix, thinking=True)
    text = re.search(r"^==========\n(.*)\n==========$", r.stdout, re.M | re.S).group(1)
    assert text == detokenize(tokenizer, greedy(model, tokenizer, ids, TOKENS))


def test_mlx_lm_chat_runs_on_the_checkpoint(env, tmp_path_factory):
    r = mlx_lm(
        env,
        "chat",
        "--model",
        str(demo_checkpoint(tmp_path_factory)),
        "--trust-remote-code",
        "--max-tokens",
        "2",
        stdin="Hello\nq\n",
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_without_mlx_dsv41_the_checkpoint_says_how_to_install_it(env, tmp_path_factory, tmp_path):
    """A package named mlx_dsv41 that fails to import stands in for a missing one."""
    (tmp_path / "mlx_dsv41").mkdir()
    (tmp_path / "mlx_dsv41" / "__init__.py").write_text("raise ImportError('No module named mlx_dsv41')\n")
    code = f"import mlx_lm; mlx_lm.load({str(demo_checkpoint(tmp_path_factory))!r}, trust_remote_code=True)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode != 0
    message = r.stderr.strip().splitlines()[-1]
    assert "pip install -e" in message and "source directory" in message, message
    assert "pip install mlx_dsv41" not in message
