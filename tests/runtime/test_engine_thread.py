"""The engine's step thread and its lifecycle: stop, close and the wake-ups between them, on the fake backend.
Interleavings are forced (a hook holds the step thread at a chosen point), never waited for."""

from __future__ import annotations

import asyncio
import threading
import time

from lineside.runtime.engine import LLMEngine
from lineside.runtime.request import EngineDraining, GenerationRequest
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


def decoding(batch) -> bool:
    return int(batch.new_lengths.max()) == 1


def test_close_without_stop_finishes_what_is_in_flight_and_refuses_more(tiny_bundle):
    """close() (not stop) with a request in flight: the step thread ran the step it was in, saw _exit and left,
    and the request never got a final event (its stream waited forever); a request submitted after close was
    queued for a thread that was gone and waited forever too."""

    async def main():
        eng, be = engine(tiny_bundle)
        await eng.start()
        be.pause(decoding)  # the request's first decode step waits: close meets a step in flight
        h = eng.submit(GenerationRequest(prompt_ids=[1, 5, 6], max_tokens=50))
        await be.until_paused()
        thread = eng._thread
        closing = asyncio.ensure_future(asyncio.to_thread(eng.close))
        while not eng._exit:  # close has asked the thread to exit; it now waits for the step to end
            await asyncio.sleep(0)
        be.resume()
        await closing
        await asyncio.to_thread(thread.join)  # the step thread is gone; what it posted has been delivered
        refused = None
        try:
            eng.submit(GenerationRequest(prompt_ids=[1, 7], max_tokens=2))
        except EngineDraining as e:
            refused = e
        return h.finish_reason, refused

    reason, refused = run(main())
    assert reason == "cancelled"
    assert refused is not None
