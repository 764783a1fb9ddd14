"""Tools with chat templates that refuse a system role or roles out of user/assistant order (Gemma's, Mistral's,
Llama 2's): a template without a tools section of its own gets the tools described in a system message, which
such a template refused with its own role error, blamed on a system message the client never sent."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.server.conftest import running_server
from tests.server.test_tool_calls_scripted import CONTEXT, TOOLS, ScriptedModel, _bundle

# google/gemma-2-2b-it's tokenizer_config.json chat_template
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
TURN = "<start_of_turn>model\n"
SCRIPTS = {"[one]": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}\n</tool_call>',
           "[two]": '<tool_call>\n{"name": "stop_line", "arguments": {"line": 4}}\n</tool_call>\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}\n</tool_call>',
           "[text]": "Line 4 is stopped."}


@pytest.fixture(scope="module")
def gemma(tiny_dense, tmp_path_factory):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(_bundle(tiny_dense, tmp_path_factory.mktemp("gemma"), GEMMA_TEMPLATE))
    be = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS, TURN, num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2)) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.backend = be
        yield srv


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_tools_with_a_template_that_refuses_a_system_role(gemma):
    """400 "chat template: System role not supported" for a request with no system message: the tools' system
    message was the server's own. They go into the first user turn instead."""
    r = gemma.client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "[one] Weather?"}],
                                             tools=TOOLS, max_tokens=200)
    assert _calls(r.choices[0].message) == [("get_weather", {"city": "Lyon", "unit": "C"})]
    prompt = gemma.backend.prompts[-1]
    assert prompt.count("<start_of_turn>user\n") == 1 and "<start_of_turn>system" not in prompt, prompt
    user = prompt.split("<start_of_turn>user\n", 1)[1]
    assert user.index('"name": "get_weather"') < user.index("[one] Weather?"), prompt  # the tools, then the question


def test_two_tool_results_with_a_template_that_wants_alternating_roles(gemma):
    """Each tool result became a user turn of its own: two results in a row broke the alternation the template
    demands (400 "Conversation roles must alternate"). Consecutive results share one user turn, as Qwen2.5's and
    Hermes' own templates write them."""
    first = gemma.client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "[two] Go"}],
                                                 tools=TOOLS, max_tokens=200).choices[0].message
    assert len(first.tool_calls) == 2
    history = [{"role": "user", "content": "[two] Go"}, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "line 4 stopped"},
               {"role": "tool", "tool_call_id": first.tool_calls[1].id, "content": "snow"}]
    r = gemma.client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=200)
    prompt = gemma.backend.prompts[-1]
    results = prompt.rsplit("<start_of_turn>user\n", 1)[1]
    assert "line 4 stopped" in results and "snow" in results, prompt
    assert r.choices[0].finish_reason in ("stop", "tool_calls")



# mistralai/Mistral-7B-Instruct-v0.3's tokenizer_config.json chat_template (it takes tools itself)
MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""


# what Mistral models write for calls: v3 tokenizers (7B v0.3) a JSON array, v11+ (Small 3.1+) name[ARGS]{...}
MISTRAL_SCRIPTS = {"[text]": "Done.",
                   "[v3]": 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}, '
                           '{"name": "stop_line", "arguments": {"line": 4}}]',
                   "[v11]": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "F"}[TOOL_CALLS]stop_line[ARGS]'
                            '{"line": 2}'}


@pytest.fixture(scope="module")
def mistral(tiny_dense, tmp_path_factory):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(_bundle(tiny_dense, tmp_path_factory.mktemp("mistral"), MISTRAL_TEMPLATE))
    be = ScriptedModel(Tokenizer.from_bundle(b), MISTRAL_SCRIPTS, "[/INST]", num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2)) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.backend = be
        yield srv


def test_a_tool_round_trip_with_mistrals_template(mistral):
    """Mistral's template takes only 9-character tool call ids ("Tool call IDs should be alphanumeric strings with
    length 9!"); this server's are OpenAI's "call_" + 24, so every history that sent a call's result back was a
    400 the client could not fix. Ids are mapped to 9 characters for such a template (as vLLM truncates them for
    Mistral), the same id to the same one."""
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Stop line 4"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0123456789abcdef01234567", "type": "function",
                    "function": {"name": "stop_line", "arguments": '{"line": 4}'}}]},
               {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "stopped"},
               {"role": "assistant", "content": "Stopped."}, {"role": "user", "content": "[text] thanks"}]
    r = mistral.client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=50)
    assert r.choices[0].message.content == "Done."
    prompt = mistral.backend.prompts[-1]
    ids = re.findall(r'"id": "(\w+)"', prompt) + re.findall(r'"call_id": "(\w+)"', prompt)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == 9 and ids[0].isalnum(), prompt
    assert "[AVAILABLE_TOOLS]" in prompt and '"name": "stop_line", "arguments": {"line": 4}' in prompt, prompt


