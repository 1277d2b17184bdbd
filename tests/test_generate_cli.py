"""`python -m mlx_dsv41.generate` through a subprocess, on the demo checkpoint: plain, chat and
stdin prompts stream exactly the tokens of our own greedy loop, with DSpark drafting (the default)
or not (--draft 0); the statistics are printed; an
EXL3 directory is converted when asked to; every bad input is one line on stderr, exit code 1,
no traceback."""

import re
import shutil
import subprocess
import sys

import pytest
from demo_helpers import REPO, demo_checkpoint, detokenize, env, greedy, loaded  # noqa: F401 (module fixtures)

import mlx_dsv41
from mlx_dsv41 import chat

TOKENS = 4


def cli(env, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", "mlx_dsv41.generate", *args], cwd=REPO, env=env,
                          input=stdin if stdin is not None else "", capture_output=True, text=True,
                          timeout=300)


def expected_text(loaded, ids: list[int]) -> str:
    """What our own greedy loop generates from `ids`, detokenized as mlx-lm streams it."""
    model, tokenizer = loaded
    return detokenize(tokenizer, greedy(model, tokenizer, ids, TOKENS))


def ok(result):
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


def test_plain_prompt_streams_our_tokens_and_reports(env, loaded):
    r = ok(cli(env, "--demo", "--prompt", "The quick brown fox", "--max-tokens", str(TOKENS)))
    assert r.stdout == expected_text(loaded, loaded[1].encode("The quick brown fox")) + "\n"
    err = r.stderr
    assert "SYNTHETIC RANDOM WEIGHTS" in err and "meaningless" in err
    n_prompt = len(loaded[1].encode("The quick brown fox"))
    assert re.search(rf"Prompt: {n_prompt} tokens, [\d.]+ tokens-per-sec", err)
    assert re.search(rf"Generation: {TOKENS} tokens, [\d.]+ tokens-per-sec", err)
    assert re.search(r"Peak memory: [\d.]+ GB", err)
    rows = int(re.search(r"Engram: (\d+) rows, [\d.]+ [KM]?B read", err).group(1))
    columns = 2 * loaded[0].args.engram_columns
    assert rows >= (n_prompt + TOKENS - 1) * columns and rows % columns == 0
    assert re.search(r"Attention: (reference|serial|parallel) \d+", err)
    assert re.search(r"DSpark: [\d.]+ tokens per main forward \(\d+ forwards\), acceptance by position "
                     r"1: \d+%.*\(meaningless: synthetic weights\)", err)


def test_draft_0_turns_dspark_off_with_the_same_tokens(env, loaded):
    r = ok(cli(env, "--demo", "--prompt", "The quick brown fox", "--max-tokens", str(TOKENS), "--draft", "0"))
    assert r.stdout == expected_text(loaded, loaded[1].encode("The quick brown fox")) + "\n"
    assert "DSpark" not in r.stderr


def test_chat_prompt_uses_the_official_encoding(env, loaded):
    r = ok(cli(env, "--demo", "--chat", "--no-thinking", "--system", "Be brief.", "--prompt",
               "What is two plus two?", "--max-tokens", str(TOKENS)))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]
    ids = chat.encode(loaded[1], msgs, thinking=False)
    assert f"Prompt: {len(ids)} tokens" in r.stderr
    assert r.stdout == expected_text(loaded, ids) + "\n"
    r = ok(cli(env, "--demo", "--chat", "--effort", "max", "--prompt", "Why?", "--max-tokens", "1"))
    ids = chat.encode(loaded[1], [{"role": "user", "content": "Why?"}], thinking=True, effort=100)
    assert f"Prompt: {len(ids)} tokens" in r.stderr


def test_prompt_from_stdin_or_a_file(env, loaded, tmp_path):
    want = expected_text(loaded, loaded[1].encode("Hello! How are you?")) + "\n"
    r = ok(cli(env, "--demo", "--max-tokens", str(TOKENS), "--temp", "0", stdin="Hello! How are you?"))
    assert r.stdout == want
    (tmp_path / "prompt.txt").write_text("Hello! How are you?")
    r = ok(cli(env, "--demo", "--max-tokens", str(TOKENS), "--prompt-file", str(tmp_path / "prompt.txt")))
    assert r.stdout == want


