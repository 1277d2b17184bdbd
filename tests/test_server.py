"""`python -m mlx_dsv41.server` on the demo checkpoint, in a subprocess on a free local port:
chat completions (plain and streamed) in the DeepSeek-V4.1 encoding, two concurrent requests,
a client that disconnects mid-stream (its generation stops: the server's Engram read counter
stops moving), malformed requests (400 JSON errors, and the server keeps serving)."""

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest
from demo_helpers import REPO, demo_env

STARTUP_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_dsv41.server", "--demo", "--port", "0", "--max-tokens", "4"],
            cwd=REPO, env=demo_env(tmp_path_factory), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + STARTUP_S
        while True:
            m = re.search(r"Serving on http://([\d.]+):(\d+)", log.read_text())
            if m:
                break
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"server did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.2)
        yield m.group(1), int(m.group(2)), log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def request(server, method, path, body=None, raw: bytes | None = None, timeout=120):
    host, port, _ = server
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, payload


def chat_request(server, messages, **fields):
    status, payload = request(server, "POST", "/v1/chat/completions", {"messages": messages, **fields})
    assert status == 200, payload
    return json.loads(payload)


HI = [{"role": "user", "content": "Hello! How are you?"}]


def test_binds_localhost_and_names_one_model(server):
    host, _, log = server
    assert host == "127.0.0.1"
    assert "SYNTHETIC" in log.read_text()
    status, payload = request(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(payload)["data"]] == ["mlx_dsv41-demo"]
    assert json.loads(request(server, "GET", "/health")[1]) == {"status": "ok"}


def test_chat_completion_uses_the_v41_encoding(server):
    thinking = chat_request(server, HI, max_tokens=3)
    choice = thinking["choices"][0]
    assert choice["finish_reason"] == "length" and thinking["usage"]["completion_tokens"] == 3
    assert thinking["model"] == "mlx_dsv41-demo"
    # thinking mode: the prompt ends with <think>, so the reply starts in the reasoning channel
    assert choice["message"]["reasoning"] and choice["message"]["content"] is None
    # usage counts the official encoding: BOS, <｜System｜>, effort sentence, <｜User｜>, text, header
    from mlx_dsv41 import chat
    from mlx_dsv41.demo import build_tokenizer

    tok = build_tokenizer()
    for options, fields in [({}, {}), ({"thinking": False}, {"chat_template_kwargs": {"thinking": False}}),
                            ({"effort": 100}, {"reasoning_effort": "max"})]:
        reply = chat_request(server, HI, max_tokens=1, **fields)
        assert reply["usage"]["prompt_tokens"] == len(chat.encode(tok, HI, **options))
    plain = chat_request(server, HI, max_tokens=3, chat_template_kwargs={"thinking": False})
    assert plain["choices"][0]["message"]["content"]  # chat mode: the answer channel


def _stream_events(server, body):
    host, port, _ = server
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    return events


