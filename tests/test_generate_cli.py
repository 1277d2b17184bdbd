"""`python -m mlx_dsv41.generate` through a subprocess, on the demo checkpoint: plain, chat and
stdin prompts stream exactly the tokens of our own greedy loop, with DSpark drafting (the default)
or not (--draft 0); the statistics are printed; a prompt saved with --prompt-cache-file continues
exactly, drafting or not; --max-kv-size bounds the context; long prompts show their prefill
progress; on a terminal, control characters are escaped and special tokens dimmed; an EXL3
directory is converted when asked to; every bad input is one line on stderr, exit code 1, no
traceback; --help fits 80 columns."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from demo_helpers import REPO, demo_checkpoint, detokenize, greedy

import mlx_dsv41
from mlx_dsv41 import chat

TOKENS = 4


def cli(env, *args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_dsv41.generate", *args],
        cwd=REPO,
        env=env,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=300,
    )


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
    assert re.search(
        r"DSpark: [\d.]+ tokens per main forward \(\d+ forwards\), acceptance by position "
        r"1: \d+%.*\(meaningless: synthetic weights\)",
        err,
    )


def test_draft_0_turns_dspark_off_with_the_same_tokens(env, loaded):
    r = ok(cli(env, "--demo", "--prompt", "The quick brown fox", "--max-tokens", str(TOKENS), "--draft", "0"))
    assert r.stdout == expected_text(loaded, loaded[1].encode("The quick brown fox")) + "\n"
    assert "DSpark" not in r.stderr


def test_chat_prompt_uses_the_official_encoding(env, loaded):
    r = ok(
        cli(
            env,
            "--demo",
            "--chat",
            "--no-thinking",
            "--system",
            "Be brief.",
            "--prompt",
            "What is two plus two?",
            "--max-tokens",
            str(TOKENS),
        )
    )
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


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--model", "/nonexistent/dsv41", "--prompt", "hi"], r"--model /nonexistent/dsv41: no such directory"),
        (["--prompt", "hi"], r"no model: pass --model DIR .* or --demo"),
        (["--demo", "--chat", "--effort", "101", "--prompt", "hi"], r"effort must be in 1\.\.100"),
        (["--demo", "--chat", "--effort", "extreme", "--prompt", "hi"], r"minimal, low, medium, high, max"),
        (["--demo", "--system", "x", "--prompt", "hi"], r"--system needs --chat"),
        (["--demo", "--effort", "max", "--prompt", "hi"], r"--effort needs --chat"),
        (["--demo", "--no-thinking", "--prompt", "hi"], r"--thinking/--no-thinking needs --chat"),
        (["--demo", "--chat", "--no-thinking", "--effort", "low", "--prompt", "hi"], r"--effort needs thinking mode"),
        (
            ["--demo", "--max-kv-size", "3", "--prompt", "The quick brown fox"],
            r"--max-kv-size 3: the prompt alone is \d+ tokens",
        ),
        (["--demo", "--model", "x", "--prompt", "hi"], r"either --model or --demo"),
        (["--demo", "--prompt-file", "/nonexistent/p.txt"], r"--prompt-file /nonexistent/p.txt: .*No such file"),
        (["--demo", "--draft", "many", "--prompt", "hi"], r"--draft many: expected a number of drafts"),
        (["--demo", "--draft", "9", "--prompt", "hi"], r"--draft 9: this checkpoint drafts at most 5 tokens"),
    ],
)
def test_bad_options_are_one_line_errors(env, args, pattern):
    one_line_error(cli(env, *args), pattern)


def test_a_bad_compile_setting_is_a_one_line_error(env):
    one_line_error(
        cli({**env, "MLX_DSV41_COMPILE": "yes"}, "--demo", "--prompt", "hi"),
        r"MLX_DSV41_COMPILE must be 0 or 1; got 'yes'",
    )


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
    one_line_error(
        cli(offline, "--model", "nobody-here/no-such-model", "--prompt", "hi"),
        r"cannot fetch 'nobody-here/no-such-model' .*offline.*local directory",
    )


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
    one_line_error(
        cli(env, "--model", str(exl3), "--prompt", "hi"),
        r"is an exl3 checkpoint, not a converted one: convert it first .*--convert-to",
    )
    out = tmp_path / "converted"
    r = ok(
        cli(
            env,
            "--model",
            str(exl3),
            "--convert-to",
            str(out),
            "--engram-from",
            str(engram),
            "--prompt",
            "The quick brown fox",
            "--max-tokens",
            str(TOKENS),
        )
    )
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


def test_a_saved_prompt_continues_exactly(env, loaded, tmp_path):
    """Run 1 saves the prompt's caches (the file did not exist), and the DSpark state beside it;
    run 2 continues the saved prompt with its own text, prefilling only that, and drafts from the
    saved state: both give our greedy continuation of the whole."""
    model, tokenizer = loaded
    file = tmp_path / "doc.safetensors"
    first = ok(
        cli(
            env,
            "--demo",
            "--prompt",
            "The cat sat on the mat.",
            "--prompt-cache-file",
            str(file),
            "--max-tokens",
            str(TOKENS),
        )
    )
    ids = tokenizer.encode("The cat sat on the mat.")
    assert f"Saved the prompt's cache ({len(ids)} tokens) to {file}" in first.stderr
    assert first.stdout == expected_text(loaded, ids) + "\n"
    assert (tmp_path / "doc.dspark.safetensors").is_file() and "DSpark:" in first.stderr
    second = ok(
        cli(env, "--demo", "--prompt", " Then it slept.", "--prompt-cache-file", str(file), "--max-tokens", str(TOKENS))
    )
    more = tokenizer.encode(" Then it slept.", add_special_tokens=False)
    assert second.stdout == expected_text(loaded, ids + more) + "\n"
    assert re.search(
        rf"Prompt: {len(more) + 1} tokens, .* \(after {len(ids) - 1} from the prompt cache\)", second.stderr
    )
    assert "DSpark:" in second.stderr and "no DSpark" not in second.stderr


def test_a_saved_prompt_without_the_draft_state_continues_without_drafting(env, loaded, tmp_path):
    """Saved with --draft 0 (or by mlx-lm's cache_prompt), a file has no DSpark state beside it: the
    continuation says so once and decodes plainly, with the same tokens."""
    tokenizer = loaded[1]
    file = tmp_path / "plain.safetensors"
    ok(
        cli(
            env,
            "--demo",
            "--draft",
            "0",
            "--prompt",
            "The cat sat on the mat.",
            "--prompt-cache-file",
            str(file),
            "--max-tokens",
            "1",
        )
    )
    assert file.is_file() and not (tmp_path / "plain.dspark.safetensors").exists()
    r = ok(
        cli(env, "--demo", "--prompt", " Then it slept.", "--prompt-cache-file", str(file), "--max-tokens", str(TOKENS))
    )
    ids = tokenizer.encode("The cat sat on the mat.") + tokenizer.encode(" Then it slept.", add_special_tokens=False)
    assert r.stdout == expected_text(loaded, ids) + "\n"
    assert (
        r.stderr.count(
            "NOTE: no DSpark speculative decoding for this prompt: there is no "
            "plain.dspark.safetensors beside plain.safetensors"
        )
        == 1
    )
    assert "DSpark:" not in r.stderr


def test_a_saved_chat_prompt_continues_its_user_turn(env, loaded, tmp_path):
    model, tokenizer = loaded
    file = tmp_path / "chat.safetensors"
    ok(
        cli(
            env,
            "--demo",
            "--chat",
            "--effort",
            "max",
            "--prompt",
            "Read this: the cat sat.",
            "--prompt-cache-file",
            str(file),
            "--max-tokens",
            "1",
        )
    )
    r = ok(
        cli(
            env,
            "--demo",
            "--chat",
            "--prompt",
            " Who sat?",
            "--prompt-cache-file",
            str(file),
            "--max-tokens",
            str(TOKENS),
        )
    )
    opened = chat.encode(
        tokenizer, [{"role": "user", "content": "Read this: the cat sat."}], effort=100, add_generation_prompt=False
    )
    assert r.stdout == expected_text(loaded, opened + chat.encode_continuation(tokenizer, " Who sat?")) + "\n"
    one_line_error(
        cli(env, "--demo", "--prompt", "x", "--prompt-cache-file", str(file)), r"holds a chat prompt: add --chat"
    )
    one_line_error(
        cli(env, "--demo", "--chat", "--effort", "low", "--prompt", "x", "--prompt-cache-file", str(file)),
        r"reasoning effort 100; drop --effort",
    )
    (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
    one_line_error(
        cli(env, "--demo", "--prompt", "x", "--prompt-cache-file", str(tmp_path / "junk.safetensors")),
        r"junk.safetensors: not a prompt-cache file",
    )


def test_max_kv_size_bounds_the_context(env, loaded):
    ids = loaded[1].encode("The quick brown fox")
    r = ok(cli(env, "--demo", "--prompt", "The quick brown fox", "--max-kv-size", str(len(ids) + 2)))
    assert "Generation: 2 tokens" in r.stderr and "generating at most 2 tokens" in r.stderr
    assert r.stdout == detokenize(loaded[1], greedy(loaded[0], loaded[1], ids, 2)) + "\n"


def test_a_long_prompt_shows_its_prefill_progress(env, loaded):
    text = " ".join(["the cat sat on the mat"] * 60)
    n = len(loaded[1].encode(text))
    assert n >= 256
    r = ok(cli(env, "--demo", "--prompt", text, "--max-tokens", "1", "--prefill-step-size", "128"))
    done = [0, *range(128, n - 1, 128), n - 1]
    assert re.findall(rf"^Prefilling {n} tokens: (\d+)/{n}$", r.stderr, re.M) == [str(k) for k in done]


def test_on_a_terminal_control_characters_are_escaped_and_special_tokens_dimmed(env, loaded):
    """stdout is a pseudo-terminal; the expected text is mlx-lm's streamed segments of our greedy
    tokens, each shown as mlx_dsv41.terminal shows it. The demo continues this prompt with a
    special token and an ESC byte within 8 tokens."""
    import tty

    from mlx_dsv41.terminal import dim, visible

    model, tokenizer = loaded
    prompt, n = "What is two plus two?", 8
    master, slave = os.openpty()
    tty.setraw(slave)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dsv41.generate", "--demo", "--prompt", prompt, "--max-tokens", str(n)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    err = proc.communicate(timeout=300)[1].decode()
    os.close(master)
    assert proc.returncode == 0, err
    special = chat.special_token_ids(tokenizer)
    detok, want = tokenizer.detokenizer, ""
    tokens = greedy(model, tokenizer, tokenizer.encode(prompt), n)
    assert len(tokens) == n  # no end-of-sentence among them: every token is streamed as it comes
    for i, token in enumerate(tokens):
        detok.add_token(token)
        if i == n - 1:
            detok.finalize()
        want += dim(visible(detok.last_segment)) if token in special else visible(detok.last_segment)
    assert out.decode() == want + "\n"
    assert special & set(tokens) and "\\x1b" in want  # the escaping and dimming were exercised


def test_the_demo_generates_32_tokens_by_default(env, loaded, tmp_path_factory, monkeypatch):
    """In process, with the generation loop replaced by a recorder: --demo without --max-tokens asks
    for DEMO_MAX_TOKENS, a real checkpoint for DEFAULT_MAX_TOKENS."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from mlx_dsv41 import generate

    asked = []

    def recorder(model, tokenizer, tokens, *, max_tokens, **_):
        asked.append(max_tokens)
        return SimpleNamespace(
            prompt_tokens=len(tokens), prompt_tps=1.0, generation_tokens=0, generation_tps=1.0, peak_memory=0.0
        )

    from mlx_dsv41.demo import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, env[CACHE_ENV])  # --demo finds this session's demo checkpoint
    monkeypatch.setattr(generate, "run", recorder)
    monkeypatch.setattr(generate, "load_for_generation", lambda path, **_: (*loaded, None))
    assert CliRunner().invoke(generate.app, ["--demo", "--prompt", "hi"]).exit_code == 0
    assert (
        CliRunner()
        .invoke(generate.app, ["--model", str(demo_checkpoint(tmp_path_factory)), "--prompt", "hi"])
        .exit_code
        == 0
    )
    assert asked == [generate.DEMO_MAX_TOKENS, generate.DEFAULT_MAX_TOKENS] == [32, 256]


def test_help_fits_80_columns():
    for module in ("generate", "server", "convert", "chat"):
        r = subprocess.run(
            [sys.executable, "-m", f"mlx_dsv41.{module}", "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "80"},
        )
        assert r.returncode == 0, r.stderr
        assert max(len(line) for line in r.stdout.splitlines()) <= 80 and "─" not in r.stdout, r.stdout
