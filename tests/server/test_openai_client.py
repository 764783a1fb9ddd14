"""The official `openai` client against `lineside serve`'s app on 127.0.0.1: chat and completions,
streaming and not, stop sequences, usage, errors; greedy outputs equal the single-stream generator."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lineside.runtime.generate import Generator
from lineside.server import sse
from tests.server.conftest import metric


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    """Greedy text from the direct single-stream path (no engine, no server)."""
    gen = Generator(tiny_bundle, threads=1)

    def ref(prompt: str, max_tokens: int, chat: bool = False):
        r = gen.generate(prompt, max_tokens=max_tokens, chat=chat)
        return r.text, len(r.token_ids), r.prompt_tokens, r.finish_reason

    return ref


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_matches_reference(client, reference):
    text, n, prompt_tokens, reason = reference("Hello there", 24, chat=True)
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens >= n  # an EOS counts as generated but is not text
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_and_max_completion_tokens(client, reference):
    text, n, prompt_tokens, _ = reference("The factory line", 20)
    r = client.completions.create(model="tiny-llama", prompt="The factory line", max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny-llama"
    assert r.choices[0].text == text and r.usage.prompt_tokens == prompt_tokens
    # chat accepts the newer max_completion_tokens
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "a"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_chat_stream_shape_and_usage(client, reference):
    text, _, prompt_tokens, reason = reference("Stream me", 30, chat=True)
    chunks = list(client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Stream me"}], max_tokens=30, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_raw_sse(server, reference):
    text, _, _, _ = reference("raw", 12)
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "raw", "max_tokens": 12, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    events = sse.parse(r.text)
    assert events[-1] == "[DONE]"
    objs = events[:-1]
    assert all(o["object"] == "text_completion" and "usage" not in o for o in objs)
    assert "".join(o["choices"][0]["text"] for o in objs) == text
    assert objs[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_sequences(client, reference):
    full, _, _, _ = reference("stop test", 40)
    cut = next((i for i in range(3, len(full)) if full[i].isprintable() and not full[i].isspace()), None)
    if cut is None:
        pytest.skip("the random model produced no printable character to stop on")
    stop = full[cut]
    expect = full[:full.index(stop)]
    r = client.completions.create(model="tiny-llama", prompt="stop test", max_tokens=40, temperature=0, stop=[stop, "\u2603"])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny-llama", prompt="stop test", max_tokens=40, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_reason_says_which_stop_ended_the_answer(server, reference):
    """vLLM's ``stop_reason`` next to ``finish_reason``, streamed (on the finishing chunk) and not: the stop string
    that cut the answer, the request's stop token id that was sampled, null for the model's EOS and for length."""
    full = reference("stop test", 40)[0]
    # an ASCII character (one byte token of the tiny vocabulary, never inside another character), its first, after
    # a whole one (a stop token drops invalid bytes just before it, as an answer's end drops an unfinished character)
    at = next((i for i in range(1, len(full)) if full[i].isascii() and full[i].isprintable() and not full[i].isspace()
               and full.index(full[i]) == i and full[i - 1] != "\ufffd"), None)
    if at is None:
        pytest.skip("the random model produced no printable character to stop on")
    stop = full[at]

    def ask(stream: bool, **kw):
        body = {"prompt": "stop test", "max_tokens": 40, "temperature": 0, "stream": stream, **kw}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        if not stream:
            c = r.json()["choices"][0]
            return c["text"], c["finish_reason"], c["stop_reason"]
        objs = [o for o in sse.parse(r.text) if o != "[DONE]"]
        last = objs[-1]["choices"][0]
        return "".join(o["choices"][0]["text"] for o in objs), last["finish_reason"], last["stop_reason"]

    token = server.state.engine.tokenizer.encode(stop, add_special=False)
    assert len(token) == 1
    for stream in (False, True):
        assert ask(stream, stop=["\u2603", stop]) == (full[:at], "stop", stop)
        assert ask(stream, stop_token_ids=[token[0]]) == (full[:at], "stop", token[0])
        assert ask(stream, max_tokens=1)[1:] == ("length", None)


def test_include_stop_str_in_output_keeps_the_stop(server, reference):
    """vLLM's include_stop_str_in_output: the answer runs to the end of the stop string that ended it (a stop token
    id's text kept too), on completions and chat, streamed and not; stop_reason still names it."""

    def first_ascii(full: str, whole_before: bool = True) -> int | None:  # as the stop_reason test above picks
        return next((i for i in range(1, len(full)) if full[i].isascii() and full[i].isprintable()
                     and not full[i].isspace() and full.index(full[i]) == i
                     and (full[i - 1] != "\ufffd" or not whole_before)), None)

    def ask(path: str, stream: bool, **kw):
        r = httpx.post(server.url + path, json={"max_tokens": 40, "temperature": 0, "stream": stream,
                                                "include_stop_str_in_output": True, **kw}, timeout=30)
        assert r.status_code == 200, r.text
        key = "text" if "prompt" in kw else None
        pick = (lambda c: c[key]) if key else (lambda c: (c.get("message") or c.get("delta") or {}).get("content") or "")
        if not stream:
            c = r.json()["choices"][0]
            return pick(c), c["finish_reason"], c["stop_reason"]
        objs = [o for o in sse.parse(r.text) if o != "[DONE]" and o.get("choices")]
        last = objs[-1]["choices"][0]
        return "".join(pick(o["choices"][0]) for o in objs), last["finish_reason"], last["stop_reason"]

    tok = server.state.engine.tokenizer
    full = reference("stop test", 40)[0]
    at = first_ascii(full)
    chat_full = reference("stop test", 40, chat=True)[0]
    chat_at = first_ascii(chat_full, whole_before=False)  # a stop string only: no stop token drops bytes
    if at is None or chat_at is None:
        pytest.skip("the random model produced no printable character to stop on")
    stop, chat_stop = full[at], chat_full[chat_at]
    msgs = [{"role": "user", "content": "stop test"}]
    for stream in (False, True):
        assert ask("/v1/completions", stream, prompt="stop test", stop=["\u2603", stop]) == \
            (full[:at + 1], "stop", stop)
        token = tok.encode(stop, add_special=False)[0]
        assert ask("/v1/completions", stream, prompt="stop test", stop_token_ids=[token]) == \
            (full[:at + 1], "stop", token)
        assert ask("/v1/chat/completions", stream, messages=msgs, stop=[chat_stop]) == \
            (chat_full[:chat_at + 1], "stop", chat_stop)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "include_stop_str_in_output": "maybe"})
    assert r.status_code == 400 and "include_stop_str_in_output" in r.text