def test_streaming_equals_the_non_streamed_reply(server):
    body = {"messages": HI, "max_tokens": 4, "chat_template_kwargs": {"thinking": False}}
    events = _stream_events(server, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = chat_request(server, **body)["choices"][0]["message"]["content"]
    assert streamed == whole and whole


def test_two_concurrent_requests_each_get_their_own_answer(server):
    convs = [[{"role": "user", "content": "The cat sat on the mat."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]]
    alone = [chat_request(server, c, max_tokens=4, temperature=0.0)["choices"][0]["message"] for c in convs]
    results = [None, None]

    def run(i):
        results[i] = chat_request(server, convs[i], max_tokens=4, temperature=0.0)["choices"][0]["message"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert results == alone  # greedy: batched together == each alone


def test_repeated_prompt_is_served_from_the_prompt_cache(server):
    """The second identical request finds the first one's cache (prompt + answer) and trims it
    back to the prompt minus one token: same answer, the cached tokens reported."""
    msgs = [{"role": "user", "content": "Cache me, please."}]
    first = chat_request(server, msgs, max_tokens=1)
    second = chat_request(server, msgs, max_tokens=1)
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    prompt = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert _stats(server)["generation_restarts"] == 0


def test_prompt_cache_exact_hits_and_long_trims_stay_usable():
    """In process, on the tiny model: an exact hit gives back a cache one token short and that
    token (mlx-lm alone returns an empty remainder, which kills its generation thread); reusing an
    entry that would need more than `max_trim()` tokens removed falls back to no cache instead of
    raising in the generation thread."""
    from mlx_dsv41 import server as ours
    from mlx_dsv41.testing import tiny_model

    PromptCache = ours._make_classes()[0]
    model = tiny_model(seed=0)
    tokens = list(range(3, 60))
    cache = model.make_cache()
    model(mx.array([tokens]), cache)
    store = PromptCache(max_size=4)
    store.insert_cache("m", tokens, cache)
    got, rest = store.fetch_nearest_cache("m", tokens)
    assert rest == tokens[-1:] and [c.offset for c in got] == [len(tokens) - 1] * len(got)
    far = tokens[:10] + [150]  # shares 10 tokens: reusing the entry means trimming 47 > max_trim
    assert min(c.max_trim() for c in cache) < len(tokens) - 10
    assert store.fetch_nearest_cache("m", far) == (None, far)


def test_dspark_drafts_per_request_and_the_batched_path_agrees(server):
    """Greedy replies are the same with DSpark (the default) and without (num_draft_tokens 0:
    mlx-lm's batched path); the drafting requests show in /v1/stats."""
    before = _stats(server)["dspark"]
    msgs = [{"role": "user", "content": "Tell me about the cat."}]
    drafted = chat_request(server, msgs, max_tokens=5, temperature=0.0)
    plain = chat_request(server, msgs, max_tokens=5, temperature=0.0, num_draft_tokens=0)
    assert drafted["choices"][0]["message"] == plain["choices"][0]["message"]
    after = _stats(server)["dspark"]
    assert after["main_forwards"] > before["main_forwards"] and after["tokens"] >= before["tokens"] + 4
    # 5 tokens: one from the prefill, then rounds of at most 3 drafts (4 tokens left to write)
    assert len(after["acceptance_by_position"]) >= 3


def test_seeded_sampling_is_served_and_repeatable(server):
    """A request with a seed is served one at a time (mlx-lm's unbatched path) with our caches."""
    replies = [chat_request(server, HI, max_tokens=3, temperature=1.0, seed=7)["choices"][0]["message"]
               for _ in range(2)]
    assert replies[0] == replies[1] and replies[0]["reasoning"]


def _stats(server):
    return json.loads(request(server, "GET", "/v1/stats")[1])


def _send(server, stream: bool) -> socket.socket:
    host, port, _ = server
    sock = socket.create_connection((host, port), timeout=60)
    body = json.dumps({"messages": HI, "max_tokens": 5000, "stream": stream}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_stops_generation(server, stream):
    """Streaming: noticed before the next token is sent. Non-streaming (mlx-lm alone never
    notices: it writes nothing until the end): noticed the same way."""
    log = server[2]
    before = _stats(server)
    sock = _send(server, stream)
    if stream:
        seen = b""
        while seen.count(b"data: ") < 2:  # two tokens arrived: generation is running
            seen += sock.recv(65536)
    else:  # the Engram read counter moved several times: it is decoding token after token
        seen, last = 0, before["engram_rows_read"]
        while seen < 4:
            rows = _stats(server)["engram_rows_read"]
            seen, last = seen + (rows > last), rows
            time.sleep(0.05)
    sock.close()
    deadline = time.time() + 30
    while _stats(server)["stopped_by_disconnect"] == before["stopped_by_disconnect"]:
        assert time.time() < deadline, "the server never noticed the disconnect"
        time.sleep(0.2)
    # A step (or a DSpark round: a draft and a 6-token verify) already running may still finish:
    # wait until the counter holds still for a second.
    rows, still = _stats(server)["engram_rows_read"], time.time()
    while time.time() - still < 1.0:
        assert time.time() < deadline + 30, "generation continued after the disconnect"
        time.sleep(0.2)
        now = _stats(server)["engram_rows_read"]
        rows, still = (now, time.time()) if now != rows else (rows, still)
    time.sleep(2.0)  # ~10 decode steps of the demo on this CPU, had it kept going
    assert _stats(server)["engram_rows_read"] == rows, "generation continued after the disconnect"
    assert "client disconnected; generation stopped" in log.read_text()
    assert chat_request(server, HI, max_tokens=2)["usage"]["completion_tokens"] == 2  # still serving


@pytest.mark.parametrize("raw,match", [
    (b"{not json", "Invalid JSON"),
    (b"[1, 2]", "JSON dictionary"),
    (json.dumps({"max_tokens": 2}).encode(), "messages"),
    (json.dumps({"messages": "hi"}).encode(), "non-empty list"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "role 'robot'"),
    (json.dumps({"messages": HI, "reasoning_effort": "medium"}).encode(), "effort"),
    (json.dumps({"messages": HI, "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": HI, "logit_bias": {"99999": 1.0}}).encode(), "outside the vocabulary"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
                                                            {"url": "http://127.0.0.1:9/x.png"}}]}]}).encode(),
     "image_url"),
])
def test_malformed_requests_get_400_json_and_the_server_keeps_serving(server, raw, match):
    status, payload = request(server, "POST", "/v1/chat/completions", raw=raw)
    assert status == 400
    assert re.search(match, json.loads(payload)["error"])
    assert request(server, "GET", "/health")[0] == 200


def test_server_still_answers_after_the_bad_requests(server):
    assert chat_request(server, HI, max_tokens=1)["usage"]["completion_tokens"] == 1
    assert _stats(server)["generation_restarts"] == 0


def test_a_failing_generation_thread_fails_its_requests_and_restarts():
    """In process: the first generation loop raises while a request waits; that request gets the
    error, the loop restarts, and /health stays ok."""
    from queue import Queue

    from mlx_dsv41 import server as ours

    _, ModelProvider, ResponseGenerator, _, _ = ours._make_classes()
    runs = []

    class Flaky(ResponseGenerator):
        def _generate(self):
            runs.append(1)
            while not self._stop:
                if self.requests.qsize() and len(runs) == 1:
                    raise RuntimeError("boom")
                time.sleep(0.01)

    gen = Flaky(ModelProvider(ours.server_args(), None, None, "test"), None)
    try:
        waiting = Queue()
        gen.requests.put((waiting, "request", "args"))
        assert isinstance(waiting.get(timeout=10), RuntimeError)
        deadline = time.time() + 10
        while len(runs) < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        assert gen.restarts == 1 and gen.is_healthy
    finally:
        gen.stop_and_join()
