"""One push or rollback at a time per target: an flock on TARGET/.push.lock, held for the whole operation.

Two pushes at once shared the staging directory (one renamed it under the other's copy) and raced on
`current`/`previous`. The lock is a kernel flock, so a push that dies (Ctrl-C, kill -9, a dropped ssh
connection) releases it with its process: nothing stale is left for the operator to remove.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from lineside.errors import LinesideError
from lineside.file_lock import LockState, lock_exclusive
from lineside.jetson.targets import LocalTarget, SshTarget, ssh_failure

LOCK_NAME = ".push.lock"
_BUSY = 75  # flock -E: the lock is held by another push (EX_TEMPFAIL)


def _busy(label: str) -> LinesideError:
    return LinesideError(f"another push or rollback to {label} is running (it holds {LOCK_NAME} there); wait for it "
                         "to finish, then run this again")


@contextmanager
def push_lock(t: LocalTarget | SshTarget, create: bool = True) -> Iterator[None]:
    """Hold TARGET/.push.lock (creating TARGET when ``create``) or refuse in one line if another push holds it."""
    if isinstance(t, LocalTarget):
        with _local_lock(t, create):
            yield
    else:
        with _ssh_lock(t, create):
            yield


@contextmanager
def _local_lock(t: LocalTarget, create: bool) -> Iterator[None]:
    if not t.root.is_dir() and not create:
        yield  # nothing there to roll back; the caller says so
        return
    if t.root.exists() and not t.root.is_dir():
        raise LinesideError(f"{t.root} is not a directory; pass a directory (or user@host:/dir) as TARGET")
    t.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(t.root / LOCK_NAME, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        # a filesystem without locks (some network mounts) is pushed to unlocked, as a device without flock is
        if lock_exclusive(fd, wait=False) is LockState.BUSY:
            raise _busy(t.label)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def _ssh_lock(t: SshTarget, create: bool) -> Iterator[None]:
    """A remote `flock` held by a shell that waits on our stdin: it ends (and the lock goes) when this process
    closes it or dies. A device without flock (util-linux) is pushed to unlocked, as before."""
    q = shlex.quote(t.root)
    enter = f"mkdir -p -- {q} || exit 1; cd {q} || exit 1; " if create else f"cd {q} 2>/dev/null || {{ echo none; exit 0; }}; "
    script = (f"{enter}exec 9>>{LOCK_NAME} || exit 1; if command -v flock >/dev/null 2>&1; then "
              f"flock -n -E {_BUSY} 9 || exit $?; fi; echo locked; exec cat >/dev/null")
    try:
        p = subprocess.Popen([*t.ssh, t.host, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise LinesideError(f"{t.ssh[0]} not found; install an ssh client (openssh-client)") from None
    try:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line not in ("locked", "none"):
            _, err = p.communicate(timeout=60)
            if p.returncode == _BUSY:
                raise _busy(t.label)
            if p.returncode == 255:
                raise LinesideError(ssh_failure(t.host, err, t.login))
            last = (err.strip().splitlines() or [f"exit {p.returncode}"])[-1]
            raise LinesideError(f"cannot lock {t.label} for the push ({last}); check that the directory can be "
                                "created and written by the ssh user")
        yield
    finally:
        if p.stdin:
            p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
