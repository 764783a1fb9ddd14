"""Request-parameter ranges decided against vLLM's sampling_params.py / protocol.py and OpenAI's API, the same on
chat, completions and /v1/responses: best_of on chat as on completions, repetition_penalty any value > 0,
temperature 0..2, stop_token_ids inside the vocabulary, seed -1 unseeded, and the chat-only fields /v1/responses
does not do refused by name rather than dropped. Requests go through the openai client where it shapes them."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from lineside.server import request_mapping
from lineside.server.schemas import ChatCompletionRequest
from lineside.server.slo.cache import reproducible

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 300  # tests/conftest.py's tiny checkpoint


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _refused(call, param: str) -> str:
    """The 400's one-line message, after checking it names ``param``."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    body = e.value.body
    assert body["param"] == param, body
    assert "\n" not in body["message"]
    return body["message"]


def _chat(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, temperature=0, **extra)


def _completion(client, **extra):
    return client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, **extra)


def _response(client, **extra):
    return client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0, **extra)


# ---- best_of: chat as completions (vLLM's chat request has no best_of: it drops it with a warning) -------------
@pytest.mark.parametrize("n,best_of", [(1, 3), (2, 1)])
def test_chat_best_of_other_than_n_is_refused_as_on_completions(client, n, best_of):
    """best_of asks for the best n of best_of samples; chat dropped it and answered with n plain samples."""
    message = _refused(lambda: _chat(client, n=n, extra_body={"best_of": best_of}), "best_of")
    assert f"best_of={n}" in message  # what to send instead
    _refused(lambda: _completion(client, n=n, extra_body={"best_of": best_of}), "best_of")


def test_chat_best_of_equal_to_n_is_n(client):
    plain = _chat(client, n=2, seed=4, extra_body={"temperature": 1.0})
    same = _chat(client, n=2, seed=4, extra_body={"temperature": 1.0, "best_of": 2})
    assert [c.message.content for c in same.choices] == [c.message.content for c in plain.choices]


# ---- repetition_penalty: vLLM takes any finite value > 0 --------------------------------------------------------
@pytest.mark.parametrize("value", [10.5, 50, 1e6])
def test_repetition_penalty_above_10_is_honoured_as_vllm(client, value):
    """A client tuned on vLLM sends 12 or 20; this server refused anything past 10."""
    assert _chat(client, extra_body={"repetition_penalty": value}).choices[0].finish_reason in ("stop", "length")
    assert _completion(client, extra_body={"repetition_penalty": value}).choices[0].text is not None
    r = _response(client, extra_body={"repetition_penalty": value})
    assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize("value", [0, -1.5])
def test_repetition_penalty_must_be_above_zero(client, value):
    for call in (_chat, _response):
        message = _refused(lambda call=call: call(client, extra_body={"repetition_penalty": value}),
                           "repetition_penalty")
        assert "greater than 0" in message, message


def test_a_huge_repetition_penalty_gives_finite_logprobs(server):
    """Penalty 1e6 on the prompt's tokens (a seen token's positive logit shrinks to ~0, a negative one is multiplied
    far down): the answer's logprobs stay numbers, no NaN from the products."""
    prompt = list(range(3, 40))
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "repetition_penalty": 1e6,
        "ignore_eos": True, "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert all(np.isfinite(lp) for lp in lps)


# ---- temperature: OpenAI's 0..2, which vLLM also enforces since its PR #44965 -----------------------------------
@pytest.mark.parametrize("call", [_chat, _completion, _response])
def test_temperature_past_2_is_a_400_on_every_endpoint(client, call):
    assert call(client, extra_body={"temperature": 2}) is not None
    message = _refused(lambda: call(client, extra_body={"temperature": 2.5}), "temperature")
    assert "2" in message


# ---- stop_token_ids: vLLM refuses an id past the vocabulary, which could never be sampled ------------------------
@pytest.mark.parametrize("call", [_chat, _completion, _response])
def test_stop_token_ids_past_the_vocabulary_are_a_400(client, call):
    message = _refused(lambda: call(client, extra_body={"stop_token_ids": [5, VOCAB]}), "stop_token_ids")
    assert str(VOCAB) in message and f"0 to {VOCAB - 1}" in message
    assert call(client, extra_body={"stop_token_ids": [VOCAB - 1]}) is not None


# ---- seed: any signed 64-bit integer, -1 meaning none (vLLM's and llama.cpp's "random") ------------------------
def test_seed_minus_one_is_unseeded_and_not_cached():
    """-1 is vLLM's SamplingParams (and llama.cpp's server) "no seed": it was the fixed seed 2**64 - 1 here, so
    every such request repeated one answer and the SLO cache served it as a seeded one."""
    req = ChatCompletionRequest(messages=MSGS, temperature=0.9, seed=-1)
    sampling = request_mapping.sampling_params(req)
    assert sampling.seed is None and not reproducible(sampling)
    other = request_mapping.sampling_params(ChatCompletionRequest(messages=MSGS, temperature=0.9, seed=-2))
    assert other.seed == 2**64 - 2 and reproducible(other)  # another negative seed is a seed, as vLLM's


@pytest.mark.parametrize("seed,status", [(-(2**63), 200), (2**63 - 1, 200), (2**63, 400), (2**64 + 1, 400),
                                         (-(2**63) - 1, 400)])
def test_seed_is_a_signed_64_bit_integer_as_vllm(client, seed, status):
    if status == 200:
        assert _chat(client, seed=seed) is not None
        assert _response(client, extra_body={"seed": seed}) is not None
    else:
        _refused(lambda: _chat(client, seed=seed), "seed")
        _refused(lambda: _response(client, extra_body={"seed": seed}), "seed")


# ---- /v1/responses: chat's n / best_of / logprobs / prompt_logprobs are refused by name, not dropped -------------
@pytest.mark.parametrize("field,value,instead", [
    ("n", 2, "one output"), ("best_of", 2, "one output"), ("logprobs", True, "top_logprobs"),
    ("prompt_logprobs", 1, "/v1/completions"),
])
def test_responses_refuses_chat_only_fields(client, field, value, instead):
    message = _refused(lambda: _response(client, extra_body={field: value}), field)
    assert instead in message


@pytest.mark.parametrize("extra", [{"n": 1}, {"best_of": 1}, {"logprobs": False}, {"prompt_logprobs": None}])
def test_responses_takes_those_fields_at_their_defaults(client, extra):
    assert _response(client, extra_body=extra).status in ("completed", "incomplete")


def test_responses_logprobs_as_the_openai_client_asks_for_them(client):
    """OpenAI's way: include message.output_text.logprobs with top_logprobs."""
    r = _response(client, top_logprobs=2, include=["message.output_text.logprobs"])
    part = r.output[-1].content[0]
    assert part.logprobs and len(part.logprobs[0].top_logprobs) == 2
