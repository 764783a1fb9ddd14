"""The engine's state lock: granted in the order it was asked for, reentrant, released only by its holder."""

from __future__ import annotations

import threading

import pytest

from lineside.runtime.fair_lock import FairLock


def _on_wait(lock: FairLock) -> threading.Event:
    """Set when a thread starts waiting for ``lock`` (its ticket taken): the test acts then, without polling."""
    waiting, real_wait = threading.Event(), lock._cond.wait

    def wait(timeout=None):
        waiting.set()
        return real_wait(timeout)

    lock._cond.wait = wait
    return waiting


def test_a_waiting_thread_is_served_before_the_holder_takes_it_again():
    lock, order = FairLock(), []
    lock.acquire()

    def other():
        with lock:
            order.append("waiter")

    waiting = _on_wait(lock)
    t = threading.Thread(target=other)
    t.start()
    assert waiting.wait(10), "the other thread never asked for the lock"
    assert lock._next_ticket == 2  # the waiter holds the next ticket
    lock.release()
    with lock:  # taken again at once, as the step thread does: served after the waiter
        order.append("holder")
    t.join(10)
    assert order == ["waiter", "holder"]


def test_reentrant_and_released_by_its_holder_only():
    lock = FairLock()
    with lock, lock:  # a locked method calling another
        pass
    got = []
    t = threading.Thread(target=lambda: (lock.acquire(), got.append(1), lock.release()))
    t.start()
    t.join(10)
    assert got == [1]  # fully released after the nested holds
    lock.acquire()
    errors = []

    def release_elsewhere():
        try:
            lock.release()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=release_elsewhere)
    t.start()
    t.join(10)
    lock.release()
    assert errors and "does not hold it" in errors[0]
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_waiter_interrupted_while_waiting_does_not_wedge_the_lock():
    """A wait for the lock that raises (KeyboardInterrupt lands in the main thread, the event loop's, while a call
    such as submit or stats waits for the step thread) must give its ticket up: else the lock is never granted
    again and the step thread and every later call wait forever."""
    lock = FairLock()
    lock.acquire()
    real_wait, interrupted = lock._cond.wait, []

    def wait(timeout=None):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(timeout)

    lock._cond.wait = wait
    caught = []

    def interrupted_waiter():
        try:
            lock.acquire()
        except KeyboardInterrupt:
            caught.append(True)

    t = threading.Thread(target=interrupted_waiter)
    t.start()
    t.join(10)
    assert caught == [True]
    got = []
    waiting = _on_wait(lock)
    later = threading.Thread(target=lambda: (lock.acquire(), got.append(1), lock.release()), daemon=True)
    later.start()
    assert waiting.wait(10), "the later thread never asked for the lock"
    assert lock._next_ticket == 3  # the later thread waits (behind the holder and the ticket given up)
    lock.release()
    later.join(10)
    assert got == [1], "the lock was never granted after the interrupted waiter gave up"
