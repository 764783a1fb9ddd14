"""What clients written for OpenAI / vLLM / llama.cpp / Ollama send, field by field: each documented request
field is either honoured or refused with one 400 line naming it; an unknown model is OpenAI's 404; token-id
prompts of any length; tool_choice without tools; the body limit holds for chunked uploads too."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import make_engine, running_server

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and "\n" not in err["message"]
    return err


# (endpoint, extra fields, expected status, param named by the 400)
FIELDS = [
    ("chat", {"n": 1, "user": "u-1", "seed": 7, "stop": [], "logprobs": False, "top_logprobs": 0}, 200, None),
    ("chat", {"stop": "\n", "temperature": 2, "top_p": 1e-9, "presence_penalty": 2, "frequency_penalty": -2}, 200, None),
    ("chat", {"max_completion_tokens": 2, "max_tokens": None, "tools": [], "tool_choice": "none"}, 200, None),
    ("chat", {"response_format": {"type": "text"}, "parallel_tool_calls": False, "logit_bias": {}}, 200, None),
    ("chat", {"n": 2}, 200, None),
    ("chat", {"n": 65}, 400, "n"),
    ("chat", {"stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("chat", {"max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat", {"temperature": 2.5}, 400, "temperature"),
    ("chat", {"top_p": 0}, 400, "top_p"),
    ("chat", {"presence_penalty": 2.5}, 400, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, 400, "frequency_penalty"),
    ("chat", {"logprobs": True, "top_logprobs": 20}, 200, None),
    ("chat", {"top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"logit_bias": {"5": 10}}, 200, None),
    ("chat", {"logit_bias": {"5": 101}}, 200, None),  # clamped to 100, as vLLM does
    ("completions", {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("chat", {"response_format": {"type": "json_object"}}, 200, None),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     400, "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("chat", {"guided_regex": "[a&&b]"}, 400, "guided_regex"),
    # tool_choice none still renders the tools (as vLLM): described as text, they outgrow this server's 256 tokens
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, 400, "messages"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools[1].function.name"),
    ("chat", {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
    ("chat", {"function_call": {"name": "f"}}, 400, "function_call"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content"),
    ("completions", {"echo": True}, 200, None),
    ("completions", {"echo": True, "max_tokens": 0, "logprobs": 1}, 200, None),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("completions", {"logprobs": 2}, 200, None),
    ("completions", {"logprobs": 20}, 200, None),  # vLLM's bound, past OpenAI's 5
    ("completions", {"logprobs": 21}, 400, "logprobs"),
    ("completions", {"guided_choice": ["a", "b"]}, 200, None),
    ("completions", {"guided_json": "{oops"}, 400, "guided_json"),
    ("completions", {"best_of": 3}, 400, "best_of"),
    ("completions", {"suffix": "end"}, 400, "suffix"),
    # vLLM takes OpenAI's response_format on completions too: a bad one is refused, never dropped
    ("completions", {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, 400, "response_format.json_schema.schema"),
    ("completions", {"response_format": {"type": "json_object"}, "guided_regex": "x"}, 400, "guided_regex"),
    # vLLM's sampling extras: stop_token_ids is honoured; the others change the answer, so set they are refused
    # (never silently ignored), at their defaults accepted
    ("chat", {"stop_token_ids": [5, 6], "min_tokens": 0, "include_stop_str_in_output": False, "bad_words": [],
              "allowed_token_ids": None, "use_beam_search": False, "skip_special_tokens": True}, 200, None),
    # vLLM's min_tokens is honoured (tests/server/test_min_tokens.py), with any stop or grammar, up to max_tokens
    ("chat", {"min_tokens": 4}, 400, "min_tokens"),  # above max_tokens (2)
    ("completions", {"min_tokens": 2, "ignore_eos": True}, 200, None),  # what benchmark harnesses send
    ("chat", {"min_tokens": 1, "max_completion_tokens": 2, "ignore_eos": True}, 200, None),
    ("completions", {"min_tokens": 3, "ignore_eos": True}, 400, "min_tokens"),  # above max_tokens
    ("completions", {"min_tokens": 2, "stop": ["x"]}, 200, None),
    ("completions", {"min_tokens": 2, "stop_token_ids": [5]}, 200, None),
    ("completions", {"min_tokens": 2, "guided_choice": ["a", "b"]}, 200, None),
    ("completions", {"min_tokens": -1}, 400, "min_tokens"),
    ("completions", {"include_stop_str_in_output": True, "stop": ["x"]}, 200, None),  # vLLM's, honoured
    ("completions", {"include_stop_str_in_output": "yes please"}, 400, "include_stop_str_in_output"),
    # stop: up to 16 strings (past OpenAI's 4: vLLM sets no limit) of up to 256 characters; empty ones are dropped
    ("chat", {"stop": ["\u2603"] * 16}, 200, None),
    ("chat", {"stop": ["\u2603"] * 17}, 400, "stop"),
    ("completions", {"stop": ["x" * 257]}, 400, "stop"),
    ("completions", {"stop": ["", "\u2603"]}, 200, None),
    ("chat", {"bad_words": ["x"]}, 400, "bad_words"),
    ("completions", {"allowed_token_ids": [5]}, 400, "allowed_token_ids"),
    ("completions", {"truncate_prompt_tokens": 8}, 400, "truncate_prompt_tokens"),
    ("chat", {"use_beam_search": True}, 400, "use_beam_search"),
    ("completions", {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("chat", {"skip_special_tokens": False}, 200, None),  # vLLM's, honoured
    ("chat", {"skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    # vLLM's spaces_between_special_tokens: either value (the same text with these tokenizers); a wrong type was
    # silently dropped with the unknown fields
    ("chat", {"skip_special_tokens": False, "spaces_between_special_tokens": False}, 200, None),
    ("completions", {"spaces_between_special_tokens": True}, 200, None),
    ("chat", {"spaces_between_special_tokens": "no"}, 400, "spaces_between_special_tokens"),
    ("completions", {"spaces_between_special_tokens": 0}, 400, "spaces_between_special_tokens"),
    # vLLM's extras that change the answer and are not done here: refused, not dropped; at their defaults they pass
    ("chat", {"priority": 0, "return_tokens_as_token_ids": False, "guided_whitespace_pattern": None,
              "structural_tag": None}, 200, None),
    ("chat", {"priority": 5}, 400, "priority"),
    ("completions", {"priority": -1}, 400, "priority"),
    ("chat", {"logprobs": True, "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    ("completions", {"logprobs": 1, "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    ("chat", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]*"}, 400,
     "guided_whitespace_pattern"),
    ("chat", {"structural_tag": "{}"}, 400, "structural_tag"),
    ("completions", {"stop_token_ids": [-1]}, 400, "stop_token_ids.0"),
    # stream_options without stream: true is a 400 at OpenAI and vLLM (nothing would read it)
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"stream": False, "stream_options": {"include_usage": False}}, 400, "stream_options"),
    ("chat", {"stream": False, "stream_options": None}, 200, None),
    # OpenAI's output modalities and hosted search: text only is served; asking for audio or a web search was
    # silently answered with plain text
    ("chat", {"modalities": ["text"], "audio": None, "web_search_options": None}, 200, None),
    ("chat", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, 400, "modalities"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("chat", {"modalities": ["image"]}, 400, "modalities"),
    ("chat", {"web_search_options": {}}, 400, "web_search_options"),
    # metadata, store, service_tier, user, prediction change nothing in the answer: accepted (as vLLM)
    ("chat", {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "user": "u",
              "prediction": {"type": "content", "content": "hi"}}, 200, None),
]


@pytest.mark.parametrize("endpoint,extra,status,param", FIELDS)
def test_documented_fields_honoured_or_refused(server, endpoint, extra, status, param):
    base = {"messages": MSGS} if endpoint == "chat" else {"prompt": "hi"}
    body = {"model": MODEL, **base, "max_tokens": 2, **extra}
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body,
                   timeout=30)
    if status == 200:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 2 * (extra.get("n") or 1)
        assert len(r.json()["choices"]) == (extra.get("n") or 1)
    else:
        err = _err(r, 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"


def test_stop_token_ids_end_the_answer_as_vllms(server):
    """vLLM's stop_token_ids reach the engine: with every id a stop, the first token ends the answer (finish_reason
    stop, its text left out; tests/runtime/test_engine_rules.py checks where a given id cuts)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    cut = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": list(range(300))},
                     timeout=30).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 8
    assert (cut["choices"][0]["finish_reason"], cut["choices"][0]["text"]) == ("stop", "")
    assert cut["usage"]["completion_tokens"] == 1


