"""User-given chat templates: what --chat-template's value stands for (a file, inline text, a shipped one), the
one-line refusals, rendering with another template or extra variables per call, and the shipped SmolLM2 tool
template (identical to the model's own without tools)."""

from __future__ import annotations

import pickle

import pytest

from lineside.runtime.chat_template import (
    ChatTemplateError,
    builtin_templates,
    check_chat_template,
    check_kwargs,
    load_chat_template,
    template_option,
)
from tests.server.test_chat_template import SMOLLM2_GGUF_TEMPLATE
from tests.tiny_tokenizer import write_byte_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_file_inline_text_and_shipped_templates(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(CHATML, encoding="utf-8")
    assert load_chat_template(str(f)) == CHATML
    assert load_chat_template(CHATML) == CHATML  # not a file: the text itself
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"  # vLLM's unescape
    assert "smollm2_tools" in builtin_templates()
    assert "<tool_call>[" in load_chat_template("builtin:smollm2_tools")


@pytest.mark.parametrize("make, words", [
    (lambda d: str(d / "missing.jinja"), "looks like a file path but cannot be read"),
    (lambda d: str(d), "is a directory"),
    (lambda d: _write(d / "empty.jinja", ""), "the file is empty"),
    (lambda d: _write(d / "latin.jinja", b"\xe9t\xe9"), "not UTF-8"),
    (lambda d: _write(d / "syntax.jinja", "{% for m in messages %}{{ m.content }}"), "not a valid Jinja template (line 1"),
    (lambda d: _write(d / "undefined.jinja", "{{ messages[2].content }}"), "fails to render a one-message"),
    (lambda d: _write(d / "raises.jinja", "{{ raise_exception('needs a system message') }}"), "needs a system"),
    (lambda d: _write(d / "drops.jinja", "{% for m in messages %}{{ m.role }}{% endfor %}"), "without the message"),
    (lambda d: "builtin:llama9", "no such shipped template"),
    (lambda d: "builtin:../templates/smollm2_tools", "no such shipped template"),  # a name, not a path
    (lambda d: "", "is empty"),
])
def test_bad_templates_are_one_line(tmp_path, make, words):
    value = make(tmp_path)
    with pytest.raises(ChatTemplateError) as e:
        template_option(value)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith("--chat-template ")


def _write(path, data) -> str:
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return str(path)


def test_kwargs_checks():
    assert check_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for bad in (["x"], {"not a name": 1}, {"messages": []}, {"bos_token": "x"}, {"self": 1}):
        with pytest.raises(ChatTemplateError):
            check_kwargs(bad)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return Tokenizer(d, {"bos_token_id": 1, "eos_token_ids": [2], "chat_template": CHATML})


def test_render_with_another_template_and_variables(tok):
    msgs = [{"role": "user", "content": "hi"}]
    other = "{% for m in messages %}[{{ m.role }}|{{ shift | default('day') }}] {{ m.content }}{% endfor %}"
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, chat_template=other) == "[user|day] hi"
    assert tok.apply_chat_template(msgs, chat_template=other, template_kwargs={"shift": "night"}) == "[user|night] hi"
    assert tok.encode_chat(msgs, chat_template=other) == tok.encode("[user|day] hi")
    assert tok.apply_chat_template(msgs).startswith("<|im_start|>")  # the bundle's own is untouched
    copy = pickle.loads(pickle.dumps(tok))  # a tokenizer worker's copy renders the same
    assert copy.apply_chat_template(msgs, chat_template=other, template_kwargs={"shift": "x"}) == "[user|x] hi"


def test_shipped_smollm2_template_equals_the_models_own_without_tools():
    from lineside.runtime.chat_template import environment

    env = environment()
    ours, theirs = env.from_string(load_chat_template("builtin:smollm2_tools")), env.from_string(SMOLLM2_GGUF_TEMPLATE)
    for msgs in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Station 4?"}]):
        for gen in (True, False):
            assert ours.render(messages=msgs, add_generation_prompt=gen) == \
                theirs.render(messages=msgs, add_generation_prompt=gen)
    check_chat_template(load_chat_template("builtin:smollm2_tools"), "shipped")


# Jinja that real chat templates use and transformers' sandbox allows: loop controls, the {% generation %} block
# (assistant masks; rendered as its body), tojson's keyword arguments.
TRANSFORMERS_JINJA = [
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role }}: {{ m.content }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    "{% for m in messages %}{{ m.content }}{% if loop.index >= 2 %}{% break %}{% endif %}\n{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}",
    "{% if tools %}{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}{{ tools | tojson(ensure_ascii=True) }}"
    "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
]