def test_include_stop_str_streams_text_a_stop_may_begin_at_once(server):
    """Under include_stop_str_in_output text that may begin a stop string is in the answer whatever follows, so the
    stream sends it with its token (vLLM keeps no stop buffer then): chunk by chunk, one per token (logprobs on), each
    choice of n sends what it sends with no stop strings, until a stop completes; the text is the non-streamed one."""

    def chunks(path: str, **kw) -> dict[int, list[str]]:
        body = {"max_tokens": 24, "temperature": 0, "n": 2, "stream": True, **kw}
        if path.endswith("chat/completions"):
            body.update(messages=[{"role": "user", "content": "stop test"}], logprobs=True)
        else:
            body.update(prompt="stop test", logprobs=0)
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        sent: dict[int, list[str]] = {}
        for o in sse.parse(r.text):
            for c in o.get("choices", ()) if o != "[DONE]" else ():
                delta = c.get("delta", {}).get("content") if "delta" in c else c["text"]
                if c.get("logprobs") or delta:  # a token's chunk (the last may carry no logprobs, only text)
                    sent.setdefault(c["index"], []).append(delta or "")
        return sent

    for path in ("/v1/completions", "/v1/chat/completions"):
        plain = chunks(path)
        pieces = plain[0]
        at = next((k for k, t in enumerate(pieces[:-1]) if t and t[-1].isascii() and t[-1].isprintable()), None)
        if at is None:
            pytest.skip("the random model produced no printable character to stop on")
        ch = pieces[at][-1]
        # a stop string the answer only begins: every token's text goes out with it, as with no stop at all
        assert chunks(path, stop=[ch + "\u2603"], include_stop_str_in_output=True) == plain
        # one that completes: the same chunks up to the token completing it, cut after it
        hit = chunks(path, stop=[ch], include_stop_str_in_output=True)
        first = "".join(pieces).index(ch) + 1
        for i in (0, 1):
            assert "".join(hit[i]) == "".join(pieces)[:first]
            assert hit[i][:-1] == plain[i][:len(hit[i]) - 1]
        body = {"max_tokens": 24, "temperature": 0, "stop": [ch], "include_stop_str_in_output": True}
        body.update({"messages": [{"role": "user", "content": "stop test"}]} if "chat" in path else
                    {"prompt": "stop test"})
        c = httpx.post(server.url + path, json=body, timeout=30).json()["choices"][0]
        assert (c.get("message") or {}).get("content", c.get("text")) == "".join(hit[0])