@pytest.mark.parametrize("script, content, calls", [
    ("[v3]", "Checking.", [("get_weather", {"city": "Lyon", "unit": "C"}), ("stop_line", {"line": 4})]),
    ("[v11]", None, [("get_weather", {"city": "Oslo", "unit": "F"}), ("stop_line", {"line": 2})]),
])
def test_mistral_tool_calls_are_parsed(mistral, script, content, calls):
    """A Mistral model's calls after [TOOL_CALLS] came back as the message's text with finish_reason stop: the
    parser is picked from the template (it writes [TOOL_CALLS]), as vLLM's --tool-call-parser mistral reads them."""
    msgs = [{"role": "user", "content": f"{script} Weather, then stop a line"}]
    r = mistral.client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, max_tokens=200)
    m = r.choices[0]
    assert (m.message.content, _calls(m.message), m.finish_reason) == (content, calls, "tool_calls")
    assert _streamed(mistral, msgs, tools=TOOLS) == (content or "", calls, "tool_calls")


# Mistral's control tokens, special in its v3+ tokenizers (tokenizer.json "special": true)
MISTRAL_SPECIALS = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")


@pytest.fixture(scope="module")
def mistral_special(tiny_dense, tmp_path_factory):
    """A Mistral bundle whose [TOOL_CALLS], [ARGS], [CALL_ID] (and [INST], ...) are special tokens, as in the real
    tokenizers; a script's markers are emitted as those tokens."""
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(_bundle(tiny_dense, tmp_path_factory.mktemp("mistral-special"), MISTRAL_TEMPLATE,
                            specials=MISTRAL_SPECIALS))
    scripts = {**MISTRAL_SCRIPTS,
               "[v13]": '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo", "unit": "F"}',
               "[other]": "Done[INST].<|im_end|>"}
    tok = Tokenizer.from_bundle(b)
    for marker in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]"):
        assert tok.is_special(tok.token_id(marker)) and tok.encode(marker, add_special=False) == [tok.token_id(marker)]
    be = ScriptedModel(tok, scripts, "[/INST]", num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2)) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.backend = be
        yield srv


def _streamed(srv, msgs: list[dict], **kw) -> tuple[str, list[tuple[str, dict]], str | None]:
    got, text, finish = {}, "", None
    for chunk in srv.client.chat.completions.create(model="scripted", messages=msgs, max_tokens=200, stream=True,
                                                    **kw):
        d = chunk.choices[0].delta
        text += d.content or ""
        for t in d.tool_calls or []:
            e = got.setdefault(t.index, {"name": t.function.name, "arguments": ""})
            e["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, [(got[i]["name"], json.loads(got[i]["arguments"])) for i in sorted(got)], finish


@pytest.mark.parametrize("script, content, calls", [
    ("[v3]", "Checking.", [("get_weather", {"city": "Lyon", "unit": "C"}), ("stop_line", {"line": 4})]),
    ("[v11]", None, [("get_weather", {"city": "Oslo", "unit": "F"}), ("stop_line", {"line": 2})]),
    ("[v13]", None, [("get_weather", {"city": "Oslo", "unit": "F"})]),
])
def test_mistral_calls_whose_markers_are_special_tokens(mistral_special, script, content, calls):
    """With a real Mistral tokenizer [TOOL_CALLS], [ARGS], [CALL_ID] are special tokens, and the detokenizer
    skipped them: a v11+ call came out as the text 'get_weather{...}stop_line{...}' with finish_reason stop. The
    markers the Mistral parser reads are kept (as vLLM keeps special tokens for it), streamed and not."""
    msgs = [{"role": "user", "content": f"{script} Weather, then stop a line"}]
    r = mistral_special.client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, max_tokens=200)
    m = r.choices[0]
    assert (m.message.content, _calls(m.message), m.finish_reason) == (content, calls, "tool_calls")
    assert _streamed(mistral_special, msgs, tools=TOOLS) == (content or "", calls, "tool_calls")
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    out = mistral_special.client.responses.create(model="scripted", input=msgs[0]["content"], tools=flat,
                                                  max_output_tokens=200).output
    assert [(o.name, json.loads(o.arguments)) for o in out if o.type == "function_call"] == calls


