"""`python -m mlx_dsv41.chat` on the demo checkpoint, driven through stdin: every reply is exactly our
greedy continuation of the whole conversation in the official encoding (earlier reasoning dropped),
each turn prefills only what the previous prompt did not hold, /effort and /reset start over,
/thinking off switches to chat mode; reasoning is dimmed on a terminal and hidden on request."""

import os
import re
import subprocess
import sys
import tty

from demo_helpers import REPO, detokenize, greedy

from mlx_dsv41 import chat
from mlx_dsv41.terminal import DIM, RESET, visible

TOKENS = 3


def repl(env, *args, stdin: str, stdout=subprocess.PIPE):
    return subprocess.run(
        [sys.executable, "-m", "mlx_dsv41.chat", "--demo", "--max-tokens", str(TOKENS), *args],
        cwd=REPO,
        env=env,
        input=stdin.encode(),
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=600,
    )


class Reference:
    """The conversation as the REPL should hold it, each reply our greedy continuation of the whole
    conversation, and what the REPL prints for it off a terminal."""

    def __init__(self, loaded):
        self.model, self.tokenizer = loaded
        self.messages, self.lengths = [], []
        self.end_think = chat.control_token_ids(self.tokenizer)[chat.END_THINK]

    def turn(self, text: str, thinking: bool = True, effort: int = 75) -> str:
        self.messages.append({"role": "user", "content": text})
        prompt = chat.encode(self.tokenizer, self.messages, thinking=thinking, effort=effort)
        self.lengths.append(len(prompt))
        tokens = greedy(self.model, self.tokenizer, prompt, TOKENS)
        closed = thinking and self.end_think in tokens
        cut = tokens.index(self.end_think) if closed else (len(tokens) if thinking else -1)
        reasoning = detokenize(self.tokenizer, tokens[:cut]) if thinking else ""
        answer = detokenize(self.tokenizer, tokens[cut + 1 :])
        self.messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
        if not thinking:
            return answer + "\n"
        return chat.THINK + reasoning + (chat.END_THINK + "\n" + answer if closed else "") + "\n"


def read_terminal(master: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: nothing more, the writer is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return out.decode()


def test_a_conversation_reuses_its_cache_and_matches_fresh_greedy_replies(env, loaded):
    lines = ["Hello there", "What is two plus two?", "/effort max", "Why?", "/reset", "/thinking off", "Hi", "/bogus"]
    r = repl(env, stdin="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr.decode()
    ref = Reference(loaded)
    want = ref.turn(lines[0]) + ref.turn(lines[1]) + "(reasoning effort 100)\n" + ref.turn(lines[3], effort=100)
    ref.messages = []
    want += "(conversation cleared)\n(thinking mode off)\n" + ref.turn("Hi", thinking=False, effort=100)
    assert r.stdout.decode() == want + "(unknown command '/bogus'; /help lists them)\n"
    stats = re.findall(r"\[(\d+) prompt tokens: (\d+) prefilled, (\d+) reused; (\d+) generated", r.stderr.decode())
    n = ref.lengths
    # turn 2 starts from turn 1's prompt less its header token; /effort and /reset start over
    assert [tuple(map(int, s[:3])) for s in stats] == [
        (n[0], n[0], 0),
        (n[1], n[1] - n[0] + 1, n[0] - 1),
        (n[2], n[2], 0),
        (n[3], n[3], 0),
    ]


def test_reasoning_is_dimmed_on_a_terminal_and_hidden_on_request(env, loaded):
    ref = Reference(loaded)
    shown = ref.turn("Hello there")
    reasoning, answer = ref.messages[-1]["reasoning_content"], ref.messages[-1]["content"]
    master, slave = os.openpty()
    tty.setraw(slave)
    r = repl(env, stdin="Hello there\n", stdout=slave)
    os.close(slave)
    out = read_terminal(master)
    assert r.returncode == 0, r.stderr.decode()
    assert reasoning and out.startswith(DIM + visible(reasoning)[:1]) and RESET in out
    assert re.sub(r"\x1b\[\d+m", "", out) == visible(shown.replace(chat.THINK, "").replace(chat.END_THINK, ""))
    hidden = repl(env, "--hide-thinking", stdin="Hello there\n")
    assert hidden.stdout.decode() == answer + "\n"
