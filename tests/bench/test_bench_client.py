"""The bench client's request bodies, recorded through httpx's MockTransport (no server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lineside.bench.client import ClientConfig, _payload, feed
from lineside.bench.prompts import Prompt


def _fed(cfg: ClientConfig, prompt: Prompt) -> list[dict]:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(202, json={})

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await feed(client, cfg, prompt, "s1")

    asyncio.run(go())
    return bodies


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_chunked_feeding_grows_toward_the_prompt_the_completion_sends(endpoint):
    """--pattern chunked with a --prompts-file line of several messages on /v1/completions fed only the last
    message's text, then completed all of them joined: the prefilled session was not a prefix of the prompt, so
    nothing was reused and TTFT measured a cold prompt."""
    messages = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "which station is hot?"})
    prompt = Prompt(text="be brief\nwhich station is hot?", messages=messages)
    cfg = ClientConfig(base_url="http://x", endpoint=endpoint, model="m", chunks=3, chunk_interval=0.0)
    bodies = _fed(cfg, prompt)
    final = _payload(cfg, [prompt])
    assert len(bodies) == 3
    if endpoint == "chat":
        assert bodies[-1]["messages"] == final["messages"]
        assert all(b["messages"][0] == messages[0] for b in bodies)
    else:
        assert bodies[-1]["prompt"] == final["prompt"]
        assert all(final["prompt"].startswith(b["prompt"]) for b in bodies)