def test_only_the_parsers_markers_are_kept(mistral_special):
    """Other special tokens ([INST], <|im_end|>) stay out of the content with tools, and without tools the markers
    are skipped too (no parser reads them)."""
    msgs = [{"role": "user", "content": "[other] Hi"}]
    for kw in ({"tools": TOOLS}, {}):
        r = mistral_special.client.chat.completions.create(model="scripted", messages=msgs, max_tokens=50, **kw)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Done.", "stop")
        assert _streamed(mistral_special, msgs, **kw) == ("Done.", [], "stop")
    r = mistral_special.client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "[v11] Go"}], max_tokens=200)
    assert r.choices[0].message.content == 'get_weather{"city": "Oslo", "unit": "F"}stop_line{"line": 2}'


def _reference(template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    """transformers' rendering of ``messages`` with ``template`` (bos "<s>"), the reference the server must match."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                        bos_token="<s>", eos_token="</s>", tools=tools)
    return rendered[0]


_CALL = {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "stop_line", "arguments": '{"line": 4}'}}
_CALLED = [{"role": "user", "content": "[text] Stop line 4"}, {"role": "assistant", "content": None,
                                                                "tool_calls": [_CALL]},
           {"role": "tool", "tool_call_id": _CALL["id"], "content": "stopped"}]


def _prompt(srv, messages: list[dict], **kw) -> str:
    """The prompt a chat request renders, as /tokenize encodes it (the backend sees it only at a generation prompt:
    Mistral's template writes none after a tool result)."""
    import httpx

    r = httpx.post(srv.url + "/tokenize", json={"model": "scripted", "messages": messages,
                                                "add_special_tokens": False, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return srv.backend.tok.decode(r.json()["tokens"], skip_special=False)


def test_the_system_text_reaches_the_model_after_a_tool_result_on_mistrals_template(mistral):
    """Mistral-7B-Instruct-v0.3's template writes the system message only into a last user turn: after a tool result
    transformers' rendering has no trace of it, so the client's instructions were dropped without a word. It goes
    into the last user turn (where mistral_common puts it), and the prompt is transformers' rendering of that."""
    from lineside.server.tool_calls import parse_tool_choice, parse_tools, template_messages

    history = [{"role": "system", "content": "Answer in French."}, *_CALLED]
    tools = parse_tools(TOOLS)
    sent, listed = template_messages(history, tools, MISTRAL_TEMPLATE, parse_tool_choice(None, tools))
    as_sent = template_messages(history[1:], tools, MISTRAL_TEMPLATE, parse_tool_choice(None, tools))[0]
    assert "Answer in French." not in _reference(MISTRAL_TEMPLATE, [history[0], *as_sent], listed)  # dropped
    r = mistral.client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=50)
    assert r.choices[0].finish_reason == "stop"
    prompt = _prompt(mistral, history, tools=TOOLS)  # what the chat request renders (its prompt_tokens)
    assert len(mistral.backend.tok.encode(prompt, add_special=False)) == r.usage.prompt_tokens
    assert "[INST] Answer in French.\n\n[text] Stop line 4[/INST]" in prompt, prompt
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert prompt == _reference(MISTRAL_TEMPLATE, sent, listed)
    r = mistral.client.chat.completions.create(  # a user turn last: the template's own placement, unchanged
        model="scripted", messages=[history[0], {"role": "user", "content": "[text] Hi"}], max_tokens=50)
    assert mistral.backend.prompts[-1] == _reference(MISTRAL_TEMPLATE, [history[0],
                                                                        {"role": "user", "content": "[text] Hi"}])


def test_a_system_message_with_no_user_turn_on_mistrals_template_is_one_400(mistral):
    with pytest.raises(openai.BadRequestError) as e:
        mistral.client.chat.completions.create(model="scripted", max_tokens=5, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hello"}])
    msg = e.value.body["message"]
    assert "system message" in msg and "add a user message" in msg and "\n" not in msg, msg


def test_a_user_message_right_after_a_tool_result_on_mistrals_template_is_one_400(mistral):
    """Mistral-7B-Instruct-v0.3's alternation check skips tool messages, so tool → user raised "conversation roles
    must alternate" though the client's roles do: a 400 naming the message and what to send instead."""
    history = [*_CALLED, {"role": "user", "content": "[text] And line 5?"}]
    with pytest.raises(Exception, match="roles must alternate"):
        _reference(MISTRAL_TEMPLATE, [*_CALLED[:1], {**_CALLED[1], "tool_calls": [
            {**_CALL, "id": "abcdefghi"}]}, {**_CALLED[2], "tool_call_id": "abcdefghi"}, history[-1]])
    with pytest.raises(openai.BadRequestError) as e:
        mistral.client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=50)
    body = e.value.body
    assert body["param"] == "messages" and "\n" not in body["message"], body
    assert body["message"].startswith("messages[3]: ") and "send the assistant's answer" in body["message"], body
    answered = [*_CALLED, {"role": "assistant", "content": "Line 4 is stopped."}, history[-1]]
    r = mistral.client.chat.completions.create(model="scripted", messages=answered, tools=TOOLS, max_tokens=50)
    assert r.choices[0].message.content == "Done."


def test_a_user_turn_after_a_tool_result_with_a_template_that_wants_alternating_roles(gemma):
    """tool → user: the tool result is written as a user turn (Gemma's template has no tool role), so the next user
    message made two user turns in a row and Gemma's template raised ("Conversation roles must alternate"), a 400
    the client could not fix. The question joins the results' turn, and the prompt is transformers' rendering of
    that conversation."""
    from lineside.server.tool_calls import parse_tool_choice, parse_tools, template_messages

    first = gemma.client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "[one] Go"}],
                                                 tools=TOOLS, max_tokens=200).choices[0].message
    history = [{"role": "user", "content": "[one] Go"}, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21C"},
               {"role": "user", "content": "[text] So, is line 4 stopped?"}]
    r = gemma.client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=200)
    assert r.choices[0].message.content == "Line 4 is stopped."
    prompt = gemma.backend.prompts[-1]
    last = prompt.rsplit("<start_of_turn>user\n", 1)[1]
    assert last.index("sunny, 21C") < last.index("[text] So, is line 4 stopped?"), prompt
    tools = parse_tools(TOOLS)
    rendered, _ = template_messages(history, tools, GEMMA_TEMPLATE, parse_tool_choice(None, tools))
    assert [m["role"] for m in rendered] == ["user", "assistant", "user"]
    assert prompt == _reference(GEMMA_TEMPLATE, rendered)


