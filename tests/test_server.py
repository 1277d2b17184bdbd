"""`python -m mlx_dsv41.server` on the demo checkpoint, in a subprocess on a free local port, through
raw HTTP and the official `openai` client: chat completions (plain and streamed) in the
DeepSeek-V4.1 encoding, chat mode by default and thinking on request, two concurrent requests, a
client that disconnects mid-stream or mid-prefill (its generation stops: the server's Engram read
counter stops moving), a long prompt that does not block a short request, malformed and
unhonourable requests (400s in OpenAI's error shape, and the server keeps serving)."""

import http.client
import json
import random
import re
import socket
import threading
import time

import mlx.core as mx
import openai
import pytest
from demo_helpers import detokenize, greedy


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


def test_warmup_runs_before_the_server_listens(server):
    """--warmup N (the session's server is started with 12): one generation before listening, so a
    CUDA process has compiled its kernels before the first request (mlx_dsv41/warmup.py)."""
    log = server[2].read_text()
    m = re.search(r"Warmed up for prompts of 12 tokens in [\d.]+ s \(first token after [\d.]+ s\)", log)
    assert m and m.start() < log.index("Serving on"), log[-2000:]


def test_chat_completion_uses_the_v41_encoding(server):
    """Chat mode unless the request asks for reasoning; usage counts the official encoding."""
    from mlx_dsv41 import chat
    from mlx_dsv41.demo import build_tokenizer

    plain = chat_request(server, HI, max_tokens=3)
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 3
    assert plain["model"] == "mlx_dsv41-demo"
    assert choice["message"]["content"] and "reasoning" not in choice["message"]  # the answer channel
    thinking = chat_request(server, HI, max_tokens=3, reasoning_effort="high")
    # thinking mode: the prompt ends with <think>, so the reply starts in the reasoning channel
    assert thinking["choices"][0]["message"]["reasoning"] and thinking["choices"][0]["message"]["content"] is None
    tok = build_tokenizer()
    for options, fields in [
        ({"thinking": False}, {}),
        ({"thinking": False}, {"reasoning_effort": "none"}),
        ({"thinking": True}, {"chat_template_kwargs": {"thinking": True}}),
        ({"effort": 100}, {"reasoning_effort": "max"}),
    ]:
        reply = chat_request(server, HI, max_tokens=1, **fields)
        assert reply["usage"]["prompt_tokens"] == len(chat.encode(tok, HI, **options))


@pytest.mark.parametrize("effort,value", [("medium", 62)])
def test_openai_reasoning_efforts_map_onto_the_official_scale(server, loaded, effort, value):
    """The reply to reasoning_effort=NAME is exactly our greedy continuation of the prompt rendered
    with effort VALUE (the effort sentence is part of the prompt, so another value gives other
    logits)."""
    from mlx_dsv41 import chat

    model, tokenizer = loaded
    reply = chat_request(server, HI, max_tokens=3, reasoning_effort=effort)["choices"][0]["message"]
    want = greedy(model, tokenizer, chat.encode(tokenizer, HI, thinking=True, effort=value), 3)
    assert reply["reasoning"] == detokenize(tokenizer, want)


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
    convs = [
        [{"role": "user", "content": "The cat sat on the mat."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}],
    ]
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


def test_a_conversations_second_turn_prefills_only_its_new_tokens(server):
    """Issue 17 item 5: turn 2 (turn 1's messages, the assistant's reply, a new question) finds
    turn 1's cache, so only what turn 1 did not hold is prefilled; a conversation with another
    start finds less."""
    system = {"role": "system", "content": "You answer briefly. " * 12}
    turn1 = [system, {"role": "user", "content": "Name a colour."}]
    first = chat_request(server, turn1, max_tokens=3, temperature=0.0)
    reply = first["choices"][0]["message"]
    turn2 = [*turn1, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "Another?"}]
    second = chat_request(server, turn2, max_tokens=3, temperature=0.0)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1  # all of turn 1's prompt at least
    assert second["usage"]["prompt_tokens"] - cached < second["usage"]["prompt_tokens"] // 2
    other = chat_request(server, [{"role": "system", "content": "x"}, *turn2[1:]], max_tokens=1)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < cached


