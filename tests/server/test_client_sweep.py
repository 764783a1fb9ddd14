"""What clients written for OpenAI / vLLM / llama.cpp / Ollama send, field by field: each documented request
field is either honoured or refused with one 400 line naming it; an unknown model is OpenAI's 404; token-id
prompts of any length; tool_choice without tools; the body limit holds for chunked uploads too."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and "\n" not in err["message"]
    return err


def test_token_id_prompt_longer_than_64_tokens(server):
    """A flat token-id list is ONE prompt: its length is bounded by the context, not by the prompts-per-request cap."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100 and len(r.json()["choices"]) == 1
    err = _err(httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 300, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and "300" in err["message"] and "256" in err["message"]
    err = _err(httpx.post(server.url + "/v1/completions", json={"prompt": [[5]] * 65, "max_tokens": 2}), 400)
    assert "65 prompts" in err["message"]
