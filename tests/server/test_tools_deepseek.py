"""DeepSeek's own tool-call markup end to end: R1-Distill's real chat template (which writes past calls as
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``), a
tokenizer whose call markers are special tokens, ``--reasoning-parser deepseek_r1``, the engine, the detokenizer and
the server, to the real ``openai`` client.

No DeepSeek model can be installed here, so ``ThinkingModel`` plays one (after the template's
``<｜Assistant｜><think>\\n``, the script named in the last user turn). Shown: ``auto`` reads the template's markup, the
markers reach the parser though special (and stay out of the text when no parser reads them), the calls after
``</think>``, text before them the content, streamed as OpenAI streams them and equal to the whole answer's, a call
cut off at max_tokens is content, and the history of calls and results renders as transformers renders it."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.server.conftest import running_server
from tests.server.test_reasoning import ASSISTANT, BOS, EOS, R1_TEMPLATE, USER, ThinkingModel

CONTEXT = 2048  # one token per byte but the markers
MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
           "<｜tool▁output▁end｜>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "stop_line", "description": "Stop a line",
                                           "parameters": {"type": "object", "properties": {"line": {"type": "integer"}},
                                                          "required": ["line"]}}}]


def _call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


SCRIPTS = {  # after the template's "<｜Assistant｜><think>\n"
    "[two]": "Weather first.\n</think>\n\nLet me check.<｜tool▁calls▁begin｜>" + _call("get_weather", '{"city": "Lyon"}')
             + "\n" + _call("stop_line", '{"line": 4}') + "<｜tool▁calls▁end｜>",
    "[one]": "One call.\n</think><｜tool▁calls▁begin｜>" + _call("stop_line", '{"line": 2}'),  # no calls' end: EOS
    "[text]": "Nothing to call.\n</think>It is sunny.",
    "[bare]": "Markers.\n</think>Done<｜tool▁call▁end｜>.",  # a marker outside any call
}


@pytest.fixture(scope="module")
def ds(tiny_dense, tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer as LinesideTokenizer

    tmp = tmp_path_factory.mktemp("ds")
    ckpt = tmp / "ckpt"
    shutil.copytree(tiny_dense("llama-gqa"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": CONTEXT}))
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, *MARKERS)])
    tok.add_tokens([AddedToken(t, special=False) for t in (USER, ASSISTANT, "<think>", "</think>")])
    assert tok.get_vocab_size() <= 300  # the checkpoint's vocabulary
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "chat_template": R1_TEMPLATE}))
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}))
    path = build_bundle(ckpt, tmp / "r1", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=CONTEXT))
    b = open_bundle(path)
    lt = LinesideTokenizer.from_bundle(b)
    for m in MARKERS:  # as in DeepSeek's tokenizers: one special token each
        assert lt.encode(m, add_special=False) == [lt.token_id(m)] and lt.is_special(lt.token_id(m))
    be = ThinkingModel(lt, scripts=SCRIPTS, num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2), reasoning_parser="deepseek_r1") as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        srv.tok, srv.path = lt, path
        yield srv


def _ask(srv, script: str, **kw):
    kw.setdefault("messages", [{"role": "user", "content": f"{script} Weather, then stop a line"}])
    kw.setdefault("max_tokens", 400)
    return srv.client.chat.completions.create(model="r1", temperature=0, **kw)


def _streamed(srv, script: str, **kw):
    """(reasoning, content, [(id, name, arguments)], finish_reason) joined from the deltas."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _ask(srv, script, stream=True, **kw):
        ch = chunk.choices[0]
        reasoning += ch.delta.model_dump().get("reasoning_content") or ""
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            e = calls.setdefault(t.index, [t.id, t.function.name, ""])
            assert t.id is None or t.id == e[0]
            e[2] += t.function.arguments or ""
        finish = ch.finish_reason or finish
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("script, reasoning, content, calls", [
    ("[two]", "Weather first.\n", "\n\nLet me check.", [("get_weather", '{"city": "Lyon"}'), ("stop_line", '{"line": 4}')]),
    ("[one]", "One call.\n", None, [("stop_line", '{"line": 2}')]),
])
def test_deepseek_calls_after_the_reasoning_streamed_and_not(ds, script, reasoning, content, calls):
    """The markers are special tokens, yet reach the parser; the calls come after ``</think>``, text before them is
    the content; streamed, the arguments come in pieces that add up to the whole answer's."""
    ch = _ask(ds, script, tools=TOOLS).choices[0]
    m = ch.message
    assert (m.model_dump()["reasoning_content"], m.content, ch.finish_reason) == (reasoning, content, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == calls
    r, c, got, finish = _streamed(ds, script, tools=TOOLS)
    assert (r, c, [(n, a) for _, n, a in got], finish) == (reasoning, content or "", calls, "tool_calls")
    assert all(i.startswith("call") for i, _, _ in got) and len({i for i, _, _ in got}) == len(got)


def test_a_call_cut_off_is_content(ds):
    """Cut at max_tokens inside the arguments: no call, the answer's text the content, finish_reason length."""
    cut = SCRIPTS["[two]"].split('"Lyon"')[0]
    n = len(ds.tok.encode(cut, add_special=False))
    ch = _ask(ds, "[two]", tools=TOOLS, max_tokens=n).choices[0]
    answer = cut.split("</think>")[1]
    assert (ch.message.content, ch.message.tool_calls, ch.finish_reason) == (answer, None, "length")
    _, content, _, finish = _streamed(ds, "[two]", tools=TOOLS, max_tokens=n)
    assert (content, finish) == (answer, "length")


def test_markers_stay_out_of_the_text_without_a_parser_reading_them(ds):
    """Without tools no parser reads the markers: special tokens, they are skipped as before; with tools a marker
    outside any call is no call."""
    assert _ask(ds, "[bare]").choices[0].message.content == "Done."
    m = _ask(ds, "[bare]", tools=TOOLS).choices[0].message
    assert (m.content, m.tool_calls) == ("Done<｜tool▁call▁end｜>.", None)
    assert _ask(ds, "[text]", tools=TOOLS).choices[0].message.content == "It is sunny."


HISTORY = [{"role": "user", "content": "[text] Weather in Lyon, then stop line 4"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
               {"id": "call_2", "type": "function", "function": {"name": "stop_line", "arguments": '{"line": 4}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "stopped"},
           {"role": "assistant", "content": "Sunny; line 4 stopped."},
           {"role": "user", "content": "[two] And again?"}]


def _reference(messages: list[dict], tools: list[dict] | None = None) -> str:
    """transformers' rendering (what its apply_chat_template renders with) of ``messages`` with R1's template."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=R1_TEMPLATE, add_generation_prompt=True,
                                        bos_token=BOS, eos_token=EOS, tools=tools)
    return rendered[0]


def test_past_calls_and_results_render_as_transformers(ds):
    """An assistant turn of calls and the tool results render in R1's markup, as transformers' apply_chat_template
    renders the same messages (arguments as the client's text: the template joins them with ``+``); with tools the
    template, which describes none, gets them in a system message asking for its markup; the next answer's calls
    parse."""
    from lineside.server.tool_calls import deepseek_tools_prompt, parse_tools

    def prompt(**kw) -> str:
        r = httpx.post(ds.url + "/tokenize", json={"model": "r1", "messages": HISTORY, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return ds.tok.decode(r.json()["tokens"], skip_special=False)

    want = _reference(HISTORY)
    assert '<｜tool▁sep｜>stop_line\n```json\n{"line": 4}\n```' in want and "18 C, sunny<｜tool▁output▁end｜>" in want
    assert prompt() == want
    system = deepseek_tools_prompt(parse_tools(TOOLS), v3=True)
    assert prompt(tools=TOOLS) == _reference([{"role": "system", "content": system}, *HISTORY], TOOLS)
    assert prompt(tool_choice="none", tools=TOOLS) == prompt(tools=TOOLS)  # listed, not parsed (as vLLM)
    # a client sending "" beside the calls: still rendered (the template writes calls only for content none)
    empty = [{**m, "content": ""} if m.get("tool_calls") else m for m in HISTORY]
    r = httpx.post(ds.url + "/tokenize", json={"model": "r1", "messages": empty, "tools": TOOLS}, timeout=60)
    assert ds.tok.decode(r.json()["tokens"], skip_special=False) == prompt(tools=TOOLS)
    m = _ask(ds, "", messages=HISTORY, tools=TOOLS).choices[0].message
    assert [c.function.name for c in m.tool_calls] == ["get_weather", "stop_line"]