def test_continuing_a_response_that_failed_with_no_output_on_a_strict_template(tiny_dense, tmp_path):
    """/v1/responses: a response that failed before its first token keeps its input (as OpenAI keeps a failed
    response's), so continuing it with previous_response_id put two user turns in a row, and Gemma's template
    raised ("Conversation roles must alternate"). They render as one user turn, transformers' rendering of it."""
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer
    from tests.server.test_responses_api import _FailsOnce

    b = open_bundle(_bundle(tiny_dense, tmp_path, GEMMA_TEMPLATE))
    scripted = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS, TURN, num_slots=1, max_seq_len=CONTEXT)
    failing = _FailsOnce(scripted, fail_at=0)
    with running_server(LLMEngine(b, backend=failing, num_slots=1)) as srv:
        failing.calls, failing.fail_at = 0, 1  # the first step after loading: the prefill, before any token
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as e:
            client.responses.create(model="scripted", input="Is line 4 running?", max_output_tokens=20)
        rid = re.search(r"GET /v1/responses/(resp_\w+)", e.value.body["message"]).group(1)
        failed = client.responses.retrieve(rid)
        assert failed.status == "failed" and failed.output == []
        r = client.responses.create(model="scripted", input="[text] Please answer.", previous_response_id=rid,
                                    max_output_tokens=50)
        assert r.status == "completed" and r.output_text == "Line 4 is stopped."
        assert scripted.prompts[-1] == _reference(GEMMA_TEMPLATE, [
            {"role": "user", "content": "Is line 4 running?\n\n[text] Please answer."}])
        assert [i.content[0].text for i in client.responses.input_items.list(r.id).data] == \
            ["[text] Please answer."]  # its own input, as it was sent