def test_skip_special_tokens_false_writes_special_tokens(server):
    """vLLM's skip_special_tokens false: a sampled special token's text is in the answer (skipped by default); the
    EOS that ends it adds its text only under include_stop_str_in_output, as vLLM decodes a stop token then."""
    engine = server.state.engine
    eos = min(engine.eos_ids)
    eos_text = engine.tokenizer.decode([eos], skip_special=False)
    assert eos_text and engine.tokenizer.decode([eos]) == ""

    def text(path: str, stream: bool, **kw) -> str:
        body = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(eos): 100}, "stream": stream, **kw}
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        pick = (lambda c: c["text"]) if "prompt" in kw else (
            lambda c: (c.get("message") or c.get("delta") or {}).get("content") or "")
        if not stream:
            return pick(r.json()["choices"][0])
        return "".join(pick(o["choices"][0]) for o in sse.parse(r.text) if o != "[DONE]" and o.get("choices"))

    for stream in (False, True):
        for path, kw in (("/v1/completions", {"prompt": "hi"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            assert text(path, stream, **kw) == ""
            assert text(path, stream, skip_special_tokens=False, **kw) == ""  # the EOS ends it, its text left out
            assert text(path, stream, skip_special_tokens=False, include_stop_str_in_output=True, **kw) == eos_text
            assert text(path, stream, skip_special_tokens=False, ignore_eos=True, **kw) == eos_text * 3
            assert text(path, stream, ignore_eos=True, **kw) == ""


def test_prompt_list_and_token_ids(server, reference):
    a, b = reference("one", 8)[0], reference("two two", 8)[0]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["one", "two two"], "max_tokens": 8,
                                                          "temperature": 0}).json()
    assert [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])] == [a, b]
    ids = server.state.engine.tokenizer.encode("one")
    r2 = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    assert r2["choices"][0]["text"] == a and r2["usage"]["prompt_tokens"] == len(ids)


def test_seeded_sampling_reproducible(client):
    kw = dict(model="tiny-llama", prompt="seed", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
              presence_penalty=0.5, frequency_penalty=0.2,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})  # vLLM-style extras
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_error_objects(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt=["a"] * 33, n=2, max_tokens=1)
    assert e.value.code == "too_many_choices" and "66 choices" in e.value.message and e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
    assert e.value.body["type"] == "invalid_request_error" if isinstance(e.value.body, dict) else True
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", temperature=5)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=10_000)
    assert "10000" in e.value.message and "256" in e.value.message and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": 5}', "'prompt'"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "\\ud800"}', "UTF-8"),
    (b'{"prompt": [], "max_tokens": 2}', "empty list"),
    (b'{"prompt": [99999]}', "out of vocabulary"),
    (b'{"prompt": "", "max_tokens": 2}', None),
    (b'{"prompt": "x", "seed": 9223372036854775808}', "seed"),
    (b"", "JSON"),
    (b'{"prompt": [1, "a"]}', "matches none of the accepted types"),
    (b'{"prompt": "x"}{"prompt": "y"}', "not valid JSON"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),  # was "send UTF-8 JSON"
])
def test_bad_input_is_400_in_openai_shape(server, body, needle):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    if needle is None and r.status_code == 200:  # "" → BOS only: a valid prompt for a BOS model
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]
    if needle:
        assert needle in err["message"]


