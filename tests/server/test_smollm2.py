"""Real text through the server (SmolLM2-135M-Instruct W4A16, skipped when not installed): the chat template,
a factual answer, stop sequences on words, and multi-byte UTF-8 streamed without broken characters."""

from __future__ import annotations

import openai
import pytest

from lineside.runtime.generate import Generator
from tests.server.conftest import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smol_bundle):
    from lineside.runtime.engine import LLMEngine

    bundle = smol_bundle

    # Prefix reuse is off: on SmolLM2 W4A16 a reused prefix changes near-tie greedy picks (a runtime
    # matter, reported); here the comparisons between requests must hold exactly.
    engine = LLMEngine(bundle, backend="onnxruntime", num_slots=2, threads=1, prefix_cache=False)
    with running_server(engine) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        srv.bundle = bundle
        yield srv


def test_chat_answers_and_matches_generator(smol):
    q = "What is the capital of France? Answer in one word."
    r = smol.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                            max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content
    ref = Generator(smol.bundle, threads=1).generate(q, max_tokens=12, chat=True)
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == ref.prompt_tokens


def test_stop_on_a_word(smol):
    kw = dict(model="smollm2", prompt="The days of the week are Monday, Tuesday,", max_tokens=30, temperature=0)
    full = smol.client.completions.create(**kw).choices[0].text
    assert "Thursday" in full
    r = smol.client.completions.create(stop=["Thursday"], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index("Thursday")]
    streamed = "".join(c.choices[0].text for c in smol.client.completions.create(stop="Thursday", stream=True, **kw))
    assert streamed == r.choices[0].text


def test_utf8_streamed_whole(smol):
    msgs = [{"role": "user", "content": "Write the word 'café' and a smiley emoji 😀 three times."}]
    whole = smol.client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in smol.client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=40, temperature=0, stream=True) if c.choices]
    text = "".join(pieces)
    assert text == whole.choices[0].message.content
    assert "\ufffd" not in text and all("\ufffd" not in p for p in pieces)
    assert any(ord(ch) > 127 for ch in text), text  # the model did write non-ASCII characters
