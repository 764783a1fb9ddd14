"""What the official ``openai`` client sends, checked against what OpenAI (and vLLM, where OpenAI is silent) do
with it: roles, content parts, and the client's own helpers over a served tiny bundle."""

from __future__ import annotations

import json

import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_a_developer_message_is_a_system_message(client):
    """OpenAI's newer models take their instructions as ``developer`` messages; the model's template knows only
    ``system`` (the tiny one writes any role it is given)."""
    def ask(role):
        return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Which station?"}])

    developer, system = ask("developer"), ask("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_text_parts_are_joined_by_newlines_as_vllm_and_llama_cpp_join_them(client):
    """A message's text parts are separate pieces of text (an instruction, then a document): vLLM and llama.cpp's
    server render them joined by a newline, never glued into one word."""
    def ask(content):
        return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": content}])

    parts = ask([{"type": "text", "text": "Summarise:"}, {"type": "text", "text": "pump 4 stopped"}])
    joined = ask("Summarise:\npump 4 stopped")
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content
    # the Responses API's input_text parts the same way
    parts = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Summarise:"}, {"type": "input_text", "text": "pump 4 stopped"}]}], store=False)
    joined = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input="Summarise:\npump 4 stopped",
                                     store=False)
    assert parts.usage.input_tokens == joined.usage.input_tokens and parts.output_text == joined.output_text


def test_an_assistant_refusal_part_in_the_history_is_its_text(client):
    """OpenAI's assistant messages may carry ``refusal`` parts (what its models answered when refusing); a client
    replaying the conversation sends them back. vLLM renders them as the message's text."""
    def ask(content):
        return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": "Open the valve."}, {"role": "assistant", "content": content},
            {"role": "user", "content": "Why not?"}])

    parts = ask([{"type": "refusal", "refusal": "I can't do that."}])
    text = ask("I can't do that.")
    assert parts.usage.prompt_tokens == text.usage.prompt_tokens
    assert parts.choices[0].message.content == text.choices[0].message.content


