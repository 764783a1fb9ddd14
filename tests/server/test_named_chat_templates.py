"""A bundle with named chat templates ("default" + "tool_use", as Hermes-2-Pro and Command-R ship) served end to
end: a request with tools renders "tool_use" (as transformers and vLLM pick it), and everything that reads "the"
template reads that one — the tool-call format ``auto`` parses, Mistral's 9-character call ids, the tools'
fallback, ``--reasoning-parser auto`` — on chat completions, /v1/responses and /v1/prefill alike.

The scripted model of test_tool_calls_scripted plays the model and records each prompt it was given."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.server.conftest import running_server
from tests.server.test_tool_calls_scripted import CONTEXT, TOOLS, ScriptedModel

# "tool_use": Qwen2.5 / Hermes' shape (tools in the system turn, calls in <tool_call> tags), and Mistral's check
# that a call id in the history has 9 characters
TOOL_USE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}
{%- if c.id is string and c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# "default" of the plain kind: ChatML, no tools, earlier turns' reasoning cut at </think> (R1-Distill's first
# release): --reasoning-parser auto turns on for it
_LOOP = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{{ (m.content or '').split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PLAIN = _LOOP
# "default" that has a tool section of its own, asking for Llama 3.x's bare JSON calls
JSON_CALLS = ("{% if tools %}<|im_start|>system\nReply with JSON {\"name\": function name, \"parameters\": arguments} to "
              "call one of: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}" + _LOOP)
# Command-R's third: documents to ground the answer in
RAG = "RAG-TEMPLATE" + _LOOP
TURN = "<|im_start|>assistant\n"
SCRIPTS = {
    "[one]": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}\n</tool_call>',
    "[think]": "Pondering.</think>Line 4 runs.",
    "[text]": "Line 4 is stopped.",
}
FALLBACK = "You are provided with function signatures"  # tool_calls.tools_system_prompt's words


def _bundle(tiny_dense, tmp_path, templates: dict[str, str]):
    """A tiny bundle whose vocabulary has ChatML's markers, <tool_call> and <think> tags, and these templates."""
    from tokenizers import AddedToken, Tokenizer

    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dense("llama-gqa"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": CONTEXT}))
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False) for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": [{"name": k, "template": v} for k, v in templates.items()]}))
    return build_bundle(ckpt, tmp_path / "scripted", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=CONTEXT))


@pytest.fixture(scope="module", params=["plain", "json"])
def srv(request, tiny_dense, tmp_path_factory):
    """--reasoning-parser auto: "default" cuts at </think>, "tool_use" knows no tag."""
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    default = PLAIN if request.param == "plain" else JSON_CALLS
    b = open_bundle(_bundle(tiny_dense, tmp_path_factory.mktemp(request.param),
                            {"default": default, "tool_use": TOOL_USE, "rag": RAG}))
    be = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS, TURN, num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2), reasoning_parser="auto",
                        trust_request_chat_template=True) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        s.backend = be
        yield s


def _ask(srv, script: str, messages=None, **kw):
    msgs = messages or [{"role": "user", "content": f"{script} Is line 4 running?"}]
    return srv.client.chat.completions.create(model="scripted", messages=msgs, temperature=0, max_tokens=200, **kw)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_a_chat_with_tools_renders_tool_use_and_its_calls_parse(srv):
    r = _ask(srv, "[one]", tools=TOOLS)
    prompt = srv.backend.prompts[-1]
    assert "# Tools" in prompt and json.dumps(TOOLS[0]) in prompt and FALLBACK not in prompt
    assert _calls(r.choices[0].message) == [("get_weather", {"city": "Lyon", "unit": "C"})]
    assert r.choices[0].finish_reason == "tool_calls"


def test_a_chat_without_tools_renders_default_and_its_reasoning_parses(srv):
    m = _ask(srv, "[think]").choices[0].message.model_dump()
    assert "# Tools" not in srv.backend.prompts[-1]
    assert (m["reasoning_content"], m["content"]) == ("Pondering.", "Line 4 runs.")


def test_history_with_openai_call_ids_renders_through_tool_use(srv):
    """tool_use checks Mistral's 9-character ids: the server's own ids (call_ + 24) are cut for it."""
    first = _ask(srv, "[one]", tools=TOOLS).choices[0].message
    assert len(first.tool_calls[0].id) > 9
    history = [{"role": "user", "content": "[one] Is line 4 running?"}, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"},
               {"role": "user", "content": "[text] And now?"}]
    r = _ask(srv, "", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "Line 4 is stopped."
    assert "<tool_response>\nsunny\n</tool_response>" in srv.backend.prompts[-1]


def test_responses_and_prefill_render_tool_use(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/responses", json={"input": "[one] Is line 4 running?", "tools": [
            {"type": "function", **TOOLS[0]["function"]}], "max_output_tokens": 200, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "# Tools" in srv.backend.prompts[-1]
        calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
        assert [(o["name"], json.loads(o["arguments"])) for o in calls] == [("get_weather", {"city": "Lyon",
                                                                                             "unit": "C"})]
        msgs = [{"role": "user", "content": "[text] Station 4?"}]
        p = c.post("/v1/prefill", json={"messages": msgs, "tools": TOOLS, "session_id": "s"})
        assert p.status_code == 202, p.text
        chat = c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 8,
                                                     "temperature": 0})
        assert "# Tools" in srv.backend.prompts[-1]
        assert p.json()["prompt_tokens"] == chat.json()["usage"]["prompt_tokens"]


def test_a_request_chat_template_may_name_one_of_the_bundles(srv):
    """vLLM hands a request's chat_template to transformers' apply_chat_template, which takes a template's name
    too: "rag" rendered Command-R's rag template there, and was refused here as a template without the messages."""
    r = _ask(srv, "[think]", extra_body={"chat_template": "rag"})
    assert r.choices[0].message.content == "Line 4 runs."  # rag cuts at </think> too: auto parses its reasoning
    assert srv.backend.prompts[-1].startswith("RAG-TEMPLATE<|im_start|>user")
    with pytest.raises(openai.BadRequestError) as e:  # not a name here: Jinja text, checked as before
        _ask(srv, "[text]", extra_body={"chat_template": "summary"})
    assert e.value.body["param"] == "chat_template"
