"""POST /tokenize, POST /detokenize, GET /version in vLLM's shapes: a count is exactly the prompt_tokens the
generation routes report for the same input (text, unicode, chats with a system prompt, tools, an assistant
prefill), ids go back to text, and bad bodies, unknown models, a missing key and oversized bodies are answered as
on the other routes."""

from __future__ import annotations

import json

import httpx
import pytest

import lineside
from tests.server.conftest import running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}


@pytest.fixture(scope="module")
def smol_server(smol_bundle):
    """SmolLM2's real tokenizer (BPE merges, a chat template with a default system prompt and a tool section)."""
    with running_server(smol_bundle, num_slots=1, threads=1) as srv:
        yield srv


def _post(url: str, path: str, body: object) -> httpx.Response:
    """``body`` as JSON with ASCII escapes (a lone surrogate travels as its ``\\ud800`` escape)."""
    return httpx.post(f"{url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


def _usage(url: str, path: str, body: dict) -> int:
    r = _post(url, path, {**body, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("text", ["Hello world", "naïve café 🙂 日本語 über", "\ufeffzero\u200bwidth and a BOM",
                                  "<s>text that spells the BOS token", "  two  spaces\n\nand lines\t",
                                  "<|im_start|>user\nspecial-token text<|im_end|>"])
@pytest.mark.parametrize("which", ["server", "smol_server"])
def test_prompt_count_is_the_completion_usage(request, which, text):
    server = request.getfixturevalue(which)
    r = _post(server.url, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == _usage(server.url, "/v1/completions", {"prompt": text})
    assert body["max_model_len"] == server.state.engine.max_seq_len
    assert body["token_strs"] is None
    # the same ids sent as a token-id prompt are the same prompt
    assert _usage(server.url, "/v1/completions", {"prompt": body["tokens"]}) == body["count"]


CHATS = [
    ({"messages": [{"role": "system", "content": "You answer in one word."},
                   {"role": "user", "content": "Colour of the sky? 🙂 ¿qué?"}]}),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                {"type": "text", "text": "part two"}]}]}),
    ({"messages": [{"role": "user", "content": "Weather in Lyon?"}], "tools": TOOLS}),
    ({"messages": [{"role": "user", "content": "Weather in Lyon?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": TOOLS}),
    ({"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}],
      "continue_final_message": True, "add_generation_prompt": False}),
    ({"messages": [{"role": "user", "content": "Say hi"}], "add_generation_prompt": False}),
]


@pytest.mark.parametrize("chat", CHATS)
def test_chat_count_is_the_chat_usage(smol_server, chat):
    server = smol_server
    r = _post(server.url, "/tokenize", chat)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == _usage(server.url, "/v1/chat/completions", chat)


def test_add_special_tokens_and_token_strings(server):
    tok = server.state.engine.tokenizer
    plain = _post(server.url, "/tokenize", {"prompt": "abc", "add_special_tokens": False}).json()["tokens"]
    with_bos = _post(server.url, "/tokenize", {"prompt": "abc"}).json()["tokens"]
    assert plain == tok.encode("abc", add_special=False) and with_bos == [tok.bos_token_id, *plain]
    body = _post(server.url, "/tokenize", {"prompt": "a é", "return_token_strs": True}).json()
    assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]
    pieces = _post(server.url, "/tokenize", {"prompt": "a é", "with_pieces": True,
                                             "add_special_tokens": False}).json()["tokens"]
    ids = [p["id"] for p in pieces]
    assert ids == tok.encode("a é", add_special=False)
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw == "a é".encode()  # a piece that is part of a character comes as its bytes, as llama.cpp's


