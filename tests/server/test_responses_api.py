"""/v1/responses on the tiny model through the openai client: text out, instructions, streaming events in
order, json_schema text format honoured, and a 400 naming each field it cannot honour."""

from __future__ import annotations

import json

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


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
                                max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"ok"}


@pytest.mark.parametrize("kw, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(reasoning={"effort": "high"}), "reasoning"),
    (dict(background=True), "background"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0].type"),
    (dict(text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "nope"}}}), "text.format.schema"),
])
def test_unsupported_is_400_naming_it(client, kw, param):
    kw = {"input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=4, **kw)
    assert e.value.body["param"] == param and "\n" not in e.value.body["message"]