def test_prompt_cache_exact_hits_and_long_trims_stay_usable():
    """In process, on the tiny model: an exact hit gives back a cache one token short and that
    token (mlx-lm alone returns an empty remainder, which kills its generation thread); reusing an
    entry that would need more than `max_trim()` tokens removed falls back to no cache instead of
    raising in the generation thread."""
    from mlx_dsv41.server_generation import PromptCache
    from mlx_dsv41.synthetic import tiny_model

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


def test_the_draft_lane_answers_as_the_batch_does(loaded):
    """In process, on the demo: a drafting sequence of two segments, fed 3 tokens a unit, reports
    its progress and segment ends as mlx-lm's BatchGenerator does; a copy of its caches taken at a
    segment end holds exactly the tokens it says (and stays put while the sequence runs on); its
    tokens are our greedy ones; its finished caches hold exactly `all_tokens`."""
    from mlx_lm.generate import make_stop_sequences

    from mlx_dsv41 import chat
    from mlx_dsv41.server_dspark import DraftingSequence, DraftLane, DraftRequest
    from mlx_dsv41.speculative import DraftStats, Sampling

    model, tokenizer = loaded
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the cat."}]
    prompt = chat.encode(tokenizer, msgs, thinking=False)
    system = chat.encode(tokenizer, msgs[:1], add_generation_prompt=False, thinking=False)
    lane, stats = DraftLane(), DraftStats()
    lane.add(
        DraftingSequence(
            7,
            model,
            [system, prompt[len(system) :]],
            [*model.make_cache(), model.make_draft_cache()],
            [],
            DraftRequest(None, Sampling(), stats),
            6,
            make_stop_sequences(tokenizer),
        )
    )
    progress, tokens, copies = [], [], []
    while 7 in lane:
        prompt_responses, generation_responses, _, _ = lane.step(3, 0.0)
        for r in prompt_responses:
            progress.append((r.progress, r.end_of_segment, r.end_of_prompt))
            if r.end_of_segment and not r.end_of_prompt:
                copies.append(lane.extract_cache([7])[7])
        tokens += generation_responses
    n = len(prompt)
    chunks = [*range(3, len(system), 3), len(system), *range(len(system) + 3, n - 1, 3), n - 1]
    assert [p for p, _, _ in progress] == [(k, n) for k in chunks] + [(n, n)]
    assert [(end, last) for _, end, last in progress if end] == [(True, False)] * 2 + [(True, True)]
    assert [len(held) for _, held in copies] == [len(system), n - 1]
    assert all(c.offset == len(held) for caches, held in copies for c in caches)
    assert [held for _, held in copies] == [system, prompt[:-1]]
    assert [r.token for r in tokens] == greedy(model, tokenizer, prompt, 6) and tokens[-1].finish_reason == "length"
    final = tokens[-1]
    assert final.all_tokens[:n] == prompt and all(c.offset == len(final.all_tokens) for c in final.prompt_cache)
    assert final.all_tokens[n:] == [r.token for r in tokens][:-1] and stats.forwards >= 1


def test_seeded_sampling_is_served_and_repeatable(server):
    """A request with a seed is served one at a time (mlx-lm's unbatched path) with our caches."""
    replies = [
        chat_request(server, HI, max_tokens=3, temperature=1.0, seed=7)["choices"][0]["message"] for _ in range(2)
    ]
    assert replies[0] == replies[1] and replies[0]["content"]


def _stats(server):
    return json.loads(request(server, "GET", "/v1/stats")[1])


def _send(server, stream: bool, messages=HI, max_tokens=5000, **fields) -> socket.socket:
    host, port, _ = server
    sock = socket.create_connection((host, port), timeout=60)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": stream, **fields}).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
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
    _stops_after_the_disconnect(server, before, "generation", 2.0)  # ~10 decode steps of the demo on this CPU
    assert "client disconnected; generation stopped" in log.read_text()
    assert chat_request(server, HI, max_tokens=2)["usage"]["completion_tokens"] == 2  # still serving


