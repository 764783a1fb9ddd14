"""Completions' echo as scoring clients use it (lm-evaluation-harness's local-completions loglikelihood, OpenAI's
legacy API): the prompt in front of the text, its tokens' logprobs (the first one null) against transformers, the
completion unchanged by echo, streamed (the prompt first) and not, n > 1, prompt lists, usage."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from lineside.server import sse
from tests.server.conftest import tokenize

TEXT = "The bearing on line 3 runs hot"


def post(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's local-completions loglikelihood, from its documented behaviour: per choice (by index),
    the sum of token_logprobs[ctxlen:-1] (the last entry is the token generated with max_tokens 1) and whether each
    of those is the largest value of its top_logprobs dict."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(values), all(v == max(top.values()) for v, top in zip(values, tops, strict=True))))
    return res


def test_max_tokens_0_returns_the_prompt_scored_as_transformers_does(openai_client, server, ref_logprobs):
    ids = tokenize(server, TEXT)
    out = openai_client.completions.create(model="tiny-llama", prompt=TEXT, echo=True, logprobs=3, max_tokens=0,
                                    temperature=0)
    c = out.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), 0, len(ids))
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = ref_logprobs(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], [ref[p - 1, t] for p, t in enumerate(ids) if p], atol=1e-4)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs[1:])  # 3 alternatives, and the prompt's token
    assert all(lp.tokens[p] in top for p, top in enumerate(lp.top_logprobs) if p)
    # text_offset indexes the echoed text: each token's text starts where its offset says
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(TEXT)
    assert TEXT[lp.text_offset[-1]:] == lp.tokens[-1]


def test_lm_eval_loglikelihood_over_token_id_prompts(server, ref_logprobs):
    """What local-completions sends for loglikelihood: token-id prompts (context + continuation, no BOS added),
    max_tokens 1, logprobs 1, echo, temperature 0, a seed; the continuation's logprob and greediness from the
    response equal transformers'."""
    rng = np.random.default_rng(3)
    contexts = [[1, *rng.integers(3, 259, 12).tolist()], [1, *rng.integers(3, 259, 20).tolist()]]
    ref0 = ref_logprobs(contexts[0])
    greedy = [int(np.argmax(ref0[-1])), int(np.argmax(ref_logprobs([*contexts[0], int(np.argmax(ref0[-1]))])[-1]))]
    continuations = [greedy, rng.integers(3, 259, 3).tolist()]
    prompts = [c + k for c, k in zip(contexts, continuations, strict=True)]
    out = post(server, prompt=prompts, max_tokens=1, logprobs=1, echo=True, seed=1234)
    got = parse_logprobs(out, [len(c) for c in contexts])
    for (total, is_greedy), ctx, cont in zip(got, contexts, continuations, strict=True):
        ref = ref_logprobs(ctx + cont)
        want = [ref[len(ctx) + j - 1, t] for j, t in enumerate(cont)]
        assert total == pytest.approx(sum(want), abs=1e-3)
        assert is_greedy == all(ref[len(ctx) + j - 1].argmax() == t for j, t in enumerate(cont))
    assert got[0][1] is True
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] == 2
    for choice, p in zip(out["choices"], prompts, strict=True):
        assert len(choice["logprobs"]["tokens"]) == len(p) + 1


def test_echo_puts_the_prompt_in_front_and_changes_no_completion(server):
    plain = post(server, prompt=TEXT, max_tokens=6, logprobs=2)
    bare = post(server, prompt=TEXT, max_tokens=6, echo=True)
    scored = post(server, prompt=TEXT, max_tokens=6, echo=True, logprobs=2)
    answer = plain["choices"][0]["text"]
    assert bare["choices"][0]["text"] == scored["choices"][0]["text"] == TEXT + answer
    assert bare["choices"][0]["logprobs"] is None
    n = bare["usage"]["prompt_tokens"]
    assert bare["usage"] == scored["usage"] | {"prompt_tokens_details": bare["usage"]["prompt_tokens_details"]}
    block, tail = scored["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    assert block["tokens"][n:] == tail["tokens"] and block["token_logprobs"][n:] == tail["token_logprobs"]
    assert block["text_offset"][n:] == [len(TEXT) + o for o in tail["text_offset"]]


def test_streamed_echo_sends_the_prompt_first(server):
    whole = post(server, prompt=TEXT, max_tokens=5, echo=True, logprobs=1)
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": TEXT, "max_tokens": 5, "echo": True, "logprobs": 1, "temperature": 0,
                         "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    objs = [o for o in sse.parse(r.text) if o != "[DONE]"]
    chunks = [o["choices"][0] for o in objs if o["choices"]]
    assert chunks[0]["text"] == TEXT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["choices"][0]["logprobs"]["token_logprobs"]
    offsets = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    assert objs[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert objs[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_streamed_max_tokens_0_is_the_prompt_then_length(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": TEXT, "max_tokens": 0, "echo": True, "stream": True})
    chunks = [o["choices"][0] for o in sse.parse(r.text) if o != "[DONE]"]
    assert [c["text"] for c in chunks] == [TEXT, ""] and chunks[-1]["finish_reason"] == "length"


def test_n_choices_each_echo_their_prompt(openai_client):
    out = openai_client.completions.create(model="tiny-llama", prompt=["a valve", "the pump"], n=2, echo=True, logprobs=0,
                                    max_tokens=3, temperature=0.9, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        head = "a valve" if c.index < 2 else "the pump"
        assert c.text.startswith(head)
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(c.logprobs.text_offset)
    assert out.choices[0].logprobs.token_logprobs[1:3] == out.choices[1].logprobs.token_logprobs[1:3]


@pytest.mark.parametrize(("body", "param"), [({"max_tokens": 0}, "max_tokens"),
                                             ({"echo": True, "logprobs": 21}, "logprobs")])
def test_bad_echo_requests_are_one_line_400s(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": TEXT, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"]


# Chat's echo (vLLM's): a trailing assistant message, continued, comes back whole in front of the answer's content.
CONTINUED = [{"role": "user", "content": "What runs hot?"}, {"role": "assistant", "content": TEXT}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"temperature": 0, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_echo_puts_the_continued_message_in_front(server):
    plain = chat(server, messages=CONTINUED, **CONTINUE)
    echoed = chat(server, messages=CONTINUED, echo=True, **CONTINUE)
    answer = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == TEXT + answer
    assert echoed["usage"] == plain["usage"] | {"prompt_tokens_details": echoed["usage"]["prompt_tokens_details"]}


def test_streamed_chat_echo_sends_the_message_first(server):
    whole = chat(server, messages=CONTINUED, echo=True, **CONTINUE)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": CONTINUED, "echo": True, "temperature": 0, "max_tokens": 5, "stream": True,
                         **CONTINUE})
    assert r.status_code == 200
    deltas = [o["choices"][0]["delta"] for o in sse.parse(r.text) if o != "[DONE]" and o["choices"]]
    contents = [d["content"] for d in deltas if d.get("content")]
    assert deltas[0]["role"] == "assistant" and contents[0] == TEXT
    assert "".join(contents) == whole["choices"][0]["message"]["content"]


def test_chat_echo_after_a_user_message_changes_nothing(openai_client):
    """Nothing is being continued: vLLM echoes only a last message of the answer's role."""
    messages = [{"role": "user", "content": TEXT}]
    plain = openai_client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=5, temperature=0)
    echoed = openai_client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=5, temperature=0,
                                                   extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content
