"""``tool_choice: "auto"`` end to end, on a model that calls tools the way Qwen2.5 and Llama 3.x do.

No tool-calling model can be installed here, so a scripted backend plays one: it reads the prompt the server
rendered (through a Qwen-style ChatML template with a tools section, or a Llama-3.x-style one), finds which
script the user asked for, and emits that script's tokens — through the bundle's real tokenizer (with
``<tool_call>`` / ``</tool_call>`` as single added tokens, as in Qwen2.5's vocabulary), the engine, the
detokenizer and the server — to the real ``openai`` client. Shown: the tools reach the template, text before a
call, parallel calls, streamed ``function.arguments`` deltas, ``finish_reason: tool_calls``, a malformed or
unknown call falling back to content, and the tool result in the history of the next turn."""

from __future__ import annotations

import json
import shutil

import numpy as np
import openai
import pytest

from tests.runtime.fakes import FakeBackend
from tests.server.conftest import running_server

# Templates written for these tests in the shape of the models' own (ChatML + "# Tools" + <tool_call> for
# Qwen2.5; header ids, tools in the system turn, bare JSON calls and an ipython role for results for Llama 3.x).
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions to assist with the user query.
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>

For each function call, return <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}
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

LLAMA_TEMPLATE = """{%- for m in messages %}
{%- if loop.first and tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
You have these functions; to call one, reply with JSON {"name": function name, "parameters": arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CONTEXT = 2048  # one token per byte: the tool signatures alone are ~500
TURN = {"qwen": "<|im_start|>assistant\n", "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "stop_line", "description": "Stop a production line",
                                      "parameters": {"type": "object", "properties": {
                                          "line": {"type": "integer"}}, "required": ["line"]}}},
]
SCRIPTS = {
    "qwen": {
        "[one]": 'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Lyon", "unit": "C"}}\n</tool_call>',
        "[two]": '<tool_call>\n{"name": "stop_line", "arguments": {"line": 4}}\n</tool_call>\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}\n</tool_call>',
        "[text]": "It is sunny in Lyon today, 21 degrees.",
        "[cut]": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ly',
        "[unknown]": '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        "[after-result]": "Line 4 is stopped.",
        "[args]": '{"city": "Lyon", "unit": "C"}',  # what a named tool_choice's grammar lets through
    },
    "llama": {
        "[one]": '{"name": "get_weather", "parameters": {"city": "Lyon", "unit": "C"}}',
        "[two]": '{"name": "stop_line", "parameters": {"line": 4}}; '
                 '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}',
        "[text]": "It is sunny in Lyon today, 21 degrees.",
        "[cut]": '{"name": "get_weather", "parameters": {"city": "Ly',
        "[unknown]": '{"answer": 42}',
        "[after-result]": "Line 4 is stopped.",
        "[args]": '{"city": "Lyon", "unit": "C"}',
    },
}


class ScriptedModel(FakeBackend):
    """Plays a tool-calling model: the script named in the last user turn, token by token, then EOS. The
    prompts it was given are kept (decoded, special tokens included) so a test can read what was rendered."""

    def __init__(self, tokenizer, scripts: dict[str, str], turn: str, **kw):
        super().__init__(**kw)
        self.tok, self.scripts_by_key = tokenizer, scripts
        self.turn = tokenizer.encode(turn, add_special=False)
        self.prompts: list[str] = []

    def logits(self, seq: list[int]) -> np.ndarray:
        n = len(self.turn)
        starts = [i for i in range(len(seq) - n + 1) if seq[i:i + n] == self.turn]
        x = np.full(self.vocab_size, -1e9, dtype=np.float32)
        if not starts:  # inside the prompt (a prefill position other than the last): any logits do
            return x
        cut = starts[-1] + n
        prompt = self.tok.decode(seq[:cut], skip_special=False)
        if cut == len(seq):
            self.prompts.append(prompt)
        last_user = prompt.rsplit("user", 1)[-1]
        key = next((k for k in self.scripts_by_key if k in last_user), None)
        script = self.tok.encode(self.scripts_by_key[key], add_special=False) if key else []
        i = len(seq) - cut
        x[script[i] if i < len(script) else self.eos] = 0.0
        return x


def _bundle(tiny_dense, tmp_path, template: str, specials: tuple[str, ...] = ()):
    """A tiny bundle rendering with ``template``; ``specials``: more special tokens (Mistral's control tokens)."""
    from tokenizers import AddedToken, Tokenizer

    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dense("llama-gqa"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": CONTEXT}))  # bytes are tokens
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", *specials])
    assert tok.get_vocab_size() <= 300  # the checkpoint's vocabulary
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": template}))
    return build_bundle(ckpt, tmp_path / "scripted", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=CONTEXT))


@pytest.fixture(scope="module", params=["qwen", "llama"])
def model(request, tiny_dense, tmp_path_factory):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    family = request.param
    b = open_bundle(_bundle(tiny_dense, tmp_path_factory.mktemp(family),
                            QWEN_TEMPLATE if family == "qwen" else LLAMA_TEMPLATE))
    be = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS[family], TURN[family], num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2)) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.family, srv.backend = family, be
        yield srv