def one_line_error(result, pattern):
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args,pattern", [
    (["--model", "/nonexistent/dsv41", "--prompt", "hi"], r"--model /nonexistent/dsv41: no such directory"),
    (["--prompt", "hi"], r"no model: pass --model DIR .* or --demo"),
    (["--demo", "--chat", "--effort", "101", "--prompt", "hi"], r"effort must be in 1\.\.100"),
    (["--demo", "--chat", "--effort", "medium", "--prompt", "hi"], r"low, high, max"),
    (["--demo", "--system", "x", "--prompt", "hi"], r"--system needs --chat"),
    (["--demo", "--model", "x", "--prompt", "hi"], r"either --model or --demo"),
    (["--demo", "--prompt-file", "/nonexistent/p.txt"], r"--prompt-file /nonexistent/p.txt: .*No such file"),
    (["--demo", "--draft", "many", "--prompt", "hi"], r"--draft many: expected a number of drafts"),
    (["--demo", "--draft", "9", "--prompt", "hi"], r"--draft 9: this checkpoint drafts at most 5 tokens"),
])
def test_bad_options_are_one_line_errors(env, args, pattern):
    one_line_error(cli(env, *args), pattern)


def test_a_checkpoint_without_the_draft_head_runs_and_says_so_once(env, tmp_path_factory, tmp_path, loaded):
    from convert_fixtures import edit_tensors

    plain = shutil.copytree(demo_checkpoint(tmp_path_factory), tmp_path / "no-dspark")
    index = (plain / "model.safetensors.index.json").read_text()
    edit_tensors(plain, dict.fromkeys([n for n in re.findall(r'"(mtp\.[^"]+)"', index)]))
    r = ok(cli(env, "--model", str(plain), "--prompt", "The quick brown fox", "--max-tokens", str(TOKENS)))
    assert r.stdout == expected_text(loaded, loaded[1].encode("The quick brown fox")) + "\n"
    assert r.stderr.count("no DSpark speculative decoding: the checkpoint has no DSpark weights (mtp.*)") == 1
    assert "DSpark:" not in r.stderr


def test_offline_hub_repo_is_a_clear_error(env, tmp_path):
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    one_line_error(cli(offline, "--model", "nobody-here/no-such-model", "--prompt", "hi"),
                   r"cannot fetch 'nobody-here/no-such-model' .*offline.*local directory")


def test_broken_checkpoint_is_a_one_line_error(env, tmp_path_factory, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(demo_checkpoint(tmp_path_factory), broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    one_line_error(cli(env, "--model", str(broken), "--prompt", "hi"), r"cannot load .*broken.*00002")
    (broken / "config.json").write_text("{ not json")
    one_line_error(cli(env, "--model", str(broken), "--prompt", "hi"), r"config\.json.*not valid JSON")


def test_exl3_directory_is_converted_on_request(env, tmp_path_factory, tmp_path, loaded):
    source = demo_checkpoint(tmp_path_factory).parent
    exl3, engram = source / "exl3", source / "official-engram"
    one_line_error(cli(env, "--model", str(exl3), "--prompt", "hi"),
                   r"is an exl3 checkpoint, not a converted one: convert it first .*--convert-to")
    out = tmp_path / "converted"
    r = ok(cli(env, "--model", str(exl3), "--convert-to", str(out), "--engram-from", str(engram),
               "--prompt", "The quick brown fox", "--max-tokens", str(TOKENS)))
    assert mlx_dsv41.loading.is_converted(out)
    assert r.stdout == expected_text(loaded, loaded[1].encode("The quick brown fox")) + "\n"


def test_interactive_conversion_offer(tmp_path_factory, tmp_path, monkeypatch):
    """On a terminal the CLI asks before converting (default no) into SRC-mlx next to the source."""
    from mlx_dsv41 import generate

    source = demo_checkpoint(tmp_path_factory).parent
    exl3 = tmp_path / "exl3"
    shutil.copytree(source / "exl3", exl3)
    asked = []
    monkeypatch.setattr(generate.typer, "confirm", lambda text, **kw: asked.append((text, kw)) or False)
    with pytest.raises(generate.CLIError, match=r"not converted; convert it with: python -m mlx_dsv41.convert"):
        generate.resolve_model(str(exl3), False, engram_from=source / "official-engram", interactive=True)
    assert asked and asked[0][1]["default"] is False and str(tmp_path / "exl3-mlx") in asked[0][0]
    monkeypatch.setattr(generate.typer, "confirm", lambda text, **kw: True)
    out = generate.resolve_model(str(exl3), False, engram_from=source / "official-engram", interactive=True)
    assert out == tmp_path / "exl3-mlx" and mlx_dsv41.loading.is_converted(out)
