"""Where a request's own chat template renders (``--trust-request-chat-template``): a few threads of its own, not
asyncio's default pool. Each render may take up to its limits' deadline (runtime/chat_template.TemplateLimits), so
renders on the default pool could hold all of its threads at once, and the work that pool does for every request
(long prompts' tokenization, grammar compilation, /health/gpu, the SLO guard's device readings) would wait behind
them. Here at most ``slots`` render at once and ``waiting`` more wait their turn; beyond that a request is one 429
naming ``chat_template`` (retry shortly), as the engine's full waiting queue is, and counted as such a refusal is
(``on_refused``: lineside_requests_total's ``too_many_template_renders``)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lineside.server.errors import APIError

T = TypeVar("T")

SLOTS = 2  # renders at once: each is pure Python, holding the GIL while it runs, so a few keep the event loop lively
WAITING = 32  # requests that wait for a slot; beyond: 429


class TemplateRenders:
    """A bounded pool for the renders of requests' own templates (one per server)."""

    def __init__(self, slots: int = SLOTS, waiting: int = WAITING, on_refused: Callable[[], None] | None = None):
        if slots < 1 or waiting < 0:
            raise ValueError(f"template render slots {slots} (at least 1) and waiting {waiting} (at least 0)")
        self.slots = slots
        self.waiting = waiting
        self.on_refused = on_refused  # told of each 429 (the server counts it in /metrics)
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="lineside-request-template")
        self._lock = threading.Lock()
        self._admitted = 0  # rendering or waiting for a slot (released when the render ends, not when its caller goes)

    @property
    def admitted(self) -> int:
        return self._admitted

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the render threads (in the caller's context, as asyncio.to_thread runs it); a
        429 when ``slots`` render and ``waiting`` wait already."""
        with self._lock:
            refused = self._admitted >= self.slots + self.waiting
            if not refused:
                self._admitted += 1
        if refused:
            if self.on_refused is not None:
                self.on_refused()
            raise APIError(429, f"too many requests are rendering their own chat_template: {self.slots} at once "
                                f"and {self.waiting} waiting; retry shortly", "too_many_template_renders",
                           param="chat_template", headers={"Retry-After": "1"})
        try:
            future = self._pool.submit(contextvars.copy_context().run, fn, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())  # run, failed, or cancelled before it started
        return await asyncio.wrap_future(future)

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def close(self) -> None:
        """No new renders; a running one ends within its deadline (its thread is not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