def _ask(model, script: str, stream: bool = False, messages=None, **kw):
    msgs = messages or [{"role": "user", "content": f"{script} What should we do?"}]
    return model.client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, temperature=0,
                                                max_tokens=200, stream=stream, **kw)


def _streamed(model, script: str):
    content, calls, finish, arg_chunks = "", {}, None, 0
    for c in _ask(model, script, stream=True):
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id:
                assert e["id"] is None, "a call's id comes once, in its first delta"
                e["id"], e["name"] = t.id, t.function.name
            if t.function and t.function.arguments:
                e["arguments"] += t.function.arguments
                arg_chunks += 1
        finish = c.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, arg_chunks


def test_the_tools_reach_the_models_template(model):
    _ask(model, "[text]")
    prompt = model.backend.prompts[-1]
    for t in TOOLS:
        assert json.dumps(t, ensure_ascii=False) in prompt  # rendered by the model's own tool section
    assert ("# Tools" if model.family == "qwen" else "Environment: ipython") in prompt
    assert "You may call one or more functions" not in prompt or model.family == "qwen"  # no fallback prompt


def test_text_then_a_call(model):
    r = _ask(model, "[one]")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == ("Let me check the weather." if model.family == "qwen" else None)
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lyon", "unit": "C"}
    content, calls, finish, chunks = _streamed(model, "[one]")
    assert finish == "tool_calls" and content == (ch.message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Lyon", "unit": "C"})]
    assert calls[0]["id"].startswith("call_")
    assert chunks > 3  # the arguments stream as the model writes them, not in one piece at the end


def test_parallel_calls(model):
    r = _ask(model, "[two]")
    got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    want = [("stop_line", {"line": 4}), ("get_weather", {"city": "Oslo", "unit": "F"})]
    assert got == want and r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    ids = [c.id for c in r.choices[0].message.tool_calls]
    assert len(set(ids)) == 2
    content, calls, finish, _ = _streamed(model, "[two]")
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want


def test_no_parallel_calls_keeps_the_first(model):
    """``parallel_tool_calls: false``: a model that writes two calls answers with the first only."""
    r = _ask(model, "[two]", parallel_tool_calls=False)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert got == [("stop_line", {"line": 4})] and r.choices[0].finish_reason == "tool_calls"


def test_finish_reason_of_a_forced_call_is_openais(model):
    """A call forced by a named tool_choice ends with finish_reason "stop", streamed or not, as OpenAI ends it (and
    vLLM, which changed to match it in its PR 25054); "required" and auto calls end with "tool_calls". The named
    call answered "tool_calls"."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, want in ((named, "stop"), ("required", "tool_calls")):
        ch = _ask(model, "[args]" if choice is named else "[one]", tool_choice=choice,
                  parallel_tool_calls=False).choices[0]
        assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
        assert ch.finish_reason == want
    ch = _ask(model, "[args]", tool_choice=named).choices[0]
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Lyon", "unit": "C"}
    finishes = [c.choices[0].finish_reason for c in _ask(model, "[args]", stream=True, tool_choice=named)
                if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]


def test_plain_answer_stays_content(model):
    r = _ask(model, "[text]")
    assert r.choices[0].message.content == SCRIPTS[model.family]["[text]"]
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    content, calls, finish, _ = _streamed(model, "[text]")
    assert (content, calls, finish) == (SCRIPTS[model.family]["[text]"], [], "stop")


@pytest.mark.parametrize("script", ["[cut]", "[unknown]"])
def test_malformed_or_unknown_call_falls_back_to_content(model, script):
    """A call cut off (max_tokens, EOS mid-arguments) or naming a function that is not in tools is not a
    tool call: the client gets the model's text as content, finish_reason stop."""
    r = _ask(model, script)
    text = SCRIPTS[model.family][script]
    ch = r.choices[0]
    assert not ch.message.tool_calls and ch.finish_reason == "stop"
    assert ch.message.content == text
    content, calls, finish, _ = _streamed(model, script)
    assert (content, finish) == (text, "stop")  # streamed: the text as content too, and no tool_calls finish
    for c in calls:  # deltas of a call that only turned out malformed at the end went out before
        assert c["name"] == "get_weather" and script == "[cut]"


def test_tool_result_in_the_next_turn(model):
    first = _ask(model, "[two]").choices[0].message
    history = [{"role": "user", "content": "[two] What should we do?"},
               first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "line 4 stopped"},
               {"role": "tool", "tool_call_id": first.tool_calls[1].id, "content": "Oslo: 50 F"},
               {"role": "user", "content": "[after-result] And now?"}]
    r = _ask(model, "", messages=history)
    assert r.choices[0].message.content == "Line 4 is stopped." and r.choices[0].finish_reason == "stop"
    prompt = model.backend.prompts[-1]
    assert "line 4 stopped" in prompt and "Oslo: 50 F" in prompt
    key = "arguments" if model.family == "qwen" else "parameters"
    assert json.dumps({"name": "stop_line", key: {"line": 4}}) in prompt  # the earlier call, as the model writes it