_TOOL = {"type": "function", "function": {"name": "f", "description": "D", "parameters": {"type": "object"}}}
_CALL = [{"role": "user", "content": "hi"},
         {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "A"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL], "tool_choice": "none"},
     "tools.0.function.description"),
    ("chat/completions", {"messages": _CALL}, "messages.1.tool_calls.0.function.arguments"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "N"}]}, "messages.0.name"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": "K"}},
     "chat_template_kwargs.k"),
    ("completions", {"prompt": "hi", "stop": ["x", "S"]}, "stop.1"),
])
def test_lone_surrogate_anywhere_is_400_naming_the_field(server, path, body, param):
    """A JSON escape such as \\ud800 parses to a lone surrogate, which no tokenizer or template can encode: any
    string field carrying one (a tool's description, a call's arguments, rendered by the chat template) was
    a 500 TypeError from the tokenizer; now the same 400 invalid_utf8 as in a message's content, naming it."""
    raw = json.dumps({**body, "max_tokens": 2})
    for marker in ('"D"', '"A"', '"N"', '"K"', '"S"'):
        raw = raw.replace(marker, '"a\\ud800b"')
    r = httpx.post(f"{server.url}/v1/{path}", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_utf8", param) and param in err["message"]
    ok = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2})
    if "tools" in body:  # rendered (tool_choice none too, as vLLM), the tools alone outgrow this server's 256 tokens
        assert ok.status_code == 400 and ok.json()["error"]["code"] == "context_length_exceeded", ok.text
    else:
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, raw", [
    ("completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"a\\ud800b": 1}}'),
    ("chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                         '"chat_template_kwargs": {"a\\ud800b": 1}}'),
])
def test_a_lone_surrogate_in_a_key_is_a_400_too(server, path, raw):
    """A lone surrogate in an object's key is named in the error's message and param; the error body could not be
    encoded as UTF-8 then, and the answer was a 500 UnicodeEncodeError. It is written as its escape."""
    r = httpx.post(f"{server.url}/v1/{path}", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "\\ud800" in err["message"] and "\\ud800" in err["param"]


def test_a_server_bug_closes_its_connection_saying_so(server, monkeypatch):
    """After a handler's unexpected exception Starlette re-raises it and uvicorn drops the keep-alive connection; the
    500 said nothing, so the client's next request on that connection (any client that pools them) was reset.
    The 500 now carries Connection: close: the client opens a fresh connection and the next request is served."""
    from lineside.server import request_mapping

    def broken(_body):
        raise RuntimeError("a bug")

    monkeypatch.setattr(request_mapping, "stop_list", broken)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert r.headers.get("connection") == "close"
        monkeypatch.undo()
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_request_id_and_priority_headers(server):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "abc-123",
                                                                       "X-Priority": "high", "X-Mode": "batch"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.headers["x-request-id"].startswith("req-")
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Priority": "urgent"})
    assert r.status_code == 400 and "X-Priority" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Mode": "later"})
    assert r.status_code == 400


def test_hygiene_strips_bom_and_zero_width(server):
    clean = httpx.post(server.url + "/v1/completions", json={"prompt": "ab cd", "max_tokens": 6, "temperature": 0})
    dirty = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "\ufeffa\u200bb\u2060 c\u200dd\u200c", "max_tokens": 6, "temperature": 0})
    assert dirty.status_code == 200
    assert dirty.json()["usage"]["prompt_tokens"] == clean.json()["usage"]["prompt_tokens"]
    assert dirty.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"]


