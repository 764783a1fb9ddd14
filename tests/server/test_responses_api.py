"""/v1/responses on the tiny model through the openai client: text out, instructions, streaming events in
order, json_schema text format honoured, and a 400 naming each field it cannot honour."""

from __future__ import annotations

import json
import re

import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_create_and_stream_agree(client):
    kw = dict(model=MODEL, input="hi", instructions="be brief", max_output_tokens=6, temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_cached_tokens_count_the_prompt_the_prefix_cache_gave(client):
    """usage.input_tokens_details.cached_tokens was always 0; a repeated long input reuses its prefix's KV and says so
    (what the engine's prefix cache gave the request), streamed and not."""
    kw = dict(model=MODEL, input="the line stops at station twelve when the oven runs hot " * 2, max_output_tokens=2,
              temperature=0)
    first = client.responses.create(**kw)
    again = client.responses.create(**kw)
    streamed = [e for e in client.responses.create(stream=True, **kw) if e.type.startswith("response.")][-1]
    for r in (again, streamed.response):
        cached = r.usage.input_tokens_details.cached_tokens
        assert 0 < cached < r.usage.input_tokens, (first.usage, r.usage)


def test_generate_summary_is_read_as_summary(client):
    """OpenAI's deprecated name of reasoning.summary, which older clients send: reported back as the summary taken,
    as one sent as summary is (it was accepted and dropped: the response said summary null)."""
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                reasoning={"effort": "low", "generate_summary": "concise"})
    assert (r.reasoning.effort, r.reasoning.summary) == ("low", "concise")


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
                                max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"ok"}


@pytest.mark.parametrize("kw, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),  # hosted tools: functions only
    (dict(reasoning={"effort": "extreme"}), "reasoning.effort"),  # effort is taken (rendered as chat's), checked
    (dict(reasoning={"generate_summary": "long"}), "reasoning.generate_summary"),  # summary's old name: checked too
    (dict(background=True), "background"),
    # server-side compaction: was dropped, the kept conversation grew past the context instead of being compacted
    (dict(context_management=[{"type": "compaction", "compact_threshold": 1000}]), "context_management"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0].type"),
    # a text part without a string: was read as "" (null, missing) or "5" (a number), a reply to another input
    (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": None}]}]), "input[0].content[0].text"),
    (dict(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text"),
    (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]), "input[0].content[0].text"),
    (dict(text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "nope"}}}), "text.format.schema"),
    # chat's and vLLM's output constraints: read by nothing here, the answer came back unconstrained
    (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
    (dict(extra_body={"guided_choice": ["a", "b"]}), "guided_choice"),
    (dict(extra_body={"structured_outputs": {"regex": "a+"}}), "structured_outputs"),
])
def test_unsupported_is_400_naming_it(client, kw, param):
    kw = {"input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=4, **kw)
    assert e.value.body["param"] == param and "\n" not in e.value.body["message"]


def _prompt_tokens(server, messages) -> int:
    """How many tokens the server's chat rendering makes of ``messages`` (what a response's input_tokens count)."""
    from lineside.server.chat_rendering import server_rendering

    state = server.state
    return len(state.engine.tokenizer.encode_chat(messages, **server_rendering(state).options()))


def test_previous_response_id_continues_the_kept_conversation(client, server):
    """A turn that names an earlier response reads that response's input and output before its own input, without
    the earlier instructions (OpenAI carries input and output over, not instructions); a chain reads every turn."""
    kw = dict(model=MODEL, max_output_tokens=5, temperature=0)
    r1 = client.responses.create(input="name a colour", instructions="answer in one word", **kw)
    assert r1.store is True and r1.previous_response_id is None
    r2 = client.responses.create(input="and another", previous_response_id=r1.id, **kw)
    assert r2.previous_response_id == r1.id
    turns = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "and another"}]
    assert r2.usage.input_tokens == _prompt_tokens(server, turns)
    assert r2.usage.input_tokens != _prompt_tokens(server, [{"role": "system", "content": "answer in one word"},
                                                            *turns])
    r3 = client.responses.create(input=[{"role": "user", "content": "one more"}], previous_response_id=r2.id,
                                 instructions="be brief", **kw)
    chain = [{"role": "system", "content": "be brief"}, *turns, {"role": "assistant", "content": r2.output_text},
             {"role": "user", "content": "one more"}]
    assert r3.usage.input_tokens == _prompt_tokens(server, chain)
    # the same turn streamed reads the same prompt and writes the same greedy text, and is kept too
    events = list(client.responses.create(stream=True, input="and another", previous_response_id=r1.id, **kw))
    done = events[-1].response
    assert done.output_text == r2.output_text and done.usage.input_tokens == r2.usage.input_tokens
    assert client.responses.retrieve(done.id).output_text == r2.output_text