def _stops_after_the_disconnect(server, before: dict, what: str, seconds: float) -> None:
    """The server notices that the client went away (its counter moves past `before`'s), and the
    Engram read counter, once it has held still for a second, holds still `seconds` more. Work
    under way when the disconnect was noticed may still finish: a decode step, a DSpark round, the
    prefill chunks of mlx-lm's time budget (it removes a stopped request only after it)."""
    deadline = time.time() + 30
    while _stats(server)["stopped_by_disconnect"] == before["stopped_by_disconnect"]:
        assert time.time() < deadline, "the server never noticed the disconnect"
        time.sleep(0.2)
    rows, still = _stats(server)["engram_rows_read"], time.time()
    while time.time() - still < 1.0:
        assert time.time() < deadline + 30, f"{what} continued after the disconnect"
        time.sleep(0.2)
        now = _stats(server)["engram_rows_read"]
        rows, still = (now, time.time()) if now != rows else (rows, still)
    time.sleep(seconds)
    assert _stats(server)["engram_rows_read"] == rows, f"{what} continued after the disconnect"


def _timed_request(server, timeout: float, **fields) -> float:
    start = time.perf_counter()
    status, payload = request(
        server, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 5, **fields}, timeout=timeout
    )
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 5
    return time.perf_counter() - start