def test_bodies_validate_against_the_openai_clients_own_types(server):
    """The client builds its objects without validating them, so a missing required field only shows as ``None``
    where a caller reads it; validated with the client's own pydantic types, every body and event is complete."""
    import json

    import httpx
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    url = server.url + "/v1"
    msgs = [{"role": "user", "content": "hi"}]
    ChatCompletion.model_validate(httpx.post(f"{url}/chat/completions", timeout=30, json={
        "messages": msgs, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json())
    Completion.model_validate(httpx.post(f"{url}/completions", timeout=30, json={
        "prompt": "hi", "max_tokens": 3, "logprobs": 2}).json())
    Response.model_validate(httpx.post(f"{url}/responses", timeout=30, json={
        "input": "hi", "max_output_tokens": 3, "store": False}).json())
    events = TypeAdapter(ResponseStreamEvent)
    for path, body, check in (
            ("chat/completions", {"messages": msgs, "max_tokens": 3, "stream": True,
                                  "stream_options": {"include_usage": True}}, ChatCompletionChunk.model_validate),
            ("responses", {"input": "hi", "max_output_tokens": 3, "stream": True, "store": False},
             events.validate_python)):
        with httpx.stream("POST", f"{url}/{path}", json=body, timeout=30) as r:
            datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert datas
        for data in datas:
            check(json.loads(data))


@pytest.mark.parametrize("extra, param", [
    ({"max_output_tokens": True}, "max_output_tokens"),  # was a 1-token answer
    ({"max_output_tokens": 2**31}, "max_output_tokens"),
    ({"temperature": "0"}, "temperature"),
    ({"stream": "false"}, "stream"),
    ({"store": "no"}, "store"),  # was read as false: the response was not kept
    ({"metadata": {"shift": 3}}, "metadata.shift"),
])
def test_responses_fields_are_typed_as_strictly_as_chat_fields(server, extra, param):
    """/v1/responses takes what OpenAI takes, as chat completions do (schemas.py): no true for 1, no "no" for
    false; each is a 400 naming the field, not a request read some other way."""
    import httpx

    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("responses", {"input": "hi", "max_output_tokens": 1, "store": False}),
])
@pytest.mark.parametrize("metadata, param", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"),
    ({"shift": 3}, "metadata.shift"),
])
def test_metadata_past_openais_limits_is_the_same_400_on_both_endpoints(server, path, body, metadata, param):
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 characters, values up to 512; past them one 400
    naming it, on chat completions (which took anything) as on responses. Within them both answer."""
    import httpx

    r = httpx.post(f"{server.url}/v1/{path}", json={**body, "metadata": metadata}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"], err
    most = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert httpx.post(f"{server.url}/v1/{path}", json={**body, "metadata": most}, timeout=30).status_code == 200


def test_logit_bias_shifts_the_logits_as_openai_defines_it(client, server):
    """OpenAI's (and vLLM's, llama.cpp's) logit_bias: token id → a bias added to its logit before sampling; +100
    makes a token the only choice, -100 bans it. Token ids are strings in JSON; an id past the vocabulary or a key
    that is not one is a 400 naming logit_bias; a bias outside -100..100 is clamped to it (as vLLM does)."""
    tok = server.state.engine.tokenizer
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]

    def answer(bias):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           temperature=0, logit_bias=bias, logprobs=True)
        return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]

    text, logprobs = answer({str(a): 100, str(b): 99})
    assert text == "aaa" and all(lp > -1.4 for lp in logprobs)  # log(e^100 / (e^100 + e^99 + ...)) ≈ -0.31
    text, logprobs = answer({str(a): -100, str(b): 99})
    assert text == "bbb" and all(lp > -1e-3 for lp in logprobs)
    assert answer({str(a): 1e9, str(b): 99}) == answer({str(a): 100, str(b): 99})  # clamped: e^1e9 overflowed
    for bias in ({"a": 1}, {"1.5": 1}, {str(10**6): 1}, {"-1": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           logit_bias=bias)
        assert e.value.param == "logit_bias" and "\n" not in e.value.message


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_stats_puts_each_choices_usage_in_every_chunk(server, chat):
    """vLLM's stream_options.continuous_usage_stats (it was accepted and silently ignored): with include_usage, every
    chunk carries its choice's usage so far; the last chunk still carries the whole request's."""
    import httpx

    from lineside.server import sse

    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "count"}]}) if chat
                  else ("/v1/completions", {"prompt": "count"}))
    body = {**body, "max_tokens": 5, "n": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = httpx.post(server.url + path, json=body, timeout=60)
    events = [e for e in sse.parse(r.text) if e != "[DONE]"]
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    seen: dict[int, int] = {}
    for e in chunks:
        (choice,) = e["choices"]
        u = e["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert u["completion_tokens"] >= seen.get(choice["index"], 0)
        seen[choice["index"]] = u["completion_tokens"]
    assert seen == {0: 5, 1: 5} and u["prompt_tokens"] == last["usage"]["prompt_tokens"]  # one prompt, n = 2
    plain = httpx.post(server.url + path, json={**body, "stream_options": {"include_usage": True}}, timeout=60)
    assert all(e["usage"] is None for e in sse.parse(plain.text)[:-2])


def test_logprobs_asked_for_are_an_object_even_when_the_answer_is_empty(client):
    """A model that ends at once (its first token is the end of turn, not shown) answers empty text. The logprobs
    block was ``null`` then, so a client reading ``choice.logprobs.content`` / ``.tokens`` as it does for every
    other answer raised AttributeError; vLLM (and OpenAI) send the block with empty lists whenever logprobs were
    asked for."""
    eos = {"2": 100}  # the tiny model's end-of-sequence id, made certain
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True, logit_bias=eos,
                                          messages=[{"role": "user", "content": "Say nothing."}])
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content == []
    text = client.completions.create(model=MODEL, prompt="Say nothing.", max_tokens=4, temperature=0, logprobs=2,
                                     logit_bias=eos)
    assert text.choices[0].text == "" and text.choices[0].finish_reason == "stop"
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens == [] and lp.token_logprobs == [] and lp.text_offset == []
    plain = client.completions.create(model=MODEL, prompt="Say nothing.", max_tokens=4, temperature=0, logit_bias=eos)
    assert plain.choices[0].logprobs is None  # not asked for: still null


def test_text_offset_of_a_special_token_adds_no_text(client):
    """A special token the model generates (ignore_eos) is not in the text (skipped when decoding, as vLLM's default
    skip_special_tokens), so the tokens after it start where it did. text_offset added its display string
    ("</s>": 4 characters), and every offset after it pointed past the text's end."""
    eos = {"2": 100}  # the tiny model's end-of-sequence id, every time
    r = client.completions.create(model=MODEL, prompt="Say nothing.", max_tokens=3, temperature=0, logprobs=0,
                                  logit_bias=eos, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "" and lp.tokens == ["</s>"] * 3
    assert lp.text_offset == [0, 0, 0]
    streamed = client.completions.create(model=MODEL, prompt="Say nothing.", max_tokens=3, temperature=0,
                                         logprobs=0, logit_bias=eos, extra_body={"ignore_eos": True}, stream=True)
    assert [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] \
        == [0, 0, 0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_text_with_unicode_line_separators_stays_one_line_per_event(server, path):
    """U+2028, U+2029 and U+0085 are line breaks to Python's str.splitlines, which httpx's ``iter_lines`` and requests'
    ``iter_lines(decode_unicode=True)`` split a stream with: written raw inside a ``data:`` line, a delta holding one
    (a model echoing pasted text) cut the event in two and the client's json.loads failed on each half. JSON may
    escape any character: they are sent as \\u escapes, and the text a client decodes is the same."""
    import httpx

    text = "a\u2028b\u2029c\x85d"
    body = {"max_tokens": 12, "temperature": 0, "stream": True, "guided_regex": text.replace("\x85", "\\x85")}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    got = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])
    assert got == text


def test_best_of_equal_to_n_is_n_and_fewer_than_n_is_refused(client):
    """OpenAI's and vLLM's best_of defaults to n: best_of == n returns every sample, the answer n alone gives (the
    same seeded choices); best_of < n is a 400 there, and so is one past n here (ranking samples is not done)."""
    def ask(**kw):
        return client.completions.create(model=MODEL, prompt="Pump 4 is", max_tokens=5, n=2, seed=11, **kw)

    plain, same = ask(), ask(best_of=2)
    assert [c.text for c in same.choices] == [c.text for c in plain.choices] and len(same.choices) == 2
    assert same.usage == plain.usage
    for best_of, code in ((1, "invalid_value"), (3, "unsupported_value")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(best_of=best_of)
        assert e.value.body["param"] == "best_of" and e.value.body["code"] == code
        assert "best_of=2" in e.value.body["message"]  # what to send instead
