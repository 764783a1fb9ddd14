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
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from lineside.bench.metrics import RequestRecord, TokenSource
from lineside.bench.prompts import Prompt

__all__ = ["ClientConfig", "TokenSource", "feed", "first_model", "send"]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ClientConfig:
    """Where and what to send; the run's t0 is a `clock` reading, so records share one clock."""

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
    # tokens in a piece of output text (the bundle's or --tokenizer's): counts output when the server sends no usage
    count_tokens: Callable[[str], int] | None = None
    clock: Callable[[], float] = time.perf_counter  # every timestamp (tests inject one)

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
        if p.tools:
            body["tools"] = list(p.tools)
        if p.tool_choice is not None:
            body["tool_choice"] = p.tool_choice
    else:
        body["prompt"] = prompts[0].text if len(prompts) == 1 else [p.text for p in prompts]
    return body


def _tool_call_text(delta: dict) -> str:
    """The generated text of a delta's tool calls: each call's name and argument pieces (what the model wrote)."""
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return ""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            out += [v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str)]
    return "".join(out)


def _chunk_text(choice: dict, chat: bool) -> str:
    """The output a chunk carries. Chat: the answer, or a reasoning model's thinking (`reasoning_content`, vLLM's
    and `serve --reasoning-parser`'s, or `reasoning`, its newer name), and any tool call's name and arguments: all
    of it is generated output, and vLLM's bench counts every chunk with choices toward TTFT and ITL."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        return text + _tool_call_text(delta)
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


@dataclass
class _Streamed:
    """What one streaming call returned besides its chunk times: its usage, if sent, and each choice's text."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    texts: dict[int, str] = field(default_factory=dict)


def _cut_off(done: bool, events: int, finished: set[int], texts: dict[int, str], content_type: str) -> str | None:
    """Why a stream that ended is not a whole answer, or None: an OpenAI stream ends with [DONE] (or, from servers
    that leave it out, with a finish_reason on every choice); a body that just stops was cut off."""
    if done:
        return None
    if not events:
        return (f"the answer was not an SSE stream (Content-Type {content_type or 'none'}, no 'data:' event); "
                "is --url an OpenAI-compatible server that streams?")
    if texts and set(texts) <= finished:
        return None
    return "the stream ended before [DONE] and with no finish_reason: cut off (a server or proxy dropped it)"


async def _stream(client: httpx.AsyncClient, cfg: ClientConfig, prompts: list[Prompt], t0: float,
                  rec: RequestRecord, index_offset: int, headers: dict[str, str] | None = None) -> _Streamed:
    """POST one streaming request; append chunk times to rec; returns its usage (if sent) and choice texts."""
    chat = cfg.endpoint == "chat"
    out = _Streamed()
    done, events, finished = False, 0, set()
    async with client.stream("POST", cfg.base_url.rstrip("/") + ENDPOINTS[cfg.endpoint],
                             json=_payload(cfg, prompts), headers=headers) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {_refused(resp.status_code, body)}")
        async for line in resp.aiter_lines():
            now = cfg.clock() - t0
            if not line.startswith("data:"):
                continue
            events += 1
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error'].get('message', obj['error'])}")
            for choice in obj.get("choices") or ():
                idx = index_offset + int(choice.get("index", 0))
                text = _chunk_text(choice, chat)
                if text:
                    rec.chunk_times.setdefault(idx, []).append(now)
                    out.texts[idx] = out.texts.get(idx, "") + text
                if choice.get("finish_reason"):
                    finished.add(idx)
            u = obj.get("usage")
            if u:
                out.prompt_tokens, out.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
        why = _cut_off(done, events, finished, out.texts, resp.headers.get("content-type", ""))
    if why:
        raise RuntimeError(why)
    return out


def _count_output(rec: RequestRecord, streams: list[_Streamed], count_tokens: Callable[[str], int] | None) -> None:
    """Set rec's per-choice and total output tokens as vLLM's bench counts them: the stream's usage, else the
    generated text's tokens (a chunk may carry several: speculative decoding, a detokenizer holding a partial
    character back), else one per chunk. A list prompt's usage is the request's total, so its choices are
    counted from their text when a tokenizer is known."""
    texts = {i: t for s in streams for i, t in s.texts.items()}
    chunks = {i: len(t) for i, t in rec.chunk_times.items()}
    if count_tokens is not None and streams:  # a failed request's texts are not kept: its chunks are counted
        per_choice, source = {i: max(1, count_tokens(texts.get(i, ""))) for i in chunks}, TokenSource.TOKENIZER
    else:
        per_choice, source = chunks, TokenSource.CHUNKS
    usage = [s.completion_tokens for s in streams]
    if streams and all(u is not None for u in usage):
        source = TokenSource.USAGE
        if len(streams) > 1:  # chat: one call per prompt, each with its own usage
            per_choice = {i: int(u) for i, u in enumerate(usage) if i in chunks}
        elif len(chunks) == 1:
            per_choice = {i: int(usage[0]) for i in chunks}
        rec.output_tokens = int(sum(usage)) if len(streams) > 1 else int(usage[0])
    else:
        rec.output_tokens = sum(per_choice.values())
    rec.choice_tokens, rec.token_source = per_choice, source


async def send(client: httpx.AsyncClient, cfg: ClientConfig, prompts: list[Prompt], t0: float) -> RequestRecord:
    """Send one request carrying `prompts`; never raises for a server or network failure (recorded instead)."""
    groups = [[p] for p in prompts] if cfg.endpoint == "chat" else [prompts]
    sessions = [f"bench-{uuid.uuid4().hex[:16]}" for _ in groups] if cfg.chunks else []
    fed: list = []
    if sessions:  # each prompt arrives in chunks first; the record starts at its completion
        fed = await asyncio.gather(*(feed(client, cfg, g[0], sid) for g, sid in zip(groups, sessions, strict=True)),
                                   return_exceptions=True)
    rec = RequestRecord(start=cfg.clock() - t0, end=0.0, prompts=len(prompts))
    failed = [e for e in fed if isinstance(e, BaseException)]
    if failed:
        outcomes: list = failed
    else:
        outcomes = await asyncio.gather(*(_stream(client, cfg, g, t0, rec, i,
                                                  {"X-Session-Id": sessions[i]} if sessions else None)
                                          for i, g in enumerate(groups)), return_exceptions=True)
    errors = [e for e in outcomes if isinstance(e, BaseException)]
    streams: list[_Streamed] = [] if errors else list(outcomes)
    if errors:
        e = errors[0]
        if isinstance(e, asyncio.CancelledError):
            raise e
        if isinstance(e, httpx.TimeoutException):
            rec.error = f"{type(e).__name__}: nothing received for {cfg.timeout:g}s (--timeout)"
        else:
            rec.error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    rec.end = cfg.clock() - t0
    _count_output(rec, streams, cfg.count_tokens)
    prompt_usage = [s.prompt_tokens for s in streams if s.prompt_tokens is not None]
    counted = [p.tokens for p in prompts]
    rec.prompt_tokens = (sum(prompt_usage) if prompt_usage else
                         None if None in counted else sum(t for t in counted if t is not None))
    return rec


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id that GET /v1/models lists (what to put in requests when --model is not given)."""
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    return data[0]["id"] if data else ""