def test_kept_responses_are_retrieved_and_deleted(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.output_tokens == r.usage.output_tokens
    assert client.responses.delete(r.id) is None  # the client reads {"deleted": true} as success
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=3, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    assert "\n" not in e.value.body["message"]


def test_input_items_lists_the_requests_input_in_pages(client):
    """input_items.list was a 404 ("no such endpoint"): the SDK exposes it, the store has the input. Now it lists the
    request's input items (ids, roles, text parts as the SDK's ResponseItem types read them), newest first by
    default, paged by after / limit as the SDK's cursor page follows them; a response not kept is a 404."""
    given = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "x"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
             {"type": "message", "role": "user", "content": "again"}]
    r = client.responses.create(model=MODEL, input=given, max_output_tokens=2)
    items = list(client.responses.input_items.list(r.id, order="asc", limit=2))  # two pages, then one of none
    assert [(i.type, i.role) for i in items] == [("message", "developer"), ("message", "user"),
                                                 ("message", "assistant"), ("message", "user")]
    assert [[p.text for p in i.content] for i in items] == [["be brief"], ["hi", "x"], ["hello"], ["again"]]
    assert items[1].content[0].type == "input_text" and items[2].content[0].type == "output_text"
    assert len({i.id for i in items}) == 4
    newest = client.responses.input_items.list(r.id)
    assert [i.id for i in newest.data] == [i.id for i in reversed(items)] and not newest.has_more
    one = client.responses.input_items.list(r.id, limit=1)
    assert one.has_more and one.data[0].id == items[-1].id
    assert [i.content[0].text for i in client.responses.input_items.list(
        client.responses.create(model=MODEL, input="solo", max_output_tokens=2).id).data] == ["solo"]
    for bad, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.input_items.list(r.id, **bad)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.input_items.list(
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False).id)
    assert e.value.body["param"] == "response_id"


def test_a_resent_request_id_does_not_replace_a_kept_response(client):
    """The response id is the server's own: two requests with one X-Request-Id (a client's retry, a proxy's trace
    id) keep two responses, each continued and retrieved as itself."""
    first, second = (client.responses.create(model=MODEL, input=text, max_output_tokens=3, temperature=0,
                                             extra_headers={"X-Request-Id": "trace-1"}) for text in ("hi", "bye"))
    assert first.id != second.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=3, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_store_keeps_the_most_recently_used():
    from lineside.server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(2)
    for rid in "abc":
        if rid == "c":
            assert store.get("a") is not None  # a is used again: b is now the oldest
        store.put(rid, StoredResponse({"id": rid}, ()))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None and len(store) == 2
    none = ResponseStore(0)
    none.put("a", StoredResponse({"id": "a"}, ()))
    assert none.get("a") is None and len(none) == 0
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_a_server_without_a_store_says_so(tiny_bundle):
    from tests.server.conftest import running_server

    with running_server(tiny_bundle, num_slots=1, threads=1, max_stored_responses=0) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        r = c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id=r.id)
        assert "keeps its last 0" in e.value.body["message"]