def test_completions_follow_response_format(server):
    """response_format on /v1/completions constrains the text as on chat (vLLM's CompletionRequest has it); it was
    an unknown field, silently dropped, so a client asking for JSON got free text."""
    schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": ["alpha", "beta"]}}}
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 16, "temperature": 0, "response_format": schema,
                "stream": stream}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        else:
            text = r.json()["choices"][0]["text"]
        assert json.loads(text) in ("alpha", "beta")


def test_token_id_prompt_longer_than_64_tokens(server):
    """A flat token-id list is ONE prompt: its length is bounded by the context, not by the prompts-per-request cap."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100 and len(r.json()["choices"]) == 1
    err = _err(httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 300, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and "300" in err["message"] and "256" in err["message"]
    err = _err(httpx.post(server.url + "/v1/completions", json={"prompt": [[5]] * 65, "max_tokens": 2}), 400)
    assert "65 prompts" in err["message"]


def test_unknown_model_is_openai_404(server, client):
    for create in (lambda: client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2),
                   lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=2),
                   lambda: client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2, stream=True)):
        with pytest.raises(openai.NotFoundError) as e:
            create()
        assert e.value.code == "model_not_found" and e.value.param == "model"
        assert "'gpt-4o'" in e.value.message and f"'{MODEL}'" in e.value.message
    for path in ("/v1/models/gpt-4o", "/v1/models/"):  # GET retrieves: the same error
        err = _err(httpx.get(server.url + path), 404)
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    # the served name, an empty one, or none at all: served
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).model == MODEL
    for body in ({"prompt": "x", "max_tokens": 1}, {"model": "", "prompt": "x", "max_tokens": 1}):
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


def test_tool_choice_without_tools(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, tool_choice=choice)
        assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, tool_choice="required")
    assert e.value.param == "tool_choice" and "tool_choice 'required'" in e.value.message


def test_chunked_body_over_the_limit_is_413(tiny_bundle):
    """Without a Content-Length the limit is counted while reading, so a chunked upload cannot get past it."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"a" * 1024
        yield b'", "max_tokens": 1}'

    with running_server(make_engine(tiny_bundle, num_slots=1), max_body_bytes=4096) as srv:
        url = srv.url + "/v1/completions"
        err = _err(httpx.post(url, content=chunks(), headers={"content-type": "application/json"}), 413)
        assert err["code"] == "body_too_large" and "4096" in err["message"]
        ok = httpx.post(url, content=iter([b'{"prompt": "hi", ', b'"max_tokens": 1}']),
                        headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text


def test_a_huge_unsupported_value_is_named_in_one_short_line(server):
    """A refused vLLM extra was echoed whole into the message: 10,000 bad words made a 50 kB "one line". Now its
    first few items are shown (reprlib), the param still names it."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
        for field, value in (("bad_words", ["word"] * 10_000), ("allowed_token_ids", list(range(10_000))),
                             ("logits_processors", ["x" * 10_000])):
            err = _err(httpx.post(server.url + path, json={**body, field: value}), 400)
            assert err["param"] == field and len(err["message"]) < 200 and "\n" not in err["message"], err


def test_assistant_prefill_with_vllms_continue_final_message(server):
    """By default a trailing assistant message is a closed turn (OpenAI); vLLM's continue_final_message makes
    the model continue it: the prompt is the rendered chat cut right after that message's text."""
    url = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    tok = server.state.engine.tokenizer
    closed = tok.apply_chat_template(msgs, add_generation_prompt=False)
    cut = closed[:closed.rindex("Sure") + len("Sure")]
    assert cut != closed  # the template closes the turn after the text: the cut matters
    want = httpx.post(server.url + "/v1/completions",
                      json={"prompt": tok.encode(cut), "max_tokens": 6, "temperature": 0}).json()
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        got = httpx.post(url, json={"messages": msgs, "max_tokens": 6, "temperature": 0, **extra}).json()
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] == len(tok.encode(cut))
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    default = httpx.post(url, json={"messages": msgs, "max_tokens": 1, "temperature": 0}).json()
    assert default["usage"]["prompt_tokens"] > want["usage"]["prompt_tokens"]  # a new assistant turn was opened
    err = _err(httpx.post(url, json={"messages": msgs, "max_tokens": 1, "continue_final_message": True,
                                     "add_generation_prompt": True}), 400)
    assert err["param"] == "add_generation_prompt"
    # nothing to continue: the 400 names continue_final_message (its param was null), even when the request's
    # template variables would otherwise be blamed for a failed render
    empty = [*msgs[:1], {"role": "assistant", "content": ""}]
    for extra in ({}, {"chat_template_kwargs": {"unread": 1}}):
        err = _err(httpx.post(url, json={"messages": empty, "max_tokens": 1, "continue_final_message": True,
                                         **extra}), 400)
        assert "continue_final_message" in err["message"] and err["param"] == "continue_final_message", err


def test_seed_is_any_int64_like_openai(server):
    """OpenAI's seed is a signed 64-bit integer: negative seeds are accepted and reproducible, but -1, which vLLM
    and llama.cpp's server read as no seed (test_param_ranges.py); outside int64 is a 400 naming seed."""
    url = server.url + "/v1/completions"
    for seed in (-2, -(2**63), 2**63 - 1):
        body = {"prompt": "seed", "max_tokens": 6, "temperature": 1.0, "seed": seed}
        a, b = (httpx.post(url, json=body) for _ in range(2))
        assert a.status_code == 200, a.text
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    for seed in (2**63, -(2**63) - 1):
        assert _err(httpx.post(url, json={"prompt": "x", "seed": seed}), 400)["param"] == "seed"