def test_langchain_bind_tools_auto(model):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=model.url + "/v1", api_key="x", model="scripted", temperature=0, max_retries=0,
                     timeout=60, max_tokens=200).bind_tools(TOOLS)
    ai = llm.invoke("[two] What should we do?")
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("stop_line", {"line": 4}),
                                                                ("get_weather", {"city": "Oslo", "unit": "F"})]
    chunks = list(llm.stream("[one] What should we do?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Lyon", "unit": "C"})]


def test_a_call_cut_by_max_tokens_sends_no_deltas_after_its_text(model):
    """max_tokens ends the answer inside a call's arguments: the call is malformed, so its text comes as content.
    The last token's piece of the arguments went out after that content all the same (a ``tool_calls`` delta
    following the fallback text), so a client saw the call grow after it had been given up; ``close`` drops the
    deltas of a call that does not stand, and the last token's must go with them."""
    text = SCRIPTS[model.family]["[one]"]
    cut = text[:text.index('"Ly') + 3]
    budget = len(model.backend.tok.encode(cut, add_special=False))
    msgs = [{"role": "user", "content": "[one] What should we do?"}]
    ask = dict(model="scripted", messages=msgs, tools=TOOLS, temperature=0, max_tokens=budget)
    ch = model.client.chat.completions.create(**ask).choices[0]
    assert ch.finish_reason == "length" and not ch.message.tool_calls and ch.message.content == cut
    deltas = []  # (content, tool_calls) of each chunk
    for c in model.client.chat.completions.create(**ask, stream=True):
        if c.choices:
            deltas.append((c.choices[0].delta.content or "", c.choices[0].delta.tool_calls or []))
    assert "".join(t for t, _ in deltas).endswith(cut.split("<tool_call>")[-1])
    last_text = max(i for i, (t, _) in enumerate(deltas) if t)  # the fallback: the call's text as content
    assert not [calls for _, calls in deltas[last_text:] if calls]
