"""The level-2 response cache answers only an exact repeat: two requests differing in any field that changes the
answer (stop_token_ids, min_tokens, a constraint, tools, logprobs, seed, n, ...) never share a cached answer.
The key is the engine requests (every field but ids and scheduling) and the output options, so a field that
reaches either is keyed without being listed; a request field neither reaches is classified below, and a new
one fails ``test_every_request_field_is_classified`` until it is."""

from __future__ import annotations

import shutil

import httpx
import pytest

from lineside.server.schemas import ChatCompletionRequest, CompletionRequest
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy
from tests.server.conftest import make_engine, running_server
from tests.server.slo.test_server import FakeClock, _push

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}  # short: 256-token context
# the tiny bundle's template, listing tools in one character (the 256-token context cannot hold them as text)
TEMPLATE = ("{% if tools %}T{% endif %}{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SEEDED = {"temperature": 0.8, "seed": 7}
CONTINUED = {"messages": [{"role": "user", "content": "probe chat echo"}, {"role": "assistant", "content": "The"}],
             "continue_final_message": True, "add_generation_prompt": False}

# (endpoint, the first request's extra fields, the second's): each pair differs in the named field only
DIFFERING = {
    "stop_token_ids": ("chat", {}, {"stop_token_ids": [40]}),
    "min_tokens": ("chat", {}, {"min_tokens": 2}),
    "ignore_eos": ("chat", {}, {"ignore_eos": True}),
    "stop": ("chat", {}, {"stop": ["zz"]}),
    "max_tokens": ("chat", {}, {"max_tokens": 3}),
    "max_completion_tokens": ("chat", {}, {"max_completion_tokens": 3}),
    "seed": ("chat", SEEDED, {**SEEDED, "seed": 8}),
    "temperature": ("chat", SEEDED, {**SEEDED, "temperature": 0.5}),
    "top_p": ("chat", SEEDED, {**SEEDED, "top_p": 0.5}),
    "top_k": ("chat", SEEDED, {**SEEDED, "top_k": 3}),
    "min_p": ("chat", SEEDED, {**SEEDED, "min_p": 0.2}),
    "repetition_penalty": ("chat", {}, {"repetition_penalty": 1.3}),
    "presence_penalty": ("chat", {}, {"presence_penalty": 1.0}),
    "frequency_penalty": ("chat", {}, {"frequency_penalty": 1.0}),
    "logit_bias": ("chat", {}, {"logit_bias": {"5": 10}}),
    "n": ("chat", SEEDED, {**SEEDED, "n": 2}),
    "logprobs": ("chat", {}, {"logprobs": True}),
    "top_logprobs": ("chat", {"logprobs": True, "top_logprobs": 1}, {"logprobs": True, "top_logprobs": 2}),
    "response_format": ("chat", {}, {"response_format": {"type": "json_object"}}),
    "guided_json": ("chat", {}, {"guided_json": {"type": "object"}}),
    "guided_regex": ("chat", {}, {"guided_regex": "[ab]+"}),
    "guided_choice": ("chat", {}, {"guided_choice": ["yes", "no"]}),
    "guided_grammar": ("chat", {}, {"guided_grammar": 'root ::= "yes" | "no"'}),
    "structured_outputs": ("chat", {}, {"structured_outputs": {"regex": "[ab]+"}}),
    "tools": ("chat", {}, {"tools": [TOOL]}),
    "tool_choice": ("chat", {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "required"}),
    "parallel_tool_calls": ("chat", {"tools": [TOOL], "tool_choice": "required"},
                            {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
    "speculative": ("chat", {}, {"speculative": False}),
    "skip_special_tokens": ("completions", {}, {"skip_special_tokens": False}),
    "include_stop_str_in_output": ("completions", {"stop": ["a"]}, {"stop": ["a"], "include_stop_str_in_output": True}),
    "model": ("chat", {}, {"model": "tiny-llama"}),  # the same model by name: kept apart, which costs only a miss
    "messages": ("chat", {}, {"messages": [{"role": "user", "content": "another"}]}),
    "add_generation_prompt": ("chat", {}, {"add_generation_prompt": False}),
    "prompt": ("completions", {}, {"prompt": "another"}),
    "completion_logprobs": ("completions", {}, {"logprobs": 1}),
    "echo": ("completions", {}, {"echo": True}),  # the same engine request: the prompt in front of the text
    # chat's echo: the same engine request, the continued assistant message in front of the content
    "chat_echo": ("chat", CONTINUED, {**CONTINUED, "echo": True}),
    "prompt_logprobs": ("chat", {}, {"prompt_logprobs": 1}),
    # the same engine request (echo's logprobs 2 already score the prompt with 2 alternatives): the output differs
    "echo_prompt_logprobs": ("completions", {"echo": True, "logprobs": 2},
                             {"echo": True, "logprobs": 2, "prompt_logprobs": 1}),
    "add_special_tokens": ("completions", {}, {"add_special_tokens": False}),  # no BOS: other prompt ids
    # another tenant's salt: its own cached answers, as its own prefix KV (a hit's speed would leak the prompt)
    "cache_salt": ("chat", {}, {"cache_salt": "tenant-b"}),
}
# Refused (a 400 before any cache lookup) unless absent or their no-op value.
REFUSED = {"suffix": {"suffix": "end"},
           "best_of": {"best_of": 2},
           "bad_words": {"bad_words": ["x"]}, "allowed_token_ids": {"allowed_token_ids": [5]},
           "truncate_prompt_tokens": {"truncate_prompt_tokens": 4}, "use_beam_search": {"use_beam_search": True},
           "logits_processors": {"logits_processors": ["x"]}, "functions": {"functions": [TOOL["function"]]},
           "function_call": {"function_call": {"name": "f"}}, "chat_template": {"chat_template": "{{ 1 }}"},
           "stream_options": {"stream_options": {"include_usage": True}},
           "modalities": {"modalities": ["text", "audio"]}, "audio": {"audio": {"voice": "alloy", "format": "wav"}},
           "web_search_options": {"web_search_options": {}},
           "priority": {"priority": 1}, "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
           "guided_whitespace_pattern": {"guided_whitespace_pattern": " "},
           "structural_tag": {"structural_tag": "{}"}}
# Change nothing in the answer: the same cached answer is right.
NO_EFFECT = {"user": {"user": "alice"}, "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
             "metadata": {"metadata": {"line": "3"}},
             # the served tokenizers put no space between special tokens either way (schemas.py)
             "spaces_between_special_tokens": {"spaces_between_special_tokens": False}}
# Keyed by what they change, tested where the key is: the prompt ids they render (a template's extra variables and
# vLLM's documents, continuing the last message), the output options (include_reasoning: their Reasoning, on a server with
# --reasoning-parser; no effect without one), or never cached (streamed; bound to a prefill session, whose KV a
# cached answer would not keep).
ELSEWHERE = {"chat_template_kwargs", "documents", "reasoning_effort", "continue_final_message", "include_reasoning",
             "stream", "session_id", "keep_session"}


def test_every_request_field_is_classified():
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    classified = {k for k in DIFFERING if k not in ("completion_logprobs", "echo_prompt_logprobs", "chat_echo")} | set(REFUSED) | set(NO_EFFECT) | ELSEWHERE
    assert fields - classified == set(), "classify the new request field here: does it change the answer?"
    assert classified - fields == set()


@pytest.fixture(scope="module")
def level2(tiny_bundle, tmp_path_factory):
    """A server held at level 2 (cache on) on a fake clock: primary and fallback both the tiny bundle."""
    fallback_dir = tmp_path_factory.mktemp("fb") / "tiny-fallback"
    shutil.copytree(tiny_bundle, fallback_dir)
    clock = FakeClock()
    guard = SloGuard(SloPolicy(window_s=30, recover_after_s=300), fallback=make_engine(fallback_dir, num_slots=4),
                     fallback_name="tiny-fallback", clock=clock, device=lambda: (None, None), ticking=False)
    with running_server(make_engine(tiny_bundle, num_slots=4), slo_guard=guard, chat_template=TEMPLATE) as srv:
        _push(guard, 1.0)
        assert _push(guard, 2.0) == 2
        yield srv


def ask(srv, endpoint: str, probe: str, **extra) -> httpx.Response:
    base = ({"messages": [{"role": "user", "content": probe}]} if endpoint == "chat" else {"prompt": probe})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(srv.url + path, json={**base, "max_tokens": 4, "temperature": 0, **extra}, timeout=120)


def hit(r: httpx.Response) -> bool:
    assert r.status_code == 200, r.text
    return r.headers.get("x-lineside-cache") == "hit"


@pytest.mark.parametrize("name", sorted(DIFFERING))
def test_requests_differing_in_one_field_do_not_share_an_answer(level2, name):
    endpoint, first, second = DIFFERING[name]
    probe = f"probe {name}"  # each case its own prompt: no answer cached by another case
    assert not hit(ask(level2, endpoint, probe, **first))
    assert hit(ask(level2, endpoint, probe, **first))  # a repeat is answered from the cache
    assert not hit(ask(level2, endpoint, probe, **second))
    assert hit(ask(level2, endpoint, probe, **second))


def test_stop_token_ids_end_the_answer_rather_than_the_cached_one(level2):
    """The reported defect: an answer cached without stop_token_ids was served to a request whose stop id is the
    answer's first token."""
    plain = ask(level2, "completions", "stop id probe", logprobs=0)
    assert not hit(plain) and plain.json()["usage"]["completion_tokens"] == 4
    token = plain.json()["choices"][0]["logprobs"]["tokens"][0]
    want = bytes.fromhex(token[len("bytes:"):].replace("\\x", "")) if token.startswith("bytes:") else token.encode()
    grammar = level2.state.engine.grammar
    first = next(t for t in range(grammar.tokenizer_size) if grammar.token_bytes(t) == want)
    stopped = ask(level2, "completions", "stop id probe", logprobs=0, stop_token_ids=[first])
    assert not hit(stopped)
    assert stopped.json()["usage"]["completion_tokens"] == 1 and stopped.json()["choices"][0]["text"] == ""


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_are_a_400_at_level_2(level2, name):
    endpoint = "completions" if name in {"suffix", "best_of"} else "chat"
    hit(ask(level2, endpoint, "refused probe"))  # 200, cached from here on
    r = ask(level2, endpoint, "refused probe", **REFUSED[name])
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("name", sorted(NO_EFFECT))
def test_fields_that_change_nothing_share_the_answer(level2, name):
    probe = f"same probe {name}"
    assert not hit(ask(level2, "chat", probe))
    assert hit(ask(level2, "chat", probe, **NO_EFFECT[name]))


def test_a_session_bound_request_is_never_answered_from_the_cache(level2):
    assert not hit(ask(level2, "completions", "session probe", session_id="s-1"))
    assert not hit(ask(level2, "completions", "session probe", session_id="s-1"))