@pytest.mark.parametrize("fields", [{}, {"num_draft_tokens": 0}], ids=["drafting", "batched"])
def test_a_long_abandoned_prompt_neither_blocks_nor_keeps_running(server, fields):
    """An 8k-token prompt (several minutes of prefill on a 2-core CPU, mlx-lm's 2048-token chunks
    tens of seconds each) is sent, then a short request: the short one is answered about as fast
    as on an idle server, because prefill chunks are sliced in time between its decode steps.
    Then the long one's client goes away before its first token: its prefill stops. Both with
    DSpark (the default: the two take turns in the draft lane) and on mlx-lm's batched path."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran back again while the dog slept".split()
    long = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(4000))}]
    idle = _timed_request(server, timeout=120, **fields)
    bound = 3 * idle + 30  # generous: about blocking, not speed (mlx-lm's chunking: minutes)
    before = _stats(server)
    sock = _send(server, stream=False, messages=long, max_tokens=5, **fields)
    deadline = time.time() + 60
    while _stats(server)["engram_rows_read"] == before["engram_rows_read"]:  # prefill has started
        assert time.time() < deadline, "the long prompt never started"
        time.sleep(0.1)
    assert _timed_request(server, timeout=bound, **fields) < bound
    drafted = _stats(server)["dspark"]["main_forwards"] > before["dspark"]["main_forwards"]
    assert drafted == (not fields)  # the short request took the path under test
    sock.close()
    _stops_after_the_disconnect(server, before, "prefill", 3.0)


@pytest.mark.parametrize(
    "raw,match,param",
    [
        (b"{not json", "Invalid JSON", None),
        (b"[1, 2]", "JSON dictionary", None),
        (json.dumps({"max_tokens": 2}).encode(), "messages", "messages"),
        (json.dumps({"messages": "hi"}).encode(), "non-empty list", "messages"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "role 'robot'", "messages"),
        (json.dumps({"messages": HI, "reasoning_effort": "extreme"}).encode(), "effort", "reasoning_effort"),
        (
            json.dumps(
                {"messages": HI, "reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}}
            ).encode(),
            "needs thinking mode",
            "reasoning_effort",
        ),
        (json.dumps({"messages": HI, "max_tokens": 0}).encode(), "max_tokens", "max_tokens"),
        (json.dumps({"messages": HI, "temperature": "hot"}).encode(), "temperature", "temperature"),
        (json.dumps({"messages": HI, "logit_bias": {"99999": 1.0}}).encode(), "outside the vocabulary", "logit_bias"),
        (
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}],
                        }
                    ]
                }
            ).encode(),
            "image_url",
            "messages",
        ),
    ],
)
def test_malformed_requests_get_400_in_openai_shape_and_the_server_keeps_serving(server, raw, match, param):
    status, payload = request(server, "POST", "/v1/chat/completions", raw=raw)
    assert status == 400
    error = json.loads(payload)["error"]
    assert re.search(match, error["message"]) and error["type"] == "invalid_request_error"
    assert error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert request(server, "GET", "/health")[0] == 200


def test_unknown_paths_are_404_in_openai_shape(server):
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v1/embeddings")]:
        status, payload = request(server, method, path, {"input": "x"} if method == "POST" else None)
        assert status == 404
        assert json.loads(payload)["error"]["message"] == f"no such endpoint: {method} {path}"


def _client(server):
    host, port, _ = server
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize(
    "fields,param,code,match",
    [
        (
            {"model": "gpt-4o"},
            "model",
            "model_not_found",
            r"model 'gpt-4o' is not served here; this server serves 'mlx_dsv41-demo'",
        ),
        ({"n": 2}, "n", None, r"n must be 1"),
        ({"response_format": {"type": "json_object"}}, "response_format", None, r"'json_object' is not supported"),
        (
            {"max_tokens": 10**9},
            "max_tokens",
            "context_length_exceeded",
            r"context is 1048576 tokens; the request asks for 1000000010 \(10 in the prompt",
        ),
    ],
)
def test_the_openai_client_sees_why_a_request_is_refused(server, fields, param, code, match):
    """What the server cannot honour is refused, and the official client shows the reason."""
    args = {"model": "mlx_dsv41-demo", "messages": HI, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        _client(server).chat.completions.create(**args)
    e = caught.value
    assert e.status_code == 400 and re.search(match, e.message)
    assert e.body["param"] == param and e.body["code"] == code


def test_the_openai_client_gets_answers_and_streams(server, loaded):
    """Accepted requests through the official client: the served name, response_format text, n=1,
    streaming; the text is exactly our greedy continuation."""
    from mlx_dsv41 import chat

    model, tokenizer = loaded
    want = detokenize(tokenizer, greedy(model, tokenizer, chat.encode(tokenizer, HI, thinking=False), 4))
    client = _client(server)
    reply = client.chat.completions.create(
        model="mlx_dsv41-demo", messages=HI, max_tokens=4, n=1, response_format={"type": "text"}
    )
    assert reply.choices[0].message.content == want and reply.usage.completion_tokens == 4
    stream = client.chat.completions.create(model="mlx_dsv41-demo", messages=HI, max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    assert [m.id for m in client.models.list()] == ["mlx_dsv41-demo"]


def test_server_still_answers_after_the_bad_requests(server):
    assert chat_request(server, HI, max_tokens=1)["usage"]["completion_tokens"] == 1
    assert _stats(server)["generation_restarts"] == 0


def test_a_failing_generation_thread_fails_its_requests_and_restarts():
    """In process: the first generation loop raises while a request waits; that request gets the
    error, the loop restarts, and /health stays ok."""
    from queue import Queue

    from mlx_dsv41 import server as ours
    from mlx_dsv41.server_generation import ModelProvider, ResponseGenerator

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


@pytest.mark.parametrize(
    "fixed,per_token,want",
    [
        (0.9, 0.011, 81),  # a CPU: one forward pass alone costs more than the slice -> twice its fixed cost
        (0.001, 0.0001, 2048),  # a GPU: the slice holds more than --prefill-step-size -> capped
        (0.01, 0.001, 490),  # in between: about the slice, (0.5 - 0.01) / 0.001 tokens
    ],
)
def test_prefill_chunks_settle_where_the_cost_model_says(fixed, per_token, want):
    """The chunk-size controller fed exact timings of `seconds = fixed + per_token x tokens`, from
    mlx-lm's fixed first chunk on: it settles on the size its rule gives, growing at most 2x a step."""
    from mlx_dsv41.server_generation import FIRST_STEP, SlicedBatchGenerator

    gen = SlicedBatchGenerator.__new__(SlicedBatchGenerator)  # the controller only: no model
    gen.prefill_slice, gen.max_step, gen.timings, gen.prefill_step_size = 0.5, 2048, [], FIRST_STEP
    gen._old_wired_limit = None  # what BatchGenerator.__del__ reads
    sizes = []
    for _ in range(12):
        n = gen.prefill_step_size
        gen.record(n, fixed + per_token * n)
        gen.prefill_step_size = gen._step(prompts=1)
        assert gen.prefill_step_size <= 2 * n
        sizes.append(gen.prefill_step_size)
    assert all(abs(size - want) <= 1 for size in sizes[-4:]), sizes  # settled (float rounding: +-1)