def test_a_prompt_longer_than_the_context_is_counted_not_refused(server):
    context = server.state.engine.max_seq_len
    r = _post(server.url, "/tokenize", {"prompt": "x" * (context + 10), "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["count"] == context + 10 > r.json()["max_model_len"]


def test_detokenize_gives_back_the_rendered_text(server):
    chat = {"messages": [{"role": "user", "content": "héllo 🙂"}]}
    ids = _post(server.url, "/tokenize", chat).json()["tokens"]
    r = _post(server.url, "/detokenize", {"tokens": ids})
    assert r.status_code == 200
    text = r.json()["prompt"]
    assert "héllo 🙂" in text and text.startswith(server.state.engine.tokenizer.bos_token)  # specials kept
    assert _post(server.url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(("tokens", "param", "words"), [
    ([1, 2, 10**6, 10**7], "tokens", "tokens.2: token id 1000000 is outside the vocabulary"),
    ([1, 2**70], "tokens", "token id 1180591620717411303424 is outside"),
    ([1, -3], "tokens.1", "greater than or equal to 0"),
    ([1, True], "tokens.1", "valid integer"),
    ([1, 2.0], "tokens.1", "valid integer"),
    (["1"], "tokens.0", "valid integer"),
    ("1 2 3", "tokens", "valid list"),
    (None, "tokens", "valid list"),
])
def test_detokenize_bad_ids_are_a_400_naming_the_first(server, tokens, param, words):
    r = _post(server.url, "/detokenize", {"tokens": tokens})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({}, "prompt", "'prompt' (text to count) or 'messages'"),
    ({"model": "tiny-llama"}, "prompt", "or 'messages'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", "not both"),
    ({"prompt": ["a", "b"]}, "prompt", "valid string"),
    ({"prompt": 5}, "prompt", "valid string"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
      "continue_final_message": True}, "add_generation_prompt", "cannot both be true"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "valid boolean"),
    ({"prompt": "bad \ud800"}, "prompt", "not valid UTF-8"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]", None),
    ([1, 2], None, "JSON object"),
])
def test_tokenize_bad_bodies_are_one_line_400s(server, body, param, words):
    r = _post(server.url, "/tokenize", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    assert words is None or words in error["message"]


def test_malformed_json_and_empty_bodies(server):
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(f"{server.url}{path}", content=b'{"prompt": ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = httpx.post(f"{server.url}{path}", content=b"", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("request body is empty")


def test_model_names_as_on_the_generation_routes(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        assert _post(server.url, path, {**body, "model": server.state.model_name}).status_code == 200
        assert _post(server.url, path, {**body, "model": ""}).status_code == 200
        r = _post(server.url, path, {**body, "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_version(server):
    r = httpx.get(f"{server.url}/version")
    assert r.status_code == 200 and r.json() == {"version": lineside.__version__}


def test_key_and_body_limit_as_on_the_other_routes(tiny_bundle):
    with running_server(tiny_bundle, num_slots=1, threads=1, api_key="k", max_body_bytes=4096) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        for method, path, body in (("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [5]}),
                                   ("GET", "/version", None)):
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = c.request(method, path, json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200, r.text
        key = {"Authorization": "Bearer k"}
        r = c.post("/detokenize", json={"tokens": [5] * 5000}, headers=key)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = c.post("/tokenize", json={"prompt": "a" * 5000}, headers=key)
        assert r.status_code == 413

        def chunked():  # no Content-Length: the limit holds while the body is read
            yield b'{"tokens": ['
            for _ in range(2000):
                yield b"5, "
            yield b"5]}"

        r = c.post("/detokenize", content=chunked(), headers={**key, "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_long_prompts_strings_and_pieces_are_built_off_the_event_loop(server, monkeypatch):
    """A ~2.4 MB prompt's token strings / pieces (and their JSON) were built on the event loop: /health stalled for
    their ~0.5 s. Where the work runs is checked, not how long it takes: a running event loop in the thread that
    looks a token up means the loop itself is doing it."""
    import asyncio

    tok, compiler = server.state.engine.tokenizer, server.state.engine.grammar
    on_loop: list[str] = []

    def watched(name, fn):
        def call(i):
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:
                pass
            return fn(i)
        return call

    monkeypatch.setattr(tok, "id_to_token", watched("id_to_token", tok.id_to_token))
    monkeypatch.setattr(compiler, "token_bytes", watched("token_bytes", compiler.token_bytes))
    text = "x" * 20_000  # one token per character with the tiny tokenizer: past the inline limit
    body = _post(server.url, "/tokenize", {"prompt": text, "return_token_strs": True, "with_pieces": True,
                                           "add_special_tokens": False}).json()
    assert body["count"] == 20_000 and body["token_strs"] == ["x"] * 20_000, body["count"]
    assert body["tokens"][:2] == [{"id": tok.encode("x", add_special=False)[0], "piece": "x"}] * 2
    assert on_loop == [], f"{len(on_loop)} lookups ran on the event loop"
    short = _post(server.url, "/tokenize", {"prompt": "xy", "return_token_strs": True}).json()
    assert short["token_strs"] == [tok.id_to_token(i) for i in short["tokens"]]  # short ones stay inline


def test_a_chat_of_many_empty_messages_is_rendered_off_the_event_loop(server, monkeypatch):
    """Only the messages' text decided: thousands of empty turns (which some templates rescan turn by turn) were
    rendered on the event loop. Where the work runs is checked, not how long it takes."""
    import asyncio

    tok = server.state.engine.tokenizer
    on_loop: list[bool] = []
    encode_chat = tok.encode_chat

    def watched(*a, **k):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return encode_chat(*a, **k)

    monkeypatch.setattr(tok, "encode_chat", watched)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(301)]
    r = _post(server.url, "/tokenize", {"messages": many})
    assert r.status_code == 200, r.text
    short = _post(server.url, "/tokenize", {"messages": many[:3]})
    assert short.status_code == 200, short.text
    assert on_loop == [False, True], on_loop  # the long conversation in a worker, a short one inline (faster)


def test_add_special_tokens_on_completions_is_what_tokenize_counts(server):
    """vLLM's ``add_special_tokens`` on /v1/completions (false: no BOS in front of the text, for a client that
    writes its own) is taken as /tokenize takes it: the count is the prompt_tokens, and the answer that of the same
    ids sent as a token-id prompt (the field was dropped: BOS went in all the same)."""
    for body in ({"prompt": "abc", "add_special_tokens": False}, {"prompt": ["abc", "de"], "add_special_tokens": False}):
        counted = [_post(server.url, "/tokenize", {"prompt": p, "add_special_tokens": False}).json()["tokens"]
                   for p in ([body["prompt"]] if isinstance(body["prompt"], str) else body["prompt"])]
        assert server.state.engine.tokenizer.bos_token_id not in counted[0]
        assert _usage(server.url, "/v1/completions", body) == sum(map(len, counted))
        text = _post(server.url, "/v1/completions", {**body, "max_tokens": 4, "temperature": 0}).json()
        ids = _post(server.url, "/v1/completions", {"prompt": counted, "max_tokens": 4, "temperature": 0}).json()
        assert [c["text"] for c in text["choices"]] == [c["text"] for c in ids["choices"]]


@pytest.fixture(scope="module")
def bos_on_request_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle as a model with a BOS token it does not add by itself (add_bos_token false, as Qwen2's or
    SmolLM2's), so a chat's BOS comes only from its template or add_special_tokens."""
    import shutil

    out = tmp_path_factory.mktemp("bos-on-request") / tiny_bundle.name
    shutil.copytree(tiny_bundle, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["add_bos_token"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_chat_add_special_tokens_adds_what_the_tokenizer_adds(bos_on_request_bundle):
    """vLLM's chat ``add_special_tokens: true`` adds what transformers' encode(add_special_tokens=True) adds to the
    rendered text: nothing for a model with a BOS token it does not add. /tokenize put that BOS in front anyway, so
    its count was one more than the chat's prompt_tokens; chat dropped the field untyped ("yes" was no 400)."""
    from transformers import AutoTokenizer

    plain_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")
    hf = AutoTokenizer.from_pretrained(bos_on_request_bundle / "tokenizer")
    msgs = [{"role": "user", "content": "the oven runs hot"}]
    text = hf.apply_chat_template(msgs, chat_template=plain_template, tokenize=False, add_generation_prompt=True)
    with running_server(bos_on_request_bundle, num_slots=2, threads=1, chat_template=plain_template) as srv:
        for add in (False, True):
            counted = _post(srv.url, "/tokenize", {"messages": msgs, "add_special_tokens": add}).json()["tokens"]
            assert counted == hf.encode(text, add_special_tokens=add), add
            r = _post(srv.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0,
                                                        "add_special_tokens": add})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(counted), r.text
            r = _post(srv.url, "/v1/prefill", {"messages": msgs, "session_id": f"bos-{add}", "add_special_tokens": add})
            assert r.status_code == 202 and r.json()["prompt_tokens"] == len(counted), r.text
        bad = _post(srv.url, "/v1/chat/completions", {"messages": msgs, "add_special_tokens": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens", bad.text
