"""A request's own chat template (``--trust-request-chat-template``) renders in a bounded sandbox: for the real
templates the tests carry it renders exactly what transformers' render_jinja_template renders, and what the same
text renders as the bundle's own template (unbounded), on system prompts, tools, calls and results, parallel calls,
several turns, with and without the generation prompt; and the default step limit leaves each of them a wide margin
on a conversation that fills the model's context."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lineside.runtime.chat_template import TemplateLimits, load_chat_template
from lineside.runtime.tokenizer import Tokenizer
from lineside.server import tool_calls as tc
from tests.server.test_chat_template import SMOLLM2_GGUF_TEMPLATE
from tests.server.test_reasoning import KEPT_TEMPLATE, R1_0528_TEMPLATE, R1_FIRST_TEMPLATE, R1_TEMPLATE
from tests.server.test_tool_calls_scripted import LLAMA_TEMPLATE, QWEN_TEMPLATE, TOOLS
from tests.server.test_tools_strict_templates import GEMMA_TEMPLATE, MISTRAL_TEMPLATE
from tests.tiny_tokenizer import write_byte_tokenizer

TEMPLATES = {
    "gemma-2": GEMMA_TEMPLATE,  # google/gemma-2-2b-it's
    "mistral-v0.3": MISTRAL_TEMPLATE,  # Mistral-7B-Instruct-v0.3's (tools)
    "r1-distill": R1_TEMPLATE,  # DeepSeek-R1-Distill's
    "r1-distill-first": R1_FIRST_TEMPLATE,
    "r1-0528": R1_0528_TEMPLATE,
    "smollm2": SMOLLM2_GGUF_TEMPLATE,  # SmolLM2-135M-Instruct's GGUF
    "qwen2.5-shaped": QWEN_TEMPLATE,  # the tests' Qwen2.5-style (tools) and Llama-3.x-style templates
    "llama3-shaped": LLAMA_TEMPLATE,
    "qwen3-kept-shaped": KEPT_TEMPLATE,
    "builtin:smollm2_tools": load_chat_template("builtin:smollm2_tools"),
    "builtin:deepseek_v4": load_chat_template("builtin:deepseek_v4"),
}
KWARGS = {"builtin:deepseek_v4": [None, {"thinking": True}], "qwen3-kept-shaped": [None, {"enable_thinking": False}]}


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    "multi-turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is line 4 up?"},
                   {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And line 5? ünïcode"}],
    "tools": [{"role": "user", "content": "Weather in Lyon?"}],
    "call-and-result": [{"role": "user", "content": "Weather in Lyon?"},
                        {"role": "assistant", "content": None,
                         "tool_calls": [_call(1, "get_weather", {"city": "Lyon", "unit": "C"})]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                        {"role": "assistant", "content": "21 C in Lyon."}, {"role": "user", "content": "Thanks"}],
    "parallel-calls": [{"role": "system", "content": "Plant bot."}, {"role": "user", "content": "Stop 4; Oslo?"},
                       {"role": "assistant", "content": None,
                        "tool_calls": [_call(1, "stop_line", {"line": 4}),
                                       _call(2, "get_weather", {"city": "Oslo", "unit": "F"})]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "stopped"},
                       {"role": "tool", "tool_call_id": "call_2", "content": "snow"}],
}
WITH_TOOLS = {"tools", "call-and-result", "parallel-calls"}
# builtin:deepseek_v4's own conversations (DeepSeek-V4's encoder outputs), rendered here for parity too
V4_CASES = json.loads((Path(__file__).parents[1] / "runtime" / "data" / "deepseek_v4_chat_template.json")
                      .read_text(encoding="utf-8"))["cases"]

CASES = [(t, c, gen, kw) for t in TEMPLATES for c in CONVERSATIONS for gen in (True, False)
         for kw in KWARGS.get(t, [None])]
CASES += [("builtin:deepseek_v4", f"v4:{c['name']}", gen, {"thinking": True} if c["thinking"] else None)
          for c in V4_CASES for gen in (True, False)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """One tokenizer per template with it as the bundle's own, and one a request's template renders on."""
    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    own = {}
    for name, text in TEMPLATES.items():
        own[name] = Tokenizer(d)
        own[name].chat_template = text
    return Tokenizer(d), own


def _conversation(name: str) -> tuple[list[dict], list | None]:
    if name.startswith("v4:"):
        case = next(c for c in V4_CASES if c["name"] == name[3:])
        return case["messages"], case["tools"]
    return CONVERSATIONS[name], TOOLS if name in WITH_TOOLS else None


def _rendered(fn) -> str:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a template's refusal, compared across the three
        return f"refused: {type(e).__name__}"


@pytest.mark.parametrize(("template", "conversation", "generation", "kwargs"), CASES,
                         ids=[f"{t}-{c}-{'gen' if g else 'nogen'}{'-' + ','.join(k) if k else ''}"
                              for t, c, g, k in CASES])
def test_request_template_renders_as_transformers_and_as_the_bundles_own(tokenizers, template, conversation,
                                                                         generation, kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    request_tok, own = tokenizers
    text = TEMPLATES[template]
    raw, tools = _conversation(conversation)
    parsed = tc.parse_tools(tools)
    messages, listed = tc.template_messages(raw, parsed, text, tc.parse_tool_choice(None, parsed))  # as served
    limits = TemplateLimits.for_context(4096)
    bounded = _rendered(lambda: request_tok.apply_chat_template(messages, generation, listed, chat_template=text,
                                                                template_kwargs=kwargs, template_limits=limits))
    unbounded = _rendered(lambda: own[template].apply_chat_template(messages, generation, listed,
                                                                    template_kwargs=kwargs))
    hf = _rendered(lambda: render_jinja_template(
        conversations=[messages], tools=listed, chat_template=text, add_generation_prompt=generation,
        bos_token=request_tok.bos_token, eos_token=request_tok.eos_token, **(kwargs or {}))[0][0])
    if hf.startswith("refused: "):  # the template refuses this conversation (Gemma's system role): all three do
        assert bounded.startswith("refused: ") and unbounded.startswith("refused: "), (bounded, unbounded)
        assert "TemplateLimitError" not in bounded
    else:
        assert bounded == hf
        assert unbounded == hf


def test_the_cases_cover_every_template_and_what_a_chat_holds():
    """Most of the cases render (a refusal is compared too, but proves less)."""
    assert len(CASES) >= 150
    assert {t for t, *_ in CASES} == set(TEMPLATES)
    joined = json.dumps([_conversation(c)[0] for _, c, *_ in CASES])
    for piece in ('"system"', '"tool_calls"', '"tool"', '"assistant"'):
        assert piece in joined


# ---- steps on a conversation filling the context -----------------------------------------------------------------
# A lower bound on the tokens of a rendering: one per special marker, and one per 16 characters of the text between
# markers (no token of these texts, JSON and a few words, is longer), so the conversations below hold at least as many
# turns as fit.
_MARK = re.compile(r"<\|[^|<>]*\|>|<｜[^｜<>]*｜>|</?[a-z_]+>|\[/?[A-Z_]+\]")
CONTEXT = 4096
MARGIN = 8
_ONE_TOOL = [{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object",
                                                                                              "properties": {}}}}]


def _least_tokens(text: str) -> int:
    return len(_MARK.findall(text)) + sum(-(-len(part) // 16) for part in _MARK.split(text))


def _shape(shape: str, n: int) -> tuple[list[dict], list | None]:
    """``n`` turns, each as cheap in tokens as a turn of its kind can be."""
    if shape == "turns":
        return [m for _ in range(n) for m in ({"role": "user", "content": ""}, {"role": "assistant", "content": ""})] \
            + [{"role": "user", "content": ""}], None
    per = 8 if shape == "parallel-calls" else 1
    msgs: list[dict] = [{"role": "user", "content": "x"}]
    for i in range(n):
        ids = [f"c{i}_{j}" for j in range(per)]
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": k, "type": "function", "function": {"name": "f", "arguments": "{}"}} for k in ids]})
        msgs += [{"role": "tool", "tool_call_id": k, "content": ""} for k in ids]
    return msgs, _ONE_TOOL


@pytest.mark.parametrize("shape", ["turns", "tool-rounds", "parallel-calls"])
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_conversation_filling_the_context_takes_a_fraction_of_the_step_limit(tokenizers, template, shape):
    """The default limits for a 4096-token model: the conversation renders within an eighth of their steps (the
    server's limit grows with the context, as the steps such a conversation takes do). Measured the same way: at
    most 16.7 steps per token (builtin:deepseek_v4, eight parallel calls a turn; runtime/chat_template.py)."""
    request_tok, _ = tokenizers
    text = TEMPLATES[template]
    default = TemplateLimits.for_context(CONTEXT)
    tight = TemplateLimits(max_chars=default.max_chars, max_steps=default.max_steps // MARGIN)

    def render(n: int) -> str:
        raw, tools = _shape(shape, n)
        parsed = tc.parse_tools(tools)
        messages, listed = tc.template_messages(raw, parsed, text, tc.parse_tool_choice(None, parsed))
        return request_tok.apply_chat_template(messages, True, listed, chat_template=text, template_limits=tight,
                                               template_kwargs={"thinking": True} if "deepseek" in template else None)

    try:
        few = _least_tokens(render(16)) - _least_tokens(render(0))
    except Exception as e:  # noqa: BLE001
        if "limit on a request's template" in str(e):
            raise
        pytest.skip(f"{template} refuses {shape} ({e})")  # Gemma's: no tool roles of its own
    n = math.ceil(16 * CONTEXT / max(few, 1))
    assert _least_tokens(render(n)) >= CONTEXT  # the whole context, and no step limit met on the way


def test_a_recursive_loops_inner_items_are_steps_too():
    """``loop(items)`` in a recursive for loop iterates items the template built: each is a step, as the outer
    loop's are (uncounted, a nested list could loop far past the step limit); the loop still renders as Jinja does."""
    from lineside.runtime.chat_template import TemplateLimitError, compile_template, render_bounded

    text = "{% for x in items recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}{% endif %}{% endfor %}"
    small = TemplateLimits(max_chars=1 << 16, max_steps=50)
    nested = {"items": [[1, [2, 3]], 4]}
    assert render_bounded(compile_template(text, "t", small), small, nested) == "[1[23]]4"
    with pytest.raises(TemplateLimitError, match="more than 50 steps"):
        render_bounded(compile_template(text, "t", small), small, {"items": [list(range(3000))]})
