"""Advisory locks (``flock``) on an open file or directory, where the platform and filesystem have them.

The kernel drops a process's locks when it dies, SIGKILL included, so a lock tells "a live process is writing this"
from "an interrupted run left this". Without ``fcntl`` (not POSIX) or on a filesystem without locks (some network
mounts) a command runs unguarded, as it did before the locks: that is ``LockState.UNSUPPORTED``.
"""

from __future__ import annotations

import enum

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks
    fcntl = None  # type: ignore[assignment]


class LockState(enum.Enum):
    HELD = "held"  # this process holds it now
    BUSY = "busy"  # another process holds it (only without ``wait``)
    UNSUPPORTED = "unsupported"  # no locks here: nothing is guarded


def lock_exclusive(fd: int, *, wait: bool) -> LockState:
    """Take an exclusive lock on ``fd`` (released when it is closed); ``wait``: block until it is free."""
    if fcntl is None:
        return LockState.UNSUPPORTED
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return LockState.BUSY
    except OSError:
        return LockState.UNSUPPORTED
    return LockState.HELD
