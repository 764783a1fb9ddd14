"""Async streaming client for an OpenAI-compatible server; times every SSE chunk of every choice.

/v1/completions takes a request's prompts as one list `prompt` (one choice each). Chat has no list
form, so a request carrying k prompts to /v1/chat/completions is k concurrent chat calls recorded
as one request with k choices. With ``chunks`` (pattern chunked) a prompt is first fed to POST /v1/prefill
in that many growing pieces, ``chunk_interval`` seconds apart, under its own session id; the request's record
starts when the completion is sent, so its TTFT is the time to first token after the last chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

import httpx

from lineside.bench.metrics import RequestRecord
from lineside.bench.prompts import Prompt

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ClientConfig:
    """Where and what to send; t0 is the run's perf_counter origin so records share one clock."""

    base_url: str
    endpoint: str = "completions"
    model: str = ""
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout: float = 60.0
    chunks: int = 0  # > 0: feed each prompt to /v1/prefill in this many pieces first
    chunk_interval: float = 1.0  # seconds between two pieces (the pace the prompt "arrives" at)
    api_key: str = ""  # sent as 'Authorization: Bearer <key>' (a server run with `serve --api-key`)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


KEY_HINT = "pass the server's key with --api-key (or LINESIDE_API_KEY / OPENAI_API_KEY)"


def _refused(status: int, body: str) -> str:
    """One line for an error answer: its OpenAI message (else the body's start), and on a 401 what to do."""
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body[:200]
    return f"{msg}; {KEY_HINT}" if status == 401 else str(msg)


def _payload(cfg: ClientConfig, prompts: list[Prompt]) -> dict:
    body: dict = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": prompts[0].max_tokens or cfg.max_tokens, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        p = prompts[0]
        body["messages"] = list(p.messages) or [{"role": "user", "content": p.text}]
    else:
        body["prompt"] = prompts[0].text if len(prompts) == 1 else [p.text for p in prompts]
    return body


def _chunk_text(choice: dict, chat: bool) -> str:
    """The output a chunk carries. Chat: the answer, or a reasoning model's thinking (`reasoning_content`, vLLM's
    and `serve --reasoning-parser`'s, or `reasoning`, its newer name): thinking is generated output, and vLLM's
    bench counts it toward TTFT and ITL too."""
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choice.get("text") or ""


def _grown(cfg: ClientConfig, prompt: Prompt, text: str) -> dict:
    """The body of a prefill call carrying ``text``, the prompt so far (chat: the last message so far)."""
    if cfg.endpoint != "chat":
        return {"model": cfg.model, "prompt": text}
    messages = list(prompt.messages) or [{"role": "user", "content": prompt.text}]
    return {"model": cfg.model, "messages": [*messages[:-1], {**messages[-1], "content": text}]}


async def feed(client: httpx.AsyncClient, cfg: ClientConfig, prompt: Prompt, session_id: str) -> None:
    """Send ``prompt`` to /v1/prefill in ``cfg.chunks`` growing pieces, ``cfg.chunk_interval`` s apart."""
    # chat grows the last message; completions send prompt.text (every message joined), so that is what grows
    messages = list(prompt.messages) if cfg.endpoint == "chat" else []
    whole = str(messages[-1].get("content") or "") if messages else prompt.text
    cuts = [round(len(whole) * (i + 1) / cfg.chunks) for i in range(cfg.chunks)]
    for i, cut in enumerate(cuts):
        if i:
            await asyncio.sleep(cfg.chunk_interval)
        resp = await client.post(cfg.base_url.rstrip("/") + "/v1/prefill",
                                 json={**_grown(cfg, prompt, whole[:cut]), "session_id": session_id})
        if resp.status_code != 202:
            raise RuntimeError(f"prefill HTTP {resp.status_code}: {_refused(resp.status_code, resp.text)}")


async def _stream(client: httpx.AsyncClient, cfg: ClientConfig, prompts: list[Prompt], t0: float,
                  rec: RequestRecord, index_offset: int,
                  headers: dict[str, str] | None = None) -> tuple[int | None, int | None]:
    """POST one streaming request; append chunk times to rec; returns (prompt, completion) usage if sent."""
    chat = cfg.endpoint == "chat"
    usage = (None, None)
    async with client.stream("POST", cfg.base_url.rstrip("/") + ENDPOINTS[cfg.endpoint],
                             json=_payload(cfg, prompts), headers=headers) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {_refused(resp.status_code, body)}")
        async for line in resp.aiter_lines():
            now = time.perf_counter() - t0
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error'].get('message', obj['error'])}")
            for choice in obj.get("choices") or ():
                if _chunk_text(choice, chat):
                    rec.chunk_times.setdefault(index_offset + int(choice.get("index", 0)), []).append(now)
            u = obj.get("usage")
            if u:
                usage = (u.get("prompt_tokens"), u.get("completion_tokens"))
    return usage


async def send(client: httpx.AsyncClient, cfg: ClientConfig, prompts: list[Prompt], t0: float) -> RequestRecord:
    """Send one request carrying `prompts`; never raises for a server or network failure (recorded instead)."""
    groups = [[p] for p in prompts] if cfg.endpoint == "chat" else [prompts]
    sessions = [f"bench-{uuid.uuid4().hex[:16]}" for _ in groups] if cfg.chunks else []
    fed: list = []
    if sessions:  # each prompt arrives in chunks first; the record starts at its completion
        fed = await asyncio.gather(*(feed(client, cfg, g[0], sid) for g, sid in zip(groups, sessions, strict=True)),
                                   return_exceptions=True)
    rec = RequestRecord(start=time.perf_counter() - t0, end=0.0, prompts=len(prompts))
    failed = [e for e in fed if isinstance(e, BaseException)]
    if failed:
        outcomes: list = failed
    else:
        outcomes = await asyncio.gather(*(_stream(client, cfg, g, t0, rec, i,
                                                  {"X-Session-Id": sessions[i]} if sessions else None)
                                          for i, g in enumerate(groups)), return_exceptions=True)
    errors = [e for e in outcomes if isinstance(e, BaseException)]
    results = [] if errors else list(outcomes)
    if errors:
        e = errors[0]
        if isinstance(e, asyncio.CancelledError):
            raise e
        if isinstance(e, httpx.TimeoutException):
            rec.error = f"{type(e).__name__}: nothing received for {cfg.timeout:g}s (--timeout)"
        else:
            rec.error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter() - t0
    rec.choice_tokens = {i: len(t) for i, t in rec.chunk_times.items()}
    completion = [c for _, c in results]
    if len(groups) == len(completion) == len(rec.chunk_times) and all(c is not None for c in completion):
        # one choice per stream: the server's own token counts replace chunk counts
        for i, c in enumerate(completion):
            if i in rec.choice_tokens:
                rec.choice_tokens[i] = int(c)
    rec.output_tokens = sum(rec.choice_tokens.values())
    if len(groups) == 1 and completion and completion[0] is not None:
        rec.output_tokens = int(completion[0])  # completions with a list prompt: usage is the total
    prompt_usage = [p for p, _ in results if p is not None]
    rec.prompt_tokens = sum(prompt_usage) if prompt_usage else sum(p.tokens for p in prompts)
    return rec


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id that GET /v1/models lists (what to put in requests when --model is not given)."""
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    return data[0]["id"] if data else ""
