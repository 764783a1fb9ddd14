"""builtin:deepseek_v4, lineside's Jinja port of DeepSeek-V4's prompt format, against prompts the release's own
Python encoder wrote (tests/runtime/data/deepseek_v4_chat_template.json names the copies it was run from), and the
template a DeepSeek-V4 bundle without one of its own gets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lineside.runtime.chat_template import check_chat_template, compile_template, load_chat_template
from lineside.runtime.tokenizer import Tokenizer
from lineside.server.tool_calls import _template_call
from tests.tiny_tokenizer import write_byte_tokenizer

FIXTURE = json.loads((Path(__file__).parent / "data" / "deepseek_v4_chat_template.json").read_text(encoding="utf-8"))
CASES = FIXTURE["cases"]


def _as_served(messages: list[dict]) -> list[dict]:
    """The messages as the server hands them to a template that iterates a call's arguments (an object)."""
    return [{**m, "tool_calls": [_template_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


@pytest.fixture(scope="module")
def template():
    return compile_template(load_chat_template("builtin:deepseek_v4"), "builtin:deepseek_v4")


def test_fixture_names_its_sources_and_covers_the_format():
    assert len(FIXTURE["sources"]) >= 2 and all(len(s["commit"]) == 40 for s in FIXTURE["sources"])
    assert 10 <= len(CASES) <= 20
    prompts = "".join(c["prompt"] for c in CASES)
    for piece in ("<｜DSML｜tool_calls>", "<tool_result>", "<think>", "## Tools", "<｜User｜>"):
        assert piece in prompts
    assert any(c["thinking"] for c in CASES) and any(not c["thinking"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_renders_as_the_encoder(template, case):
    got = template.render(messages=_as_served(case["messages"]), tools=case["tools"], add_generation_prompt=True,
                          thinking=case["thinking"], bos_token="<｜begin▁of▁sentence｜>",
                          eos_token="<｜end▁of▁sentence｜>")
    assert got == case["prompt"]


@pytest.mark.parametrize("kwargs", [{"thinking": True}, {"enable_thinking": True}])
def test_thinking_as_vllm_passes_it(template, kwargs):
    msgs = [{"role": "user", "content": "Hi"}]
    assert template.render(messages=msgs, add_generation_prompt=True, **kwargs).endswith("<｜Assistant｜><think>")
    assert template.render(messages=msgs, add_generation_prompt=True).endswith("<｜Assistant｜></think>")


# vLLM's copy of the encoder (vllm/tokenizers/deepseek_v4_encoding.py): written before the first message in thinking
# mode when the request's reasoning_effort is "max"
EFFORT_MAX = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
              "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
              "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
              "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
              "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


@pytest.mark.parametrize(("kwargs", "thinking"), [
    ({"reasoning_effort": "high"}, True), ({"reasoning_effort": "low"}, True), ({"reasoning_effort": "max"}, True),
    ({"reasoning_effort": "high", "enable_thinking": True}, True), ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "none", "thinking": True}, False), ({"reasoning_effort": "high", "thinking": False}, False),
    ({"reasoning_effort": "max", "thinking": False}, False), ({"reasoning_effort": None}, False)])
def test_reasoning_effort_as_vllm_maps_it(template, kwargs, thinking):
    """vLLM's DeepSeek-V4 tokenizer: an effort turns thinking on unless thinking / enable_thinking say otherwise,
    "none" turns it off, "max" in thinking mode puts the encoder's prefix first; the rest renders as the encoder."""
    bos = "<｜begin▁of▁sentence｜>"
    cases = [c for c in CASES if c["thinking"] == thinking]
    assert len(cases) >= 5
    for case in cases:
        got = template.render(messages=_as_served(case["messages"]), tools=case["tools"], add_generation_prompt=True,
                              bos_token=bos, eos_token="<｜end▁of▁sentence｜>", **kwargs)
        want = case["prompt"]
        if thinking and kwargs["reasoning_effort"] == "max":
            want = bos + EFFORT_MAX + want[len(bos):]
        assert got == want, case["name"]


def test_no_generation_prompt_without_add_generation_prompt(template):
    out = template.render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert out == "<｜begin▁of▁sentence｜><｜User｜>Hi"


def test_reasoning_field_as_vllm_names_it(template):
    """vLLM hands an earlier turn's thinking back as ``reasoning``; it is kept where ``reasoning_content`` is."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "because"}]
    out = template.render(messages=msgs, tools=tools, add_generation_prompt=False, thinking=True)
    assert out.endswith("<｜User｜>Q<｜Assistant｜><think>because</think>A<｜end▁of▁sentence｜>")


def test_shipped_template_passes_the_startup_check():
    check_chat_template(load_chat_template("builtin:deepseek_v4"), "builtin:deepseek_v4")


def _bundle(tmp_path: Path, architecture: str, template: str | None) -> SimpleNamespace:
    d = tmp_path / "tokenizer"
    d.mkdir(parents=True)
    write_byte_tokenizer(d, 300)
    cfg = {"chat_template": template} if template is not None else {}  # write_byte_tokenizer's has one
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return SimpleNamespace(tokenizer_dir=d, architecture=architecture, manifest=SimpleNamespace(tokenizer={}))


def test_v4_bundle_without_a_template_gets_the_port(tmp_path):
    tok = Tokenizer.from_bundle(_bundle(tmp_path, "deepseek_v4", None))
    assert tok.chat_template == load_chat_template("builtin:deepseek_v4")


def test_checkpoint_template_wins_and_other_architectures_get_none(tmp_path):
    own = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert Tokenizer.from_bundle(_bundle(tmp_path / "a", "deepseek_v4", own)).chat_template == own
    assert Tokenizer.from_bundle(_bundle(tmp_path / "b", "llama", None)).chat_template is None
