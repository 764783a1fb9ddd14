"""A reentrant lock granted in the order it was asked for (a ticket lock).

The engine's step thread takes its state lock once a step and lets go of it only while the backend runs. With
``threading.RLock`` a thread that releases and takes it again at once is usually served before one that has
been waiting (the waiter must first be woken and get the GIL): against a backend that keeps the GIL while it
runs, an event-loop call (submit, stats) could wait for many steps. Here each ``acquire`` takes a ticket and
tickets are served in order, so a waiting caller gets the lock before the step thread's next step.
"""

from __future__ import annotations

import threading
from types import TracebackType


class FairLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._owner: int | None = None
        self._depth = 0
        self._abandoned: set[int] = set()  # tickets whose waiter gave up (its wait raised): skipped when due

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:  # reentrant: the holder calls another locked method
                self._depth += 1
                return
            ticket = self._next_ticket
            self._next_ticket += 1
            try:
                while ticket != self._serving:
                    self._cond.wait()
            except BaseException:  # e.g. KeyboardInterrupt in the main thread: give the ticket up, or nobody gets the lock
                self._abandoned.add(ticket)
                if self._owner is None:
                    self._pass_on()
                raise
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._pass_on()

    def _pass_on(self) -> None:
        """(Holding ``_cond``, the lock free) skip the tickets given up and wake the waiters."""
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
