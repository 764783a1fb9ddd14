"""vLLM's ``prompt_logprobs`` on /v1/completions and /v1/chat/completions: null for the first prompt token, then per
position a dict from token id (a string key) to {logprob, rank, decoded_token}, the prompt's token first; numbers
against transformers' float32 log_softmax, exact ranks, through raw JSON and the openai openai_client, streamed (once, in the
first chunk that carries them), n > 1, beside echo, and bad values as one-line 400s."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from lineside.server import sse
from tests.server.conftest import tokenize

TEXT = "The bearing on line 3 runs hot"
MESSAGES = [{"role": "user", "content": "Why does the spindle on line 3 rattle?"}]


def chat_ids(server) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def post(server, path: str = "/v1/completions", **body) -> dict:
    r = httpx.post(server.url + path, json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_against_transformers(block: list, ids: list[int], ref: np.ndarray, top_n: int, decode) -> None:
    """``block`` is vLLM's prompt_logprobs for ``ids``: values within 1e-4 of transformers, the ranks exact."""
    assert len(block) == len(ids) and block[0] is None
    for p in range(1, len(ids)):
        row, tok, position = ref[p - 1], ids[p], block[p]
        keys = list(position)
        assert keys[0] == str(tok)  # the prompt's own token first
        best = np.argsort(-row, kind="stable")[:top_n].tolist()
        assert keys[1:] == [str(i) for i in best if i != tok] and len(keys) <= top_n + 1
        for key, entry in position.items():
            tid = int(key)
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["logprob"] == pytest.approx(row[tid], abs=1e-4)
            assert entry["decoded_token"] == decode(tid)
            near = np.abs(row - row[tid]) < 1e-4
            if near.sum() == 1:  # no near-tie whose order float noise could swap
                assert entry["rank"] == int((row > row[tid]).sum()) + 1
        assert [position[str(i)]["rank"] for i in best] == list(range(1, len(best) + 1))


@pytest.fixture(scope="module")
def decode(server):
    tok = server.state.engine.tokenizer
    return lambda tid: tok.decode([tid], skip_special=False)


def test_completions_prompt_logprobs_equal_transformers_and_change_no_answer(server, ref_logprobs, decode):
    ids = tokenize(server, TEXT)
    plain = post(server, prompt=TEXT, max_tokens=5)
    out = post(server, prompt=TEXT, max_tokens=5, prompt_logprobs=3)
    choice = out["choices"][0]
    assert choice["text"] == plain["choices"][0]["text"] and choice["logprobs"] is None
    assert "prompt_logprobs" not in plain["choices"][0]
    check_against_transformers(choice["prompt_logprobs"], ids, ref_logprobs(ids), 3, decode)


def test_prompt_logprobs_0_is_each_prompt_token_alone(server, ref_logprobs):
    ids = tokenize(server, TEXT)
    block = post(server, prompt=TEXT, max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    ref = ref_logprobs(ids)
    assert [list(pos) for pos in block[1:]] == [[str(t)] for t in ids[1:]]
    got = [block[p][str(t)]["logprob"] for p, t in enumerate(ids) if p]
    np.testing.assert_allclose(got, [ref[p - 1, t] for p, t in enumerate(ids) if p], atol=1e-4)


def test_chat_prompt_logprobs_are_the_responses_through_the_openai_client(openai_client, server, ref_logprobs, decode):
    ids = chat_ids(server)
    out = openai_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=3, temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 2})
    block = out.model_extra["prompt_logprobs"]  # vLLM's: one for the request, beside the choices
    assert out.usage.prompt_tokens == len(ids) == len(block)
    check_against_transformers(block, ids, ref_logprobs(ids), 2, decode)
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in out.choices)


def test_completions_n_and_prompt_lists_each_choice_its_prompts(openai_client, server):
    texts = [TEXT, "Coolant pressure dropped at noon"]
    out = openai_client.completions.create(model="tiny-llama", prompt=texts, max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 1})
    assert len(out.choices) == 4
    for c in out.choices:
        ids = tokenize(server, texts[c.index // 2])
        block = c.model_extra["prompt_logprobs"]
        assert block[0] is None and [next(iter(pos)) for pos in block[1:]] == [str(t) for t in ids[1:]]
    first = [c.model_extra["prompt_logprobs"] for c in out.choices]
    assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2]


def test_with_echo_and_logprobs_each_has_its_own_number_of_alternatives(server):
    both = post(server, prompt=TEXT, max_tokens=2, echo=True, logprobs=1, prompt_logprobs=4)["choices"][0]
    alone = post(server, prompt=TEXT, max_tokens=2, prompt_logprobs=4)["choices"][0]
    echoed = post(server, prompt=TEXT, max_tokens=2, echo=True, logprobs=1)["choices"][0]
    assert both["prompt_logprobs"] == alone["prompt_logprobs"]
    assert both["logprobs"] == echoed["logprobs"] and both["text"] == echoed["text"]
    assert all(len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:])
    assert max(len(pos) for pos in both["prompt_logprobs"][1:]) >= 4


def stream(server, path: str, body: dict) -> list[dict]:
    r = httpx.post(server.url + path, json={"temperature": 0, "stream": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return [o for o in sse.parse(r.text) if o != "[DONE]"]


def test_streamed_completions_send_each_choices_prompt_logprobs_once_in_its_first_chunk(server):
    whole = post(server, prompt=TEXT, max_tokens=4, n=2, prompt_logprobs=2)
    objs = stream(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 4, "n": 2, "prompt_logprobs": 2})
    for index in (0, 1):
        mine = [o["choices"][0] for o in objs if o["choices"] and o["choices"][0]["index"] == index]
        carrying = [k for k, c in enumerate(mine) if "prompt_logprobs" in c]
        assert carrying == [0]
        assert mine[0]["prompt_logprobs"] == whole["choices"][index]["prompt_logprobs"]
        assert "".join(c["text"] for c in mine) == whole["choices"][index]["text"]


def test_streamed_echo_carries_the_prompt_logprobs_in_the_prompts_chunk(server):
    objs = stream(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 2, "echo": True, "prompt_logprobs": 1})
    chunks = [o["choices"][0] for o in objs]
    assert chunks[0]["text"] == TEXT and "prompt_logprobs" in chunks[0]
    assert not any("prompt_logprobs" in c for c in chunks[1:])


def test_streamed_chat_sends_the_prompt_logprobs_once(server):
    whole = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=3, n=2, prompt_logprobs=1)
    objs = stream(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "n": 2,
                                                   "prompt_logprobs": 1})
    carrying = [k for k, o in enumerate(objs) if "prompt_logprobs" in o]
    assert len(carrying) == 1 and objs[carrying[0]]["prompt_logprobs"] == whole["prompt_logprobs"]
    # nothing but the role chunks before it: it comes with the first engine output
    assert all(o["choices"][0]["delta"].get("role") == "assistant" for o in objs[:carrying[0]])
    texts = ["".join(o["choices"][0]["delta"].get("content") or "" for o in objs
                     if o["choices"] and o["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == [c["message"]["content"] for c in whole["choices"]]


@pytest.mark.parametrize("value", [-1, 21, "2", True, 1.5, [1]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_prompt_logprobs_are_one_line_400s(server, path, value):
    base = {"prompt": TEXT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(server.url + path, json={**base, "max_tokens": 1, "prompt_logprobs": value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and "\n" not in err["message"] and "0 to 20" in err["message"]
