"""Long prompts are tokenized in a worker process: the tokenizers library holds the GIL for most of an
encode (measured on SmolLM2's vocabulary: a 1.3 M-character prompt kept every other thread waiting up to
8 s at a time in a thread), so in a thread a long prompt still stalls /health and every stream. Short texts
stay inline (a process round trip costs more than they do). The pool is bounded (``processes`` workers);
the server warms it up once the model is ready. The worker runs at a lower CPU priority (nice +5): on a
machine with few cores its tokenizing must not take time from the engine's step loop (measured with
benchmarks/hostile_prompt.py: a worker busy for seconds delayed a concurrent chat by 0.6 s at nice 0, 0.1-0.2 s
at nice 10), yet not starve behind other processes (at nice 10 on a machine at load 15 a 60 ms refusal took
2.4 s, at nice 5 0.8 s). With an early stop at the context (runtime/bounded_encode) its work is small."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("lineside.server")

INLINE_CHARS = 8192
# What a message costs a chat template beyond its text, in characters: some templates rescan the conversation per
# turn, so thousands of empty messages render as slowly as a long text and must leave the event loop as one does.
MESSAGE_CHARS = 64


def chat_work_size(messages: list[dict[str, Any]]) -> int:
    """A conversation's rendering and tokenizing work in characters: its texts plus MESSAGE_CHARS a message."""
    return sum(len(str(m.get("content") or "")) + MESSAGE_CHARS for m in messages)
NICENESS_ENV = "LINESIDE_TOKENIZER_NICENESS"  # how far the worker lowers its priority (0: not at all)
WORKER_NICENESS = 5


def worker_niceness() -> int:
    """The worker's nice increment: LINESIDE_TOKENIZER_NICENESS (0-19) or 5."""
    try:
        return min(max(int(os.environ.get(NICENESS_ENV, WORKER_NICENESS)), 0), 19)
    except ValueError:
        return WORKER_NICENESS
_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any, niceness: int = WORKER_NICENESS) -> None:
    """The worker ignores Ctrl-C and SIGTERM (sent to the whole group): the server shuts the pool down itself;
    it lowers its own priority (lowering needs no privilege; the server's is untouched)."""
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if niceness > 0:
        try:
            os.nice(niceness)
        except OSError:  # a platform without nice: same priority as the server, still off its GIL
            pass
    _worker_tokenizer = tokenizer


def _encode(text: str, add_special: bool | None, max_tokens: int | None = None) -> list[int]:
    return _worker_tokenizer.encode(text, add_special, max_tokens)


def _warm() -> int:
    """Load what the first long prompt needs (the piecewise-count check, the chat template); the worker's nice."""
    _worker_tokenizer.encode("warm up", False, 1 << 20)
    _worker_tokenizer.warm_count_plan()
    try:
        _worker_tokenizer.encode_chat([{"role": "user", "content": "warm up"}], max_tokens=1 << 20)
    except Exception:  # noqa: BLE001 - a template that refuses this chat says so on a real request, in one line
        pass
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def _encode_chat(messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
    return _worker_tokenizer.encode_chat(messages, **options)


def _stable_text(text: str) -> list[int]:
    return _worker_tokenizer.stable_text_ids(text)


def _stable_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 options: dict[str, Any] | None = None) -> list[int]:
    return _worker_tokenizer.stable_chat_ids(messages, tools, **(options or {}))


class PooledTokenizer:
    """The engine's tokenizer for the server's encodes; long ones go to the worker process, anything else
    (decode, ids, the chat template) is the tokenizer's own."""

    def __init__(self, tokenizer: Any, processes: int = 1, inline_chars: int = INLINE_CHARS,
                 niceness: int | None = None):
        self._inner = tokenizer
        self.processes = processes
        self.inline_chars = inline_chars
        self.niceness = worker_niceness() if niceness is None else niceness
        self.worker_priority: int | None = None  # the worker's nice value once warm (what `warm` measured)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, add_special: bool | None = None, max_tokens: int | None = None) -> list[int]:
        if len(text) <= self.inline_chars or self.processes < 1:
            return self._inner.encode(text, add_special, max_tokens)
        return self._run(_encode, (text, add_special, max_tokens),
                         lambda: self._inner.encode(text, add_special, max_tokens))

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None, *, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None, template_limits: Any = None) -> list[int]:
        options: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                   "continue_final_message": continue_final_message, "max_tokens": max_tokens}
        if tools:
            options["tools"] = tools
        if chat_template:
            options["chat_template"] = chat_template
        if template_kwargs:
            options["template_kwargs"] = template_kwargs
        if template_limits is not None:
            options["template_limits"] = template_limits
        if chat_work_size(messages) <= self.inline_chars or self.processes < 1:
            return self._inner.encode_chat(messages, **options)
        return self._run(_encode_chat, (messages, options), lambda: self._inner.encode_chat(messages, **options))

    def stable_text_ids(self, text: str) -> list[int]:
        """A prefill session's stable prefix of a completions prompt (runtime/tokenizer.py), off the GIL when long."""
        if len(text) <= self.inline_chars or self.processes < 1:
            return self._inner.stable_text_ids(text)
        return self._run(_stable_text, (text,), lambda: self._inner.stable_text_ids(text))

    def stable_chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                        chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                        template_limits: Any = None) -> list[int]:
        options = {k: v for k, v in (("chat_template", chat_template), ("template_kwargs", template_kwargs),
                                     ("template_limits", template_limits)) if v}
        if chat_work_size(messages) <= self.inline_chars or self.processes < 1:
            return self._inner.stable_chat_ids(messages, tools, **options)
        return self._run(_stable_chat, (messages, tools, options),
                         lambda: self._inner.stable_chat_ids(messages, tools, **options))

    def warm(self) -> None:
        """Start the worker and load the tokenizer there now (a spawn and an import: about a second); without
        workers, build what counting a long prompt needs here instead."""
        if self.processes < 1:
            warm_plan = getattr(self._inner, "warm_count_plan", None)
            if warm_plan is not None:
                warm_plan()
            return
        if self.processes > 0:
            try:
                self.worker_priority = self._ensure_pool().submit(_warm).result()
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
                                                 initializer=_init_worker, initargs=(self._inner, self.niceness))
            return self._pool

    def close(self) -> None:
        """Stop the worker, waiting for the encode it may be in (bounded: an early stop at the context). Not
        waiting left the executor's wake-up pipe to Python's exit hook, which sometimes printed an EBADF
        traceback as the server exited."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