@pytest.mark.parametrize("field, value, param", [
    ("instructions", "a\ud800b", "instructions"),
    ("metadata", {"k": "a\ud800b"}, "metadata.k"),
    ("user", "a\ud800b", "user"),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": "a\ud800b"}]}], "input"),
])
def test_a_lone_surrogate_anywhere_is_400_naming_the_field(server, field, value, param):
    """A JSON escape such as \\ud800 parses to a lone surrogate, which no tokenizer, template or JSON encoder takes:
    in ``instructions`` it was a 500 TypeError from the tokenizer, in ``metadata`` or ``user`` (echoed in the
    response) a 500 from the response's serialization; now the 400 invalid_utf8 the input's text gets, naming it."""
    import httpx

    raw = json.dumps({"input": "hi", "max_output_tokens": 2, field: value})  # escapes the surrogate as \ud800
    r = httpx.post(f"{server.url}/v1/responses", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_utf8", param) and "\n" not in err["message"]


def test_a_stream_that_fails_midway_ends_failed_with_the_output_so_far(tiny_bundle):
    """A timeout mid-stream ends in response.failed holding the text streamed so far (its message done
    ``incomplete``), the tokens used, and an error the SDK's Response type reads (its code is one of OpenAI's);
    it ended with an empty output, no usage and a code outside the SDK's enum."""
    from openai.types.responses import Response

    from tests.server.conftest import make_engine, running_server

    with running_server(make_engine(tiny_bundle, num_slots=1, delay=0.02), request_timeout=0.3) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        events = list(c.responses.create(model=MODEL, input="hi", max_output_tokens=200, temperature=0, stream=True))
    last = events[-1]
    assert last.type == "response.failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    body = Response.model_validate(last.response.model_dump())
    assert body.error.code == "server_error" and "timeout" in body.error.message
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and body.output_text == streamed and body.output[0].status == "incomplete"
    assert [e.type for e in events[-4:-1]] == ["response.output_text.done", "response.content_part.done",
                                               "response.output_item.done"]
    assert body.usage.output_tokens > 0 and body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens


def test_seed_samples_as_chat_samples_it(client):
    """``seed`` (extra_body, as on chat) was dropped with the unknown fields: a seeded response did not repeat.
    Now it seeds the sampler as chat's does: the same prompt, seed and temperature write chat's text."""
    kw = dict(temperature=1.0, extra_body={"seed": 1234})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, **kw)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=8, **kw)
    assert r.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=8, extra_body={"seed": "1"})
    assert e.value.body["param"] == "seed"


def test_top_logprobs_are_the_output_texts_logprobs(client):
    """top_logprobs was accepted and ignored (the text's logprobs stayed []), and include's
    message.output_text.logprobs was a 400. Now either asks for them: each output token's logprob with its
    alternatives, as chat gives them for the same greedy answer, streamed on the deltas and done events too."""
    kw = dict(model=MODEL, input="hi", max_output_tokens=5, temperature=0, include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    r = client.responses.create(top_logprobs=2, **kw)
    got = r.output[0].content[0].logprobs
    assert r.top_logprobs == 2 and len(got) == 5
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in got] == [
        (t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat]
    events = list(client.responses.create(top_logprobs=2, stream=True, **kw))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [t.logprob for t in deltas] == [t.logprob for t in done.logprobs] == [t.logprob for t in got]
    assert [t.logprob for t in events[-1].response.output[0].content[0].logprobs] == [t.logprob for t in got]
    alone = client.responses.create(**kw).output[0].content[0].logprobs  # include alone: no alternatives
    assert [t.logprob for t in alone] == [t.logprob for t in got] and all(not t.top_logprobs for t in alone)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as e:  # the calls' tokens are not the text's: refused, not mixed in
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, top_logprobs=1, tools=[tool])
    assert e.value.body["param"] == "top_logprobs", e.value.body


def test_cancel_says_only_background_responses_cancel(client):
    """responses.cancel was a 404 'no such endpoint' even for a kept response. As OpenAI's, cancel is for
    background responses (which this server refuses): a kept one is a 400 saying so, an unknown one a 404."""
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(r.id)
    assert "background" in e.value.body["message"] and e.value.body["param"] == "response_id"
    assert client.responses.retrieve(r.id).status == r.status  # untouched
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.cancel("resp_nope")
    assert e.value.body["param"] == "response_id" and "resp_nope" in e.value.body["message"]