def test_health_metrics_and_latency_log(server, client):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    ready = httpx.get(server.url + "/health/ready")
    assert ready.status_code == 200 and ready.json()["model"] == "tiny-llama"
    gpu = httpx.get(server.url + "/health/gpu").json()
    assert "gpu" in gpu and (gpu["gpu"] or gpu["reason"])
    client.completions.create(model="tiny-llama", prompt="metrics", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("lineside_time_to_first_token_seconds_count", "lineside_e2e_request_latency_seconds_count",
                 "lineside_request_queue_time_seconds_count", "lineside_time_per_output_token_seconds_count"):
        assert metric(text, name) >= 1, name
    assert metric(text, "lineside_generation_tokens_total") >= 5
    assert metric(text, "lineside_num_requests_running") == 0
    assert "lineside_kv_cache_usage_ratio" in text and "lineside_num_requests_waiting" in text
    assert metric(text, "lineside_requests_total", 'outcome="invalid"') >= 1  # from the bad-input tests
    lines = [json.loads(x) for x in server.latency_log.read_text().splitlines()]
    last = lines[-1]
    assert last["outcome"] in ("stop", "length") and last["completion_tokens"] >= 1
    assert last["ttft_s"] > 0 and last["e2e_s"] >= last["ttft_s"] and "request_id" in last


def test_prefix_cache_counters_in_metrics(server, client):
    """A prompt sent twice: the second reuses the first's cached blocks, and /metrics says how many tokens (named
    like vLLM's prefix_cache_queries / _hits, in tokens) and that one request hit."""
    prompt = " ".join(f"part {i} of the shared manual text," for i in range(4))
    before = httpx.get(server.url + "/metrics").text
    used = [client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0).usage
            for _ in range(2)]
    after = httpx.get(server.url + "/metrics").text

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("lineside_prefix_cache_queries_total") == sum(u.prompt_tokens for u in used)
    hits = delta("lineside_prefix_cache_hits_total")
    assert used[1].prompt_tokens // 2 <= hits < used[1].prompt_tokens, (hits, used[1].prompt_tokens)
    assert delta("lineside_prefix_cache_hit_requests_total") == 1
    assert "lineside_num_preemptions_total" in after


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_gave(client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field, llama.cpp's too) was left out of chat and completions
    answers (the client read None): a repeated prompt now says what the prefix cache gave it, streamed and not, and
    n > 1 counts the prompt once, as prompt_tokens does."""
    msgs = [{"role": "system", "content": "the line stops at station twelve when the oven runs hot " * 3},
            {"role": "user", "content": "why?"}]
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=2, temperature=0)
    first = client.chat.completions.create(**kw).usage
    again = client.chat.completions.create(**kw).usage
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = chunks[-1].usage
    several = client.chat.completions.create(n=3, **kw).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    for u in (again, streamed, several):
        assert first.prompt_tokens // 2 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens, u
    text = client.completions.create(model="tiny-llama", prompt=msgs[0]["content"], max_tokens=2, temperature=0)
    assert 0 <= text.usage.prompt_tokens_details.cached_tokens < text.usage.prompt_tokens


def test_reused_request_id_concurrently(server):
    import asyncio

    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"prompt": "same id", "max_tokens": 20, "temperature": 0}
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body,
                                                 headers={"X-Request-Id": "dup"}) for _ in range(3)))

    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200, 200, 200]
    assert {r.json()["choices"][0]["text"] for r in rs} == {rs[0].json()["choices"][0]["text"]}


def test_jetson_gauges_in_metrics(server, monkeypatch):
    """On a Jetson the tegrastats sampler's flat gauges appear in /metrics (faked reader here)."""
    from lineside.server import health

    monkeypatch.setattr(health, "gpu_state", lambda: {"gpu": True, "kind": "jetson", "metrics": {
        "jetson_gpu_load_percent": 42.0, "jetson_rail_VDD_IN_mw": 5100, "bad": "x"}})
    monkeypatch.setattr(server.state, "tegrastats", True)
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "lineside_jetson_gpu_load_percent") == 42.0
    assert metric(text, "lineside_jetson_rail_VDD_IN_mw") == 5100.0
    assert "lineside_bad" not in text


