"""The engine's step thread and its lifecycle: stop, close and the wake-ups between them, on the fake backend.
Interleavings are forced (a hook holds the step thread at a chosen point), never waited for."""

from __future__ import annotations

import asyncio
import threading
import time

from lineside.runtime.engine import LLMEngine
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend


def engine(bundle, slots=1, **kw) -> tuple[LLMEngine, FakeBackend]:
    be = FakeBackend(slots)
    return LLMEngine(bundle, backend=be, clock=time.monotonic, **kw), be


class HeldWake(threading.Event):
    """The engine's wake-up event, with a hook: ``hold()`` makes the step thread's next ``clear`` wait (before it
    clears) until ``go``; a ``wait`` entered after ``stop``/``close`` asked the thread to exit, with no wake-up
    left to end it, is recorded in ``lost`` (and returns at once, so the test itself never hangs)."""

    def __init__(self, eng: LLMEngine):
        super().__init__()
        self.eng = eng
        self.reached, self.go = threading.Event(), threading.Event()
        self._held = False
        self.lost = False

    def hold(self) -> None:
        self._held = True

    def clear(self) -> None:
        if self._held and threading.current_thread().name == "lineside-step":
            self._held = False
            self.reached.set()
            self.go.wait(30)
        super().clear()

    def wait(self, timeout: float | None = None) -> bool:
        if self.eng._exit and not self.is_set():
            self.lost = True
            return True
        return super().wait(timeout)


async def _until(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0)


def test_stop_is_not_lost_between_the_exit_check_and_the_wake_clear(tiny_bundle):
    """stop sets ``_exit`` and kicks the step thread; if that lands after the thread read ``_exit`` and before it
    cleared the wake-up, the kick was erased and the thread idled for good: stop's join never returned."""

    async def main():
        eng, _ = engine(tiny_bundle)
        wake = eng._wake = HeldWake(eng)
        await eng.start()
        wake.hold()
        eng._kick()  # the idle thread goes round once more and stops in clear()
        await _until(wake.reached)
        stopping = asyncio.ensure_future(eng.stop(drain_timeout=0))
        await asyncio.sleep(0)  # stop has run up to its join: _exit is set and the thread kicked
        assert eng._exit
        wake.go.set()
        await stopping
        return wake.lost

    assert run(main()) is False