class _FailsOnce:
    """A backend whose ``fail_at``-th step raises once (an engine error mid-generation: every request in flight ends
    with finish_reason error), then steps as usual."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.calls, self.fail_at = inner, 0, fail_at
        for name in ("name", "flavor", "num_slots", "max_seq_len", "vocab_size"):
            setattr(self, name, getattr(inner, name))

    def forward(self, batch):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected device fault")
        return self.inner.forward(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_response_is_kept_and_retrieved_failed(tiny_bundle, stream):
    """A response whose generation fails (an engine error after some tokens) is kept as OpenAI keeps one: GET
    answers it with status failed, its error, the output produced so far and the usage; it was never stored, so
    ``responses.retrieve`` got a 404. ``store: false`` still keeps nothing."""
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from tests.server.conftest import running_server

    b = open_bundle(tiny_bundle)
    backend = _FailsOnce(OnnxRuntimeBackend(b, num_slots=1, threads=1), fail_at=8)
    with running_server(LLMEngine(b, backend=backend, num_slots=1)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        kw = dict(model=MODEL, input="hi", max_output_tokens=50, temperature=0)
        if stream:
            events = list(c.responses.create(**kw, stream=True))
            assert events[-1].type == "response.failed"
            rid = events[-1].response.id
            streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        else:
            with pytest.raises(openai.InternalServerError) as e:
                c.responses.create(**kw)
            assert e.value.body["code"] == "engine_error"  # the error, as chat's; its message names what was kept
            rid = re.search(r"GET /v1/responses/(resp_\w+)", e.value.body["message"]).group(1)
            streamed = None
        got = c.responses.retrieve(rid)
        assert got.status == "failed" and got.id == rid
        assert got.error.code == "server_error" and "injected device fault" in got.error.message
        assert got.usage.output_tokens > 0 and got.usage.input_tokens > 0
        assert got.output and got.output[0].status == "incomplete"
        assert got.output_text and (streamed is None or got.output_text == streamed)
        assert [i.content[0].text for i in c.responses.input_items.list(rid).data] == ["hi"]
        backend.calls, backend.fail_at = 0, 8
        if stream:
            events = list(c.responses.create(**kw, stream=True, store=False))
            assert events[-1].type == "response.failed" and events[-1].response.store is False
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(events[-1].response.id)
        else:
            with pytest.raises(openai.InternalServerError) as e:
                c.responses.create(**kw, store=False)
            assert "resp_" not in e.value.body["message"]


def test_retrieve_streamed_is_refused_for_a_finished_response(client):
    """responses.retrieve(id, stream=True) got the JSON body, which the SDK's stream reads as no events at all (an
    app waiting on them saw an empty stream). As OpenAI's, only a background response streams again (this server
    makes none): a 400 naming stream; an include other than the text's logprobs a 400 naming include."""
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(r.id, stream=True))
    assert e.value.body["param"] == "stream" and "background" in e.value.body["message"]
    assert "\n" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.retrieve(r.id, include=["reasoning.encrypted_content"])
    assert e.value.body["param"] == "include"
    assert client.responses.retrieve(r.id, include=["message.output_text.logprobs"]).id == r.id
    assert client.responses.retrieve(r.id, stream=False).id == r.id


def test_completed_at_is_set_when_the_response_completed(client):
    """completed_at was always null; OpenAI's is the Unix time the response completed (only when completed), which
    apps read for how long a response took. Created, streamed and retrieved alike; null for an incomplete one."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}  # ends: completed
    kw = dict(model=MODEL, input="hi", temperature=0, text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    done = client.responses.create(max_output_tokens=30, **kw)
    assert done.status == "completed", done.incomplete_details
    streamed = list(client.responses.create(stream=True, max_output_tokens=30, **kw))
    assert streamed[0].response.completed_at is None  # response.created: not yet
    for r in (done, streamed[-1].response, client.responses.retrieve(done.id)):
        assert r.completed_at is not None and r.created_at <= r.completed_at
    cut = client.responses.create(max_output_tokens=1, **kw)
    assert cut.status == "incomplete" and cut.completed_at is None


@pytest.mark.parametrize("metadata, param", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"),
])
def test_metadata_past_openais_limits_is_400(client, metadata, param):
    """metadata of any size was kept and echoed; OpenAI's is at most 16 pairs, keys up to 64 characters, values up to
    512, and past them a 400 (an app that worked here failed there). Within them it is echoed and kept."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=1, metadata=metadata)
    assert e.value.body["param"] == param and "\n" not in e.value.body["message"]
    most = {f"{i:064d}": "v" * 512 for i in range(16)}
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, metadata=most)
    assert r.metadata == most and client.responses.retrieve(r.id).metadata == most


