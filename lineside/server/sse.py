"""Server-sent events exactly as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]` last.

Chat: the first chunk of each choice carries the role, content chunks follow, the last chunk has an
empty delta and the finish_reason; with stream_options.include_usage every chunk has "usage": null
and one extra chunk with no choices carries the usage (with vLLM's continuous_usage_stats, each chunk carries its
choice's usage so far instead of null). Text completions stream `text` per choice.
"""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


# Line breaks to Python's str.splitlines (httpx's iter_lines, requests' iter_lines(decode_unicode=True)) that JSON
# leaves raw: inside a data line they would cut the event in two. Escaped, they decode to the same text.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def dumps(obj: Any) -> str:
    """Compact JSON for one SSE data line: UTF-8 kept as is, but never a character a client splits lines at."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return text if text.isascii() else text.translate(_LINE_BREAKS)


def event(obj: dict[str, Any]) -> str:
    """One SSE event carrying a JSON object (compact, UTF-8 kept as is)."""
    return "data: " + dumps(obj) + "\n\n"


def error_event(message: str, type: str, code: str | None, param: str | None = None) -> str:
    """A mid-stream error (the openai client raises APIError on it), as OpenAI sends one; ``param``: the request
    field at fault (a grammar's), as its 400 before streaming names it."""
    return event({"error": {"message": message, "type": type, "code": code, "param": param}})


class ChunkWriter:
    """Builds the chunks of one streamed response (chat or text completion)."""

    def __init__(self, chat: bool, response_id: str, created: int, *, model: str, include_usage: bool,
                 fingerprint: str | None = None, continuous_usage: bool = False):
        self.chat = chat
        self.base: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                                     "created": created, "model": model, "system_fingerprint": fingerprint}
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage  # vLLM's: only together with include_usage
        # Every chunk of a stream shares its fields but the choice: encoded once, not once per token.
        head = event(self.base)
        self._head = head[:-len("}\n\n")] + ',"choices":['
        self._tail = "]" + (',"usage":null' if include_usage else "") + "}\n\n"
        self._prompt_logprobs_claimed = False

    def claim_prompt_logprobs(self) -> bool:
        """Chat: True the first time only (its prompt_logprobs are the response's, sent once, top-level)."""
        claimed, self._prompt_logprobs_claimed = self._prompt_logprobs_claimed, True
        return not claimed

    def _chunk(self, choice: dict[str, Any]) -> str:
        """The same bytes as ``event({**base, "choices": [choice], "usage": None})``, encoding only the choice."""
        return self._head + dumps(choice) + self._tail

    def role(self, index: int) -> str:
        """Chat only: the first chunk of a choice, announcing the assistant role."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def text(self, index: int, text: str, logprobs: Any = None, prompt_logprobs: list[Any] | None = None) -> str:
        """``logprobs``: the chunk's tokens' logprobs (chat: ``{"content": [...]}``; completions: the block);
        ``prompt_logprobs``: vLLM's, in the choice (completions) or beside the choices (chat), as its bodies have them."""
        if self.chat:
            chunk = self._chunk({"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                 "finish_reason": None})
            if prompt_logprobs is None:
                return chunk
            cut = len(self._head) - len('"choices":[')
            return chunk[:cut] + '"prompt_logprobs":' + dumps(prompt_logprobs) + "," + chunk[cut:]
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return self._chunk(choice)

    def reasoning(self, index: int, text: str, logprobs: Any = None) -> str:
        """Chat only: a piece of a reasoning model's thinking (vLLM's ``reasoning_content``, and ``reasoning``, its
        newer name, both sent while clients move from one to the other)."""
        return self._chunk({"index": index, "delta": {"reasoning_content": text, "reasoning": text},
                            "logprobs": logprobs, "finish_reason": None})

    def tool_calls(self, index: int, deltas: list[dict[str, Any]], logprobs: Any = None) -> str:
        """Chat only: tool-call deltas (the first of a call has id, type and name; later ones arguments)."""
        return self._chunk({"index": index, "delta": {"tool_calls": deltas}, "logprobs": logprobs,
                            "finish_reason": None})

    def finish(self, index: int, reason: str, stop_reason: int | str | None = None) -> str:
        """A choice's last chunk; ``stop_reason``: vLLM's (the stop string or stop token id that ended it)."""
        if self.chat:
            return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                                "stop_reason": stop_reason})
        return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": reason,
                            "stop_reason": stop_reason})

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
              reasoning_tokens: int | None = None) -> str:
        """The usage chunk; ``cached_tokens``: OpenAI's usage.prompt_tokens_details.cached_tokens, ``reasoning_tokens``
        its usage.completion_tokens_details.reasoning_tokens (None: left out)."""
        obj = dict(self.base)
        obj["choices"] = []
        obj["usage"] = _usage(prompt_tokens, completion_tokens)
        if cached_tokens is not None:
            obj["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        if reasoning_tokens is not None:
            obj["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return event(obj)

    def with_usage(self, chunk: str, prompt_tokens: int, completion_tokens: int,
                   reasoning_tokens: int | None = None) -> str:
        """A chunk of this writer's with its ``"usage": null`` filled in (continuous_usage_stats); ``reasoning_tokens``:
        its completion_tokens_details.reasoning_tokens so far (None: left out), as the usage chunk carries them."""
        assert self.include_usage and chunk.endswith(self._tail)
        counts: dict[str, Any] = _usage(prompt_tokens, completion_tokens)
        if reasoning_tokens is not None:
            counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        usage = json.dumps(counts, separators=(",", ":"))
        return chunk[:-len(self._tail)] + '],"usage":' + usage + "}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def parse(body: str) -> list[dict[str, Any] | str]:
    """Split an SSE body back into JSON objects (and the "[DONE]" marker); for tests and the benchmark."""
    out: list[dict[str, Any] | str] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        if not block.startswith("data: "):
            raise ValueError(f"not an SSE data event: {block[:60]!r}")
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
