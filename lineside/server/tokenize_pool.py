"""Long prompts are tokenized in a worker process: the tokenizers library holds the GIL for most of an
encode (measured on SmolLM2's vocabulary: a 1.3 M-character prompt kept every other thread waiting up to
8 s at a time in a thread), so in a thread a long prompt still stalls /health and every stream. Short texts
stay inline (a process round trip costs more than they do). The pool is bounded (``processes`` workers);
the server warms it up once the model is ready."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("lineside.server")

INLINE_CHARS = 8192
_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any) -> None:
    """The worker ignores Ctrl-C and SIGTERM (sent to the whole group): the server shuts the pool down itself."""
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _worker_tokenizer = tokenizer


def _encode(text: str, add_special: bool | None) -> list[int]:
    return _worker_tokenizer.encode(text, add_special)


def _encode_chat(messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
    return _worker_tokenizer.encode_chat(messages, **options)


def _stable_text(text: str) -> list[int]:
    return _worker_tokenizer.stable_text_ids(text)


def _stable_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    return _worker_tokenizer.stable_chat_ids(messages, tools)


class PooledTokenizer:
    """The engine's tokenizer for the server's encodes; long ones go to the worker process, anything else
    (decode, ids, the chat template) is the tokenizer's own."""

    def __init__(self, tokenizer: Any, processes: int = 1, inline_chars: int = INLINE_CHARS):
        self._inner = tokenizer
        self.processes = processes
        self.inline_chars = inline_chars
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, add_special: bool | None = None) -> list[int]:
        if len(text) <= self.inline_chars or self.processes < 1:
            return self._inner.encode(text, add_special)
        return self._run(_encode, (text, add_special), lambda: self._inner.encode(text, add_special))

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        options: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                   "continue_final_message": continue_final_message}
        if tools:
            options["tools"] = tools
        size = sum(len(str(m.get("content") or "")) for m in messages)
        if size <= self.inline_chars or self.processes < 1:
            return self._inner.encode_chat(messages, **options)
        return self._run(_encode_chat, (messages, options), lambda: self._inner.encode_chat(messages, **options))

    def stable_text_ids(self, text: str) -> list[int]:
        """A prefill session's stable prefix of a completions prompt (runtime/tokenizer.py), off the GIL when long."""
        if len(text) <= self.inline_chars or self.processes < 1:
            return self._inner.stable_text_ids(text)
        return self._run(_stable_text, (text,), lambda: self._inner.stable_text_ids(text))

    def stable_chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        size = sum(len(str(m.get("content") or "")) for m in messages)
        if size <= self.inline_chars or self.processes < 1:
            return self._inner.stable_chat_ids(messages, tools)
        return self._run(_stable_chat, (messages, tools), lambda: self._inner.stable_chat_ids(messages, tools))

    def warm(self) -> None:
        """Start the worker and load the tokenizer there now (a spawn and an import: about a second)."""
        if self.processes > 0:
            try:
                self._ensure_pool().submit(_encode, "warm", False).result()
            except Exception as e:  # noqa: BLE001 - no worker is no reason not to serve: fall back to threads
                log.warning("no tokenizer worker process (%s: %s); long prompts are tokenized in threads",
                            type(e).__name__, e)
                self.close()
                self.processes = 0

    def _run(self, fn: Any, args: tuple[Any, ...], fallback: Any) -> list[int]:
        pool = self._ensure_pool()
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:  # a worker died (killed from outside): answer anyway, start a new pool next time
            log.warning("the tokenizer worker process died; tokenizing this prompt in the server process")
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            return fallback()

    def _ensure_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_init_worker, initargs=(self._inner,))
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
