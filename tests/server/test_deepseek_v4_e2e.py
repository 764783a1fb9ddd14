"""A DeepSeek-V4 bundle served end to end: a tiny V4 checkpoint whose tokenizer has V4's markers (the DSML ones
special tokens) and no chat template, so the bundle renders with ``builtin:deepseek_v4``; the server with its default
options but ``--reasoning-parser auto``; the real ``openai`` client.

``V4Script`` plays the model: after the prompt's last ``<｜Assistant｜>`` and the tag the template writes after it
(``<think>`` thinking, ``</think>`` not), the script named in the last user turn (or tool result), then EOS. Shown: the
prompt the server renders is the template's (thinking on and off through chat_template_kwargs), ``auto`` turns the
reasoning parser on, a DSML call after ``</think>`` comes back as OpenAI tool_calls, streamed and whole, and a second
turn carrying the call and its result renders as the template renders it."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from tests.runtime.fakes import FakeBackend
from tests.server.conftest import running_server

pytest.importorskip("transformers.models.deepseek_v4")

CONTEXT = 4096  # one token per byte but the markers; the tools' section alone is ~1,500
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DSML = ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "｜DSML｜")  # each one special token
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                           "days": {"type": "integer"}},
                                                          "required": ["city"]}}}]
CALL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Lyon</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
SCRIPTS = {  # after "<｜Assistant｜><think>" (thinking) or "<｜Assistant｜></think>"
    "[call]": "Weather first.</think>\n\n" + CALL,
    "[think]": "Easy one.</think>It is sunny.",
    "[plain]": "It is sunny.",
    "[after]": "Got it.</think>Lyon is sunny for two days.",
}


class V4Script(FakeBackend):
    """The script named after the last ``<｜User｜>``, from the token after the last ``<｜Assistant｜>`` and its tag."""

    def __init__(self, tokenizer, **kw):
        super().__init__(**kw)
        self.tok = tokenizer
        self.assistant, self.user = tokenizer.token_id(ASSISTANT), tokenizer.token_id(USER)
        self.eos = tokenizer.eos_token_ids[0]
        self.prompts: list[str] = []

    def logits(self, seq: list[int]) -> np.ndarray:
        x = np.full(self.vocab_size, -1e9, dtype=np.float32)
        if self.assistant not in seq:
            return x
        cut = len(seq) - seq[::-1].index(self.assistant) + 1  # past the tag after it
        last_user = self.tok.decode(seq[:cut], skip_special=False).rsplit(USER, 1)[-1]
        key = next((k for k in SCRIPTS if k in last_user), None)
        script = self.tok.encode(SCRIPTS[key], add_special=False) if key else []
        i = len(seq) - cut
        if i == 0:
            self.prompts.append(self.tok.decode(seq[:cut], skip_special=False))
        x[script[i] if i < len(script) else self.eos] = 0.0
        return x


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer as LinesideTokenizer
    from tests.build.deepseek_v4.helpers import BASE, SCHEDULES
    from tests.tiny_tokenizer import write_byte_tokenizer

    tmp = tmp_path_factory.mktemp("v4")
    ckpt = tmp / "ckpt"
    kw = {**BASE, **SCHEDULES["a"], "vocab_size": 300, "max_position_embeddings": CONTEXT}
    model = DeepseekV4ForCausalLM(DeepseekV4Config(num_hidden_layers=len(kw["layer_types"]), **kw))
    model.save_pretrained(ckpt, safe_serialization=True)
    write_byte_tokenizer(ckpt, 300)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, *DSML)])
    tok.add_tokens([AddedToken(t, special=False) for t in (USER, ASSISTANT, "<think>", "</think>")])
    assert tok.get_vocab_size() <= 300
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(  # no chat template: V4 ships a Python encoder
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False}))
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}))
    path = build_bundle(ckpt, tmp / "v4", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=CONTEXT))
    b = open_bundle(path)
    lt = LinesideTokenizer.from_bundle(b)
    for m in DSML:
        assert lt.encode(m, add_special=False) == [lt.token_id(m)] and lt.is_special(lt.token_id(m))
    be = V4Script(lt, num_slots=2, max_seq_len=CONTEXT, vocab_size=300)
    with running_server(LLMEngine(b, backend=be, num_slots=2), reasoning_parser="auto") as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.tok, srv.backend = lt, be
        yield srv


def _reference(messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    """builtin:deepseek_v4 rendered by transformers' own renderer (what apply_chat_template renders)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from lineside.runtime.chat_template import load_chat_template
    from lineside.server.tool_calls import _template_call

    messages = [{**m, "tool_calls": [_template_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in messages]  # arguments as an object, as the server hands them to a template
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=load_chat_template("builtin:deepseek_v4"),
                                        add_generation_prompt=True, bos_token=BOS, eos_token=EOS, tools=tools, **kwargs)
    return rendered[0]


def _served_prompt(srv, messages, **kw) -> str:
    r = httpx.post(srv.url + "/tokenize", json={"model": "v4", "messages": messages, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return srv.tok.decode(r.json()["tokens"], skip_special=False)


def _ask(srv, script: str, **kw):
    kw.setdefault("messages", [{"role": "user", "content": f"{script} Weather in Lyon?"}])
    kw.setdefault("max_tokens", 300)
    return srv.client.chat.completions.create(model="v4", temperature=0, **kw)


def _streamed(srv, script: str, **kw):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _ask(srv, script, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        reasoning += ch.delta.model_dump().get("reasoning_content") or ""
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            e = calls.setdefault(t.index, [t.id, t.function.name, ""])
            e[2] += t.function.arguments or ""
        finish = ch.finish_reason or finish
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("kwargs", [None, {"thinking": True}, {"thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_the_served_prompt_is_the_templates(v4, kwargs, tools):
    msgs = [{"role": "system", "content": "You run line 3."}, {"role": "user", "content": "[plain] Weather?"}]
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    if tools:
        extra["tools"] = tools
    want = _reference(msgs, tools, **(kwargs or {}))
    assert want.endswith("<｜Assistant｜><think>" if (kwargs or {}) in ({"thinking": True}, {"enable_thinking": True})
                         else "<｜Assistant｜></think>")
    assert _served_prompt(v4, msgs, **extra) == want
    n = len(v4.backend.prompts)
    v4.client.chat.completions.create(model="v4", messages=msgs, max_tokens=20, **({"tools": tools} if tools else {}),
                                      extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
    assert v4.backend.prompts[n:] == [want]


def test_auto_turns_the_reasoning_parser_on(v4):
    m = _ask(v4, "[think]", extra_body={"chat_template_kwargs": {"thinking": True}}).choices[0].message
    assert (m.model_dump().get("reasoning_content"), m.content) == ("Easy one.", "It is sunny.")
    r, c, _, finish = _streamed(v4, "[think]", extra_body={"chat_template_kwargs": {"thinking": True}})
    assert (r, c, finish) == ("Easy one.", "It is sunny.", "stop")
    m = _ask(v4, "[plain]").choices[0].message  # thinking off: the prompt closed the reasoning, all content
    assert (m.model_dump().get("reasoning_content"), m.content) == (None, "It is sunny.")


def test_a_dsml_call_after_the_reasoning_is_a_tool_call(v4):
    thinking = {"chat_template_kwargs": {"thinking": True}}
    ch = _ask(v4, "[call]", tools=TOOLS, extra_body=thinking).choices[0]
    m = ch.message
    assert (m.model_dump().get("reasoning_content"), ch.finish_reason) == ("Weather first.", "tool_calls")
    assert m.content in (None, "\n\n")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Lyon", "days": 2})]
    r, c, calls, finish = _streamed(v4, "[call]", tools=TOOLS, extra_body=thinking)
    assert (r, finish) == ("Weather first.", "tool_calls") and c.strip() == (m.content or "").strip()
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Lyon", "days": 2})]
    assert calls[0][0] and calls[0][0].startswith("call")


def test_a_second_turn_renders_as_the_template(v4):
    thinking = {"thinking": True}
    first = [{"role": "user", "content": "[call] Weather in Lyon?"}]
    m = _ask(v4, "", messages=first, tools=TOOLS, extra_body={"chat_template_kwargs": thinking}).choices[0].message
    call = m.tool_calls[0]
    history = [*first,
               {"role": "assistant", "content": m.content, "reasoning_content": m.model_dump()["reasoning_content"],
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "[after] sunny, 18 C"}]
    want = _reference(history, TOOLS, **thinking)
    assert '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>' in want
    assert want.endswith("<｜User｜><tool_result>[after] sunny, 18 C</tool_result><｜Assistant｜><think>")
    assert _served_prompt(v4, history, tools=TOOLS, chat_template_kwargs=thinking) == want
    n = len(v4.backend.prompts)
    ch = _ask(v4, "", messages=history, tools=TOOLS, extra_body={"chat_template_kwargs": thinking}).choices[0]
    assert v4.backend.prompts[n:] == [want]
    assert (ch.message.model_dump()["reasoning_content"], ch.message.content, ch.finish_reason) == (
        "Got it.", "Lyon is sunny for two days.", "stop")


def test_the_thinking_as_vllm_names_it_and_a_bad_one(v4):
    """``reasoning`` (vLLM's newer name) is taken back as ``reasoning_content`` is; a non-string is one 400 line."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "reasoning": "Lyon it is.", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    want = _reference(history, TOOLS, thinking=True)
    assert "<think>Lyon it is.</think>" in want
    assert _served_prompt(v4, history, tools=TOOLS, chat_template_kwargs={"thinking": True}) == want
    history[1] = {**history[1], "reasoning": 3}
    r = httpx.post(v4.url + "/tokenize", json={"model": "v4", "messages": history}, timeout=60)
    assert r.status_code == 400 and "messages.1.reasoning" in r.text and "\n" not in r.json()["error"]["message"]


def test_reasoning_effort_as_vllm_passes_it(v4):
    """OpenAI's ``reasoning_effort`` reaches the template as vLLM hands it over: an effort opens the thinking (split
    out by the reasoning parser), ``none`` closes it, ``max`` adds the encoder's prefix; a bad value is one 400."""
    msgs = [{"role": "user", "content": "[think] Weather?"}]
    n = len(v4.backend.prompts)
    m = _ask(v4, "", messages=msgs, reasoning_effort="high").choices[0].message
    assert v4.backend.prompts[n:] == [_reference(msgs, reasoning_effort="high")]
    assert v4.backend.prompts[-1].endswith("<｜Assistant｜><think>")
    assert (m.model_dump().get("reasoning_content"), m.content) == ("Easy one.", "It is sunny.")
    r, c, _, _ = _streamed(v4, "", messages=msgs, reasoning_effort="low")
    assert (r, c) == ("Easy one.", "It is sunny.")
    m = _ask(v4, "", messages=msgs, reasoning_effort="none",
             extra_body={"chat_template_kwargs": {"thinking": True}}).choices[0].message
    assert v4.backend.prompts[-1].endswith("<｜Assistant｜></think>") and m.model_dump().get("reasoning_content") is None
    _ask(v4, "", messages=msgs, extra_body={"reasoning_effort": "max"})
    assert v4.backend.prompts[-1].startswith(BOS + "Reasoning Effort: Absolute maximum")
    assert _served_prompt(v4, msgs, reasoning_effort="max") == v4.backend.prompts[-1]
    for bad in ("extreme", 3):
        r = httpx.post(v4.url + "/v1/chat/completions", json={"model": "v4", "messages": msgs, "reasoning_effort": bad},
                       timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "reasoning_effort" and "\n" not in err["message"], r.text


def test_responses_reasoning_effort_reaches_the_template_as_chats_does(v4):
    """/v1/responses' ``reasoning.effort`` (what OpenAI's agents and LangChain's responses mode send) was a 400; it
    renders as chat's reasoning_effort (thinking on: its reasoning item split out), and the response names it."""
    msgs = [{"role": "user", "content": "[think] Weather?"}]
    n = len(v4.backend.prompts)
    r = v4.client.responses.create(model="v4", input=msgs, reasoning={"effort": "high", "summary": "auto"},
                                   max_output_tokens=40, temperature=0)
    assert v4.backend.prompts[n:] == [_reference(msgs, reasoning_effort="high")]
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "It is sunny."
    assert (r.reasoning.effort, r.reasoning.summary) == ("high", "auto")
    for reasoning, param in (({"effort": "extreme"}, "reasoning.effort"), ({"summary": "long"}, "reasoning.summary"),
                             ({"budget": 3}, "reasoning.budget")):
        bad = httpx.post(v4.url + "/v1/responses", json={"model": "v4", "input": "hi", "reasoning": reasoning},
                         timeout=60)
        err = bad.json()["error"]
        assert bad.status_code == 400 and err["param"] == param and "\n" not in err["message"], bad.text
