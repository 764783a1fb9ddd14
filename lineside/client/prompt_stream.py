"""PromptStream: send a prompt while it is still being written (OCR pages, speech, a form), then ask for the answer.

Each ``feed`` sends the whole prompt so far to ``POST /v1/prefill`` under one session id; the server computes
the KV of its stable prefix in idle capacity and answers at once. ``complete`` is then an ordinary completion
naming the session, so the server only computes the part it has not seen yet. Leaving the ``with`` block
without completing deletes the session (its memory is free for others at once).

    with PromptStream("http://127.0.0.1:8000", "smollm2-w4a16", "page-scan-17") as s:
        for page in pages:
            s.feed(page)
        for text in s.complete(stream=True, max_tokens=200):
            print(text, end="")
"""

from __future__ import annotations

import codecs
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx


class PromptStream:
    """One prompt fed in chunks into one prefill session; ``chat=True`` grows the last user message of
    ``messages`` (earlier turns) instead of a completions prompt."""

    def __init__(self, url: str, model: str | None = None, session_id: str | None = None, *, chat: bool = False,
                 messages: list[dict[str, Any]] | None = None, api_key: str | None = None, timeout: float = 60.0,
                 headers: dict[str, str] | None = None, client: httpx.Client | None = None):
        self.model = model
        self.session_id = session_id or f"ps-{uuid.uuid4().hex}"
        self.chat = chat or messages is not None
        self.history = list(messages or [])
        self.text = ""
        self.last: dict[str, Any] | None = None  # the last prefill answer: cached / pending tokens
        self.completed = False
        hdrs = {"X-Session-Id": self.session_id, **(headers or {})}
        if api_key:
            hdrs["Authorization"] = f"Bearer {api_key}"
        self._own = client is None
        # the server's root, also when given as an OpenAI client's base_url (".../v1"), as `bench --url` takes it
        root = url.rstrip("/").removesuffix("/v1")
        self._http = client or httpx.Client(base_url=root, timeout=timeout)
        self._headers = hdrs
        self._utf8 = codecs.getincrementaldecoder("utf-8")()  # bytes may split a character between chunks

    # ---- feeding ---------------------------------------------------------------------------------------
    def feed(self, chunk: str | bytes) -> dict[str, Any]:
        """Append ``chunk`` (text, or UTF-8 bytes that may end inside a character) and send the prompt so far."""
        if isinstance(chunk, (bytes, bytearray)):
            try:
                piece = self._utf8.decode(chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"feed: the bytes are not UTF-8 ({e.reason}); feed text, or the prompt's UTF-8 "
                                 "bytes") from None
        else:
            piece = chunk
        return self._send(self.text + piece)

    def update(self, text: str) -> dict[str, Any]:
        """Replace the prompt so far (a later chunk rewrote earlier text): the server keeps the KV up to the first
        token that differs. A character's first bytes fed before are dropped with the text they would have ended."""
        self._utf8.reset()
        return self._send(text)

    def _send(self, text: str) -> dict[str, Any]:
        self.text = text
        r = self._http.post("/v1/prefill", json={**self._prompt(), "session_id": self.session_id},
                            headers=self._headers)
        self._check(r)
        self.last = r.json()
        return self.last

    # ---- the answer ----------------------------------------------------------------------------------------
    def complete(self, stream: bool = False, *, keep: bool = False, **params: Any) -> Any:
        """The completion of the whole prompt (bytes fed must not end inside a character: ValueError). ``keep``:
        the session keeps this prompt's KV for a next turn. Returns the response body, or with ``stream`` an
        iterator of text pieces."""
        pending = self._utf8.getstate()[0]
        if pending:  # a character's first bytes with nothing after them: not text the server could read
            raise ValueError(f"complete: the bytes fed end inside a UTF-8 character ({pending!r} is its start); "
                             "feed the rest of the character first")
        body = {**self._prompt(), **params, "stream": stream}
        if keep:
            body["keep_session"] = True
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        self.completed = True
        if not stream:
            r = self._http.post(path, json=body, headers=self._headers)
            self._check(r)
            return r.json()
        return self._stream(path, body)

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        with self._http.stream("POST", path, json=body, headers=self._headers) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "stream failed"))
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                    if text:
                        yield text

    def close(self) -> None:
        """Delete the session unless a completion used it; close the connection pool if this stream made it."""
        try:
            if not self.completed:
                r = self._http.delete(f"/v1/prefill/{self.session_id}", headers=self._headers)
                if r.status_code not in (200, 404):
                    self._check(r)
        finally:
            if self._own:
                self._http.close()

    def __enter__(self) -> PromptStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers --------------------------------------------------------------------------------------------
    def _prompt(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model} if self.model else {}
        if self.chat:
            body["messages"] = [*self.history, {"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        return body

    @staticmethod
    def _check(r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        try:
            message = r.json()["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape: show the status line
            message = r.text[:200]
        raise RuntimeError(f"{r.request.method} {r.request.url.path} answered {r.status_code}: {message}")
