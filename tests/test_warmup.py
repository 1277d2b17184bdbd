"""`python -m mlx_dsv41.warmup` (issue 17 item 2): builds what a first request needs on the demo
(full and partial prefill chunks, decoding, DSpark), reports both passes (each with its time to the
first token) and where the backend keeps
compiled kernels, writes nothing to stdout but that line; a bad --model is one line and exit 1."""

import re
import subprocess
import sys

from demo_helpers import REPO, demo_env


def warmup(env, *args):
    command = [sys.executable, "-m", "mlx_dsv41.warmup", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_warmup_on_the_demo(tmp_path_factory):
    r = warmup(demo_env(tmp_path_factory), "--demo", "--tokens", "24", "--prefill-step-size", "16")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line
    ttft = r"\(first token after [\d.]+ s"
    passes = rf"first pass [\d.]+ s {ttft}\), then [\d.]+ s {ttft}: a warm process's time to first token\)"
    assert re.fullmatch(rf"Warmed up \S+ for prompts of 24 tokens: {passes}\. Compiled kernels are kept in: .+", line)


def test_a_bad_model_is_one_line(tmp_path):
    r = warmup(None, "--model", str(tmp_path / "missing"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no such directory" in r.stderr