@pytest.mark.parametrize("template", TRANSFORMERS_JINJA)
def test_renders_what_transformers_renders(template):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from lineside.runtime.chat_template import compile_template

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Station 4?"}]
    tools = [{"type": "function", "function": {"name": "pumpe_prüfen", "parameters": {"b": 1, "a": 2}}}]
    check_chat_template(template, "--chat-template")
    for gen in (True, False):
        kw = dict(messages=msgs, add_generation_prompt=gen, tools=tools)
        assert compile_template(template, "t").render(**kw) == _compile_jinja_template(template).render(**kw)


def test_a_request_without_tools_renders_as_transformers_with_tools_none(tok):
    """transformers renders every template with ``tools`` defined (None when no tools are given): a template that
    tests ``tools is not none`` without an ``is defined`` guard writes no tool section then (undefined is not
    none)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% if tools is not none %}[tools: {{ tools | length }}]\n{% endif %}{% for m in messages %}"
                "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    check_chat_template(template, "--chat-template")
    for given in (None, tools):
        for gen in (True, False):
            theirs = render_jinja_template([msgs], tools=given, chat_template=template, add_generation_prompt=gen)[0][0]
            assert tok.apply_chat_template(msgs, gen, given, chat_template=template) == theirs


# Qwen2.5's message loop: a role it does not know (OpenAI's "developer") is not written at all
QWEN_LIKE = ("{% for m in messages %}{% if m.role in ('system', 'user', 'assistant') %}<|im_start|>{{ m.role }}\n"
             "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% endif %}")
KNOWS_DEVELOPER = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% else %}[{{ m.role }}]{% endif %}"
                   "{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("template", [None, QWEN_LIKE])
def test_developer_messages_render_as_system_ones(tok, template):
    """OpenAI's ``developer`` role is the system role of its newer models; HF templates know only ``system`` (and
    drop or mislabel anything else), so a developer message renders as a system one, as vLLM and llama.cpp's
    server map it."""
    def render(role):
        return tok.apply_chat_template([{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                       chat_template=template)

    assert "Be brief." in render("developer")
    assert render("developer") == render("system")


def test_a_template_that_knows_the_developer_role_gets_it(tok):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, chat_template=KNOWS_DEVELOPER) == "[dev]Be brief.[user]Hi"


def test_the_sandbox_refuses_the_known_escapes_and_pyproject_pins_a_jinja2_that_does():
    """Bundle templates and trusted request templates run in Jinja's sandbox; jinja2 3.1.4 let a template reach
    str.format unsandboxed through an indirect call (CVE-2024-56326) and 3.1.5 through the |attr filter
    (CVE-2025-27516), from there any attribute of any object. pyproject allowed any 3.1.x."""
    import re
    from pathlib import Path

    from lineside.runtime.chat_template import compile_template

    escape = '{{ ("{0.__class__.__mro__}"|attr("format"))(messages) }}'
    with pytest.raises(Exception, match="unsafe"):
        compile_template(escape, "t").render(messages=[1])
    pin = re.search(r'"jinja2\s*>=\s*([\d.]+)', (Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pin is not None and tuple(int(p) for p in pin.group(1).split(".")) >= (3, 1, 6), \
        f"pyproject must require jinja2>=3.1.6, has {pin and pin.group(0)!r}"


class _Jumping:
    """A clock that moves 10 s at every read: any wall-clock deadline has passed by the next check."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 10.0
        return self.now


def test_probes_of_a_template_do_not_depend_on_the_wall_clock(monkeypatch):
    """shows_system / alternates / ... are cached per template text and decide how the bundle's own (trusted)
    template renders: a stalled process (a clock past the request deadline) must not cache a wrong answer."""
    import lineside.runtime.chat_template as ct

    gemma = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('alternate') }}{% endif %}<t>{{ m['content'] }}</t>{% endfor %}")
    monkeypatch.setattr(ct, "time", _Jumping())
    for probe in (ct.shows_system, ct.alternates):
        probe.cache_clear()
    try:
        assert ct.shows_system(SMOLLM2_GGUF_TEMPLATE)
        assert ct.alternates(gemma)
    finally:
        for probe in (ct.shows_system, ct.alternates):
            probe.cache_clear()


@pytest.mark.parametrize("context, steps, deadline", [
    (512, 500_000, 2.0),  # small contexts: the floors
    (1953, 500_000, 2.0),
    (4096, 256 * 4096, 2.0 * 4096 * 256 / 500_000),  # 4.19 s
    (131_072, 256 * 131_072, 2.0 * 131_072 * 256 / 500_000),  # 134 s
])
def test_the_render_deadline_grows_with_the_context_as_the_steps_do(context, steps, deadline):
    """A longer context's conversation takes more steps to render, and so more time: the deadline scales from the
    same base as the step limit (2 s for 500,000 steps), each with its floor; checked on the limits, not a clock."""
    from lineside.runtime.chat_template import TemplateLimits

    limits = TemplateLimits.for_context(context)
    assert limits.max_steps == steps
    assert limits.deadline_s == pytest.approx(deadline)
    assert limits.deadline_s / 2.0 == pytest.approx(limits.max_steps / 500_000)