def test_long_prompt_refused_before_tokenizing(server, reference):
    text = "long " * 1700 + "end"  # more characters than 256 tokens of this vocabulary can hold
    r = httpx.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "8503 characters" in r.json()["error"]["message"] and "256 tokens" in r.json()["error"]["message"]


def test_only_json_bodies_are_read(server):
    """A form, text/plain or unlabelled body is what a web page can post without a CORS preflight: 415, never
    read as JSON (`curl -d` needs -H 'Content-Type: application/json'); a non-UTF-8 charset is refused too."""
    body = b'{"prompt": "curl", "max_tokens": 2, "temperature": 0}'
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"},
                    {"content-type": "multipart/form-data; boundary=x"}, {},
                    {"content-type": "application/json; charset=utf-16"}):
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, (headers, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    for ctype in ("application/json", "application/json; charset=UTF-8", "application/vnd.api+json"):
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": ctype})
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    # what is wrong and what to do: the method sent, the path, and the method(s) it takes (as Allow says)
    assert r.json()["error"]["message"] == "GET is not allowed on /v1/completions; send POST"
    r = httpx.post(server.url + "/v1/models", json={})
    assert (r.status_code, r.json()["error"]["message"]) == (405, "POST is not allowed on /v1/models; send GET")
    r = httpx.post(server.url + "/v1/embeddings", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_post_without_a_body_is_answered_for_what_it_asks(server):
    """The OpenAI JS SDK's ``responses.cancel(id)`` posts no body and no Content-Type: it got a 415 telling it to
    send its (absent) body as JSON, which no caller can act on. With no body there is nothing to misread as JSON:
    the path answers (no cancel here: 404 listing what is), and a generation route says its body is missing."""
    for headers in ({}, {"content-length": "0"}):
        r = httpx.post(server.url + "/v1/responses/resp_1/cancel", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (headers, r.text)
        r = httpx.post(server.url + "/v1/completions", headers=headers)
        assert r.status_code == 400 and "body is empty" in r.json()["error"]["message"], (headers, r.text)
    r = httpx.post(server.url + "/v1/completions", content=b"", headers={"transfer-encoding": "chunked"})
    assert r.status_code == 415  # a body may follow: only JSON is read


def test_n_choices_per_prompt(client, server):
    """n > 1: independent samples per prompt (seed + j for copy j, so a seeded request repeats), indexed
    prompt * n + copy; usage counts each prompt once, as OpenAI does."""
    msgs = [{"role": "user", "content": "Tell me something."}]
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=8, temperature=1.0, seed=11)
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # different seeds per copy
    assert texts == [c.message.content for c in client.chat.completions.create(n=3, **kw).choices]
    singles = [client.chat.completions.create(n=1, **{**kw, "seed": 11 + j}) for j in range(3)]
    assert [x.choices[0].message.content for x in singles] == texts  # copy j is the n=1 answer at seed + j
    one = singles[0]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in singles)
    seen: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
        if chunk.usage:
            assert chunk.usage.prompt_tokens == one.usage.prompt_tokens
    assert [seen[i] for i in range(3)] == texts
    c = client.completions.create(model="tiny-llama", prompt=["ab", "cd"], n=2, max_tokens=4, temperature=1.0,
                                  seed=5)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    solo = [client.completions.create(model="tiny-llama", prompt=p, max_tokens=4, temperature=1.0, seed=5)
            .choices[0].text for p in ("ab", "cd")]
    assert [c.choices[0].text, c.choices[2].text] == solo  # prompt-major order, copy 0 first