def test_input_tokens_count_is_what_create_reports(client, server):
    """The SDK's ``responses.input_tokens.count`` (POST /v1/responses/input_tokens) was a 405 saying to send GET;
    it is the ``usage.input_tokens`` create reports for the same body: instructions, message items, a call and its
    output, a kept conversation. An input past the context is counted, not refused."""
    first = client.responses.create(model=MODEL, input="name a colour", max_output_tokens=3, temperature=0)
    bodies = [
        dict(input="hi"),
        dict(input=[{"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "input_text", "text": "stop line 4"}]}],
             instructions="you run a factory"),
        dict(input=[{"role": "user", "content": "stop line 4"},
                    {"type": "function_call", "call_id": "call_1", "name": "stop_line", "arguments": '{"line": 4}'},
                    {"type": "function_call_output", "call_id": "call_1", "output": "stopped"}]),
        dict(input="and another", previous_response_id=first.id),
    ]
    for body in bodies:
        counted = client.responses.input_tokens.count(model=MODEL, **body)
        assert counted.object == "response.input_tokens"
        made = client.responses.create(model=MODEL, max_output_tokens=1, **body)
        assert counted.input_tokens == made.usage.input_tokens, body
    context = server.state.engine.max_seq_len
    long = client.responses.input_tokens.count(model=MODEL, input="station " * context)
    assert long.input_tokens > context
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input="x", previous_response_id="resp_gone")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "input[0].role" and "\n" not in e.value.body["message"]


@pytest.mark.parametrize("text, param", [
    ({"fromat": {"type": "json_object"}}, "text.fromat"),
    ({"format": {"type": "json_object"}, "schema": {"type": "object"}}, "text.schema"),
    ({"verbosity": "loud"}, "text.verbosity"),
])
def test_a_text_option_it_cannot_read_is_400_naming_it(client, text, param):
    """``text`` keys other than format were dropped silently: a misspelt ``format`` gave unconstrained output with
    a 200. Now a 400 names them; OpenAI's ``verbosity`` (low / medium / high) is taken and echoed."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=1, text=text)
    assert e.value.body["param"] == param and "\n" not in e.value.body["message"]
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, text={"verbosity": "low"})
    assert r.text.verbosity == "low" and r.text.format.type == "text"
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=1).text.verbosity == "medium"


@pytest.mark.parametrize("given", [["hi"], [{"role": "user", "content": "hi"}, 5], [None]])
def test_an_input_item_not_an_object_is_400_naming_it(client, given):
    """An item that is no object was refused as the whole 'input' ("Input should be a valid string"), naming
    neither the item nor what to send; now the 400 names input[i]."""
    i = next(j for j, item in enumerate(given) if not isinstance(item, dict))
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=given, max_output_tokens=1)
    assert e.value.body["param"] == f"input[{i}]" and "\n" not in e.value.body["message"]
    assert "object" in e.value.body["message"]


@pytest.mark.parametrize("stored", [True, False])
def test_a_grammar_failure_mid_response_keeps_its_param(stored):
    """A non-streamed /v1/responses whose schema fails mid-generation answers the 400 naming text.format.schema (as
    chat's does), and the kept failed response's error names it too."""
    from lineside.server.errors import APIError
    from lineside.server.response_store import ResponseStore
    from lineside.server.responses_api import ResponseBuilder, ResponsesRequest

    store = ResponseStore(4)
    b = ResponseBuilder(ResponsesRequest(input="hi", store=stored), "m", "r1", store=store, conversation=[])
    error = APIError(400, "text.format.schema: cannot be completed", "grammar_dead_end", param="text.format.schema",
                     type="invalid_request_error")
    out = b.failed_final(error, "{\"a\": ", (3, 4))
    assert (out.status, out.code, out.param) == (400, "grammar_dead_end", "text.format.schema"), vars(out)
    events = ResponseBuilder(ResponsesRequest(input="hi", stream=True), "m", "r2", store=store,
                             conversation=[]).failed(error, (3, 4))
    failed = json.loads(events[-1].split("data: ", 1)[1])["response"]
    assert failed["error"]["param"] == "text.format.schema" and failed["usage"]["output_tokens"] == 4, failed


def _chat_and_response(client, **extra):
    """The same greedy request on chat and on /v1/responses with vLLM's fields ``extra``: (chat's content and
    completion tokens, the response's text and output tokens)."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, extra_body=extra)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=6, temperature=0, extra_body=extra)
    return (chat.choices[0].message.content, chat.usage.completion_tokens), (r.output_text, r.usage.output_tokens)


def test_vllm_sampling_fields_sample_as_chat_samples_them(client, server):
    """vLLM's /v1/responses takes top_k, the penalties, logit_bias, stop, ignore_eos, ... as its chat does; here they
    were dropped with the unknown fields and the answer changed silently. Each now gives chat's answer, and one
    the plain request does not give (so none is ignored)."""
    eos = server.state.engine.tokenizer.eos_token_ids[0]
    plain = _chat_and_response(client)[0]
    forced = 70  # "d", a byte token of the tiny vocabulary
    seeded = {"temperature": 1.0, "seed": 7}
    cases = {  # name: (the fields, the request they change the answer of)
        "top_k": ({**seeded, "top_k": 1}, seeded),  # top_k 1 is greedy whatever the temperature
        "min_p": ({**seeded, "min_p": 0.5}, seeded),
        "repetition_penalty": ({"repetition_penalty": 0.1}, {}),
        "presence_penalty": ({"presence_penalty": -2.0}, {}),
        "frequency_penalty": ({"frequency_penalty": 2.0, "logit_bias": {str(forced): 3}},
                              {"logit_bias": {str(forced): 3}}),
        "logit_bias": ({"logit_bias": {str(forced): 100}}, {}),
        "stop_token_ids": ({"logit_bias": {str(forced): 100}, "stop_token_ids": [forced]},
                           {"logit_bias": {str(forced): 100}}),
        "stop": ({"stop": [plain[0][-1]]}, {}),
        "include_stop_str_in_output": ({"stop": [plain[0][-1]], "include_stop_str_in_output": True},
                                       {"stop": [plain[0][-1]]}),
        "min_tokens": ({"logit_bias": {str(eos): 100}, "min_tokens": 3}, {"logit_bias": {str(eos): 100}}),
        "ignore_eos": ({"logit_bias": {str(eos): 100}, "ignore_eos": True}, {"logit_bias": {str(eos): 100}}),
    }
    answers = {}
    for name, (extra, without) in cases.items():
        chat, response = _chat_and_response(client, **extra)
        assert response == chat, name
        assert chat != _chat_and_response(client, **without)[0], name  # the field changed the answer
        answers[name] = chat
    # EOS first: masked for 3 tokens, then it ends the answer (4 tokens); ignored, the answer runs to max_tokens
    assert answers["min_tokens"][1] == 4 and answers["ignore_eos"][1] == 6, answers


@pytest.mark.parametrize("extra, param", [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"stop": ["a"] * 17}, "stop"), ({"stop": [1]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"ignore_eos": "true"}, "ignore_eos"), ({"min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"bad_words": ["x"]}, "bad_words"), ({"allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"), ({"use_beam_search": True}, "use_beam_search"),
    ({"priority": 1}, "priority"), ({"chat_template_kwargs": 1}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_a_bad_vllm_sampling_field_is_400_naming_it(client, extra, param):
    """Each was dropped with the unknown fields (a 200 whatever its value); now checked as chat checks it."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_chat_template_kwargs_reach_the_template(tiny_bundle):
    """vLLM's chat_template_kwargs on /v1/responses render as chat's: a variable the template reads changes the
    prompt (here its length, as /v1/responses/input_tokens counts it and usage reports it)."""
    from tests.server.conftest import running_server

    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if extra %}{{ extra }}{% endif %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    with running_server(tiny_bundle, num_slots=1, threads=1, chat_template=template) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        kw = dict(model=MODEL, input="hi", max_output_tokens=1, temperature=0)
        base = c.responses.create(**kw).usage.input_tokens
        more = c.responses.create(**kw, extra_body={"chat_template_kwargs": {"extra": "abcde"}}).usage.input_tokens
        ignored = c.responses.create(**kw, extra_body={"chat_template_kwargs": {"unread": 1}}).usage.input_tokens
    assert more == base + 5 and ignored == base
