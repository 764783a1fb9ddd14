"""What the official ``openai`` client sends, checked against what OpenAI (and vLLM, where OpenAI is silent) do
with it: roles, content parts, and the client's own helpers over a served tiny bundle."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_a_developer_message_is_a_system_message(client):
    """OpenAI's newer models take their instructions as ``developer`` messages; the model's template knows only
    ``system`` (the tiny one writes any role it is given)."""
    def ask(role):
        return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Which station?"}])

    developer, system = ask("developer"), ask("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content
