"""Real models' chat templates render a chat body as transformers' apply_chat_template renders the same conversation
(text and token ids), given the conversation as vLLM hands it to transformers (text parts joined by newlines, string
tool-call arguments parsed as JSON): tools as the client sent them (``strict``, key order, no description), an earlier
turn's thinking under vLLM's newer ``reasoning`` name, a request's ``documents``; where the template itself raises,
one 400.

The templates (tests/server/data/real_templates/), as their checkpoints' tokenizer_config.json ship them:
llama-3.2-instruct.jinja (meta-llama/Llama-3.2-1B-Instruct, also Llama-3.3-70B-Instruct's with strftime_now),
qwen2.5-instruct.jinja (Qwen/Qwen2.5-0.5B-Instruct and the other Qwen2.5 Instruct sizes), qwen3.jinja
(Qwen/Qwen3-8B), granite-3.1-documents.jinja (ibm-granite/granite-3.1-8b-instruct's system and documents blocks,
its tools and controls branches left out).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lineside.errors import LinesideError
from lineside.runtime.tokenizer import Tokenizer
from lineside.server.errors import APIError
from lineside.server.openai_api import chat_prompt
from lineside.server.schemas import ChatCompletionRequest
from tests.tiny_tokenizer import write_family_tokenizer

DATA = Path(__file__).parent / "data" / "real_templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
FAMILIES = {  # template file: special tokens, BOS, EOS
    "llama-3.2-instruct": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5-instruct": (CHATML, None, "<|im_end|>"),
    "qwen3": (CHATML, None, "<|im_end|>"),
    "granite-3.1-documents": (["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"], "<|end_of_text|>",
                              "<|end_of_text|>"),
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
STRICT = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER["function"]["parameters"], "strict": True}}
BARE = {"type": "function", "function": {"name": "now"}}  # no description, no parameters
REORDERED = {"function": {"parameters": {"type": "object", "properties": {}}, "name": "now", "description": "Time"},
             "type": "function"}


def _call(i: int, args: object) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}


ASKED = {"role": "user", "content": "Weather in Lyon?"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}
CHATS = {
    "system-multi-turn": {"messages": [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi "},
                                       {"role": "assistant", "content": "Hello."},
                                       {"role": "user", "content": "And ünïcode?"}]},
    "text-parts-and-name": {"messages": [{"role": "user", "name": "ann", "content": [{"type": "text", "text": "one"},
                                                                                    {"type": "text", "text": "two"}]}]},
    "empty-content": {"messages": [{"role": "user", "content": ""}]},
    "no-generation-prompt": {"messages": [ASKED, {"role": "assistant", "content": "Sunny."}],
                             "add_generation_prompt": False},
    "tools": {"messages": [{"role": "system", "content": "Plant bot."}, ASKED], "tools": [WEATHER]},
    # tool_choice none still lists the tools (vLLM renders them unless --exclude-tools-when-tool-choice-none): the
    # model knows of tools it may not call now, as OpenAI's
    "tools-choice-none": {"messages": [{"role": "system", "content": "Plant bot."}, ASKED], "tools": [WEATHER],
                          "tool_choice": "none"},
    "call-arguments-as-string": {"messages": [ASKED, {"role": "assistant", "content": None,
                                                      "tool_calls": [_call(1, '{"city": "Lyon"}')]}, RESULT],
                                 "tools": [WEATHER]},
    "call-arguments-as-object": {"messages": [ASKED, {"role": "assistant", "content": "Checking.",
                                                      "tool_calls": [_call(1, {"city": "Lyon"})]}, RESULT,
                                              {"role": "assistant", "content": "21 C."}, {"role": "user", "content": "Ta"}],
                                 "tools": [WEATHER]},
    # the tools as the client sent them: OpenAI Agents SDK's "strict", a function without description or parameters,
    # keys in the client's order (transformers writes each dict as it is)
    "strict-tool": {"messages": [ASKED], "tools": [STRICT]},
    "bare-tool": {"messages": [ASKED], "tools": [BARE]},
    "reordered-tool": {"messages": [ASKED], "tools": [REORDERED]},
    # a tool loop's earlier thinking echoed back under vLLM's newer name: transformers gives it to the template as
    # reasoning_content too (Qwen3's keeps it after the last user query)
    "reasoning-echoed": {"messages": [ASKED, {"role": "assistant", "content": None, "reasoning": "Need the weather.",
                                              "tool_calls": [_call(1, '{"city": "Lyon"}')]}, RESULT],
                         "tools": [WEATHER]},
    "documents": {"messages": [{"role": "user", "content": "When does line 4 stop?"}],
                  "documents": [{"title": "Shifts", "text": "Line 4 stops at 18:00."},
                                {"title": "Holidays", "text": "Closed on May 1."}]},
}


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """One byte-level tokenizer per family with its special tokens, its template in tokenizer_config.json (as the
    bundle carries it)."""
    dirs = {}
    for name, (special, bos, eos) in FAMILIES.items():
        d = tmp_path_factory.mktemp(name)
        template = (DATA / f"{name}.jinja").read_text(encoding="utf-8")
        write_family_tokenizer(d, special, bos=bos, eos=eos, template=template, gen_eos=[eos])
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}), encoding="utf-8")
        dirs[name] = d
    return dirs


def _ours(d: Path, body: dict, *, exclude_none: bool = False) -> tuple[str, list[int]]:
    """The prompt the server renders for ``body`` (chat_prompt, then the tokenizer's encode_chat); ``exclude_none``:
    serve --exclude-tools-when-tool-choice-none."""
    tok = Tokenizer(d)
    state = SimpleNamespace(chat_template=None, trust_request_chat_template=False,
                            exclude_tools_when_tool_choice_none=exclude_none,
                            engine=SimpleNamespace(tokenizer=tok, max_seq_len=4096))
    prompt = chat_prompt(state, ChatCompletionRequest(**body))
    with prompt.render.blamed():
        text = tok.apply_chat_template(prompt.messages, prompt.options["add_generation_prompt"], prompt.listed,
                                       chat_template=prompt.render.given, template_kwargs=prompt.render.kwargs)
        ids = tok.encode_chat(prompt.messages, tools=prompt.listed, **prompt.options, **prompt.render.options())
    return text, ids


def _as_vllm_hands_it(messages: list[dict]) -> list[dict]:
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        elif m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def _with_parameters(tool: dict) -> dict:
    """A function sent without parameters is one of no arguments (OpenAI): the server hands templates that schema."""
    f = tool["function"]
    return tool if "parameters" in f else {**tool, "function": {**f, "parameters": {"type": "object", "properties": {}}}}


def _theirs(d: Path, body: dict) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(d)
    kw = dict(tools=[_with_parameters(t) for t in body["tools"]] if body.get("tools") else None,
              documents=body.get("documents"),
              add_generation_prompt=body.get("add_generation_prompt", True))
    text = hf.apply_chat_template(_as_vllm_hands_it(body["messages"]), tokenize=False, **kw)
    ids = hf.apply_chat_template(_as_vllm_hands_it(body["messages"]), tokenize=True, return_dict=True, **kw)
    return text, list(ids["input_ids"])


# the Granite excerpt has no tools section (the server describes tools to such a template itself): its chats without
CASES = [(t, c) for t in FAMILIES for c in CHATS if not (t.startswith("granite") and "tools" in CHATS[c])]


@pytest.mark.parametrize(("template", "chat"), CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_renders_text_and_ids_as_transformers(tokenizer_dirs, template, chat):
    d = tokenizer_dirs[template]
    theirs = _theirs(d, CHATS[chat])
    assert _ours(d, CHATS[chat]) == theirs


def test_the_cases_exercise_what_they_name(tokenizer_dirs):
    """The cases are not vacuous: the strict flag, the echoed reasoning and the documents reach the prompt."""
    assert '"strict": true' in _theirs(tokenizer_dirs["qwen2.5-instruct"], CHATS["strict-tool"])[0]
    assert "Need the weather." in _theirs(tokenizer_dirs["qwen3"], CHATS["reasoning-echoed"])[0]
    assert "Line 4 stops at 18:00." in _theirs(tokenizer_dirs["granite-3.1-documents"], CHATS["documents"])[0]


def test_a_function_sent_without_parameters_renders_in_a_template_that_walks_them(tmp_path):
    """Hermes-style templates read tool.function.parameters.properties: with the key missing transformers' renderer
    raises; the server gives such a function OpenAI's reading, no arguments, and the template renders."""
    from transformers.utils.chat_template_utils import render_jinja_template

    walks = ("{% for t in tools %}{{ t.function.name }}({% for k, v in t.function.parameters.properties|items %}{{ k }}"
             "{% endfor %}){% endfor %}|{{ messages[0].content }}")
    special, bos, eos = FAMILIES["qwen2.5-instruct"]
    write_family_tokenizer(tmp_path, special, bos=bos, eos=eos, template=walks, gen_eos=[eos])
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": walks}), encoding="utf-8")
    body = {"messages": [ASKED], "tools": [BARE, WEATHER]}
    with pytest.raises(Exception, match="has no attribute 'parameters'"):
        render_jinja_template(conversations=[body["messages"]], tools=body["tools"], chat_template=walks)
    text, _ = _ours(tmp_path, body)
    assert text.startswith("now()get_weather(city)|")


@pytest.mark.parametrize("template", ["qwen2.5-instruct", "llama-3.2-instruct"])
def test_tool_choice_none_leaves_tools_out_only_with_the_servers_flag(tokenizer_dirs, template):
    """serve --exclude-tools-when-tool-choice-none (vLLM's opt-out) renders the chat as if it had sent no tools; the
    default lists them (the tools-choice-none case), and the prompts differ by the tools section."""
    d = tokenizer_dirs[template]
    without = {"messages": CHATS["tools-choice-none"]["messages"]}
    assert _ours(d, CHATS["tools-choice-none"], exclude_none=True) == _theirs(d, without)
    assert "get_weather" in _ours(d, CHATS["tools-choice-none"])[0]
    assert "get_weather" not in _theirs(d, without)[0]


def test_a_documents_key_in_chat_template_kwargs_wins(tokenizer_dirs):
    """vLLM merges chat_template_kwargs over the request's own fields."""
    body = {**CHATS["documents"], "chat_template_kwargs": {"documents": [{"text": "From kwargs."}]}}
    text, _ = _ours(tokenizer_dirs["granite-3.1-documents"], body)
    assert "From kwargs." in text and "18:00" not in text


@pytest.mark.parametrize("documents", [[{"title": "x", "text": 3}], [{"text": {"nested": "x"}}]])
def test_a_document_that_is_not_strings_is_a_400_naming_it(tokenizer_dirs, documents):
    with pytest.raises(APIError) as e:
        _ours(tokenizer_dirs["granite-3.1-documents"], {**CHATS["documents"], "documents": documents})
    assert e.value.status == 400 and e.value.param.startswith("documents[0].")
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(("body", "said"), [
    ({"messages": [ASKED, {"role": "assistant", "content": None, "tool_calls": [_call(1, "{}"), _call(2, "{}")]}],
      "tools": [WEATHER]}, "only supports single tool-calls"),
    ({"messages": [{"role": "system", "content": "S"}], "tools": [WEATHER]}, "no first user message"),
], ids=["parallel-calls", "tools-without-a-user-turn"])
def test_where_llamas_template_raises_the_request_is_refused_in_one_line(tokenizer_dirs, body, said):
    """Llama 3.2's template raises on these (transformers' TemplateError): one line with its words, a 400 at the
    HTTP layer (LinesideError's handler)."""
    with pytest.raises(Exception) as hf:
        _theirs(tokenizer_dirs["llama-3.2-instruct"], body)
    assert said in str(hf.value)
    with pytest.raises(LinesideError) as e:
        _ours(tokenizer_dirs["llama-3.2-instruct"], body)
    assert said in str(e.value) and len(str(e.value).splitlines()) == 1


def test_documents_is_none_without_documents_as_transformers_renders(tokenizer_dirs):
    """transformers renders every chat with ``documents=None`` when none are given: a template testing ``documents is
    not none`` (not merely its truth) writes no documents section."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = "{% if documents is not none %}DOCS {% endif %}{{ messages[0].content }}"
    messages = [{"role": "user", "content": "Hi"}]
    theirs = render_jinja_template(conversations=[messages], chat_template=template)[0][0]
    assert Tokenizer(tokenizer_dirs["qwen3"]).apply_chat_template(messages, chat_template=template) == theirs == "Hi"
