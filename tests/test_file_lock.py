"""lineside.file_lock: an exclusive flock is seen as busy from another open file, and a platform without fcntl
runs unguarded instead of failing to import."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lineside import file_lock
from lineside.file_lock import LockState, lock_exclusive


def test_second_holder_sees_busy_until_the_first_closes(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"")
    a, b = os.open(p, os.O_RDONLY), os.open(p, os.O_RDONLY)
    try:
        assert lock_exclusive(a, wait=False) == LockState.HELD
        assert lock_exclusive(b, wait=False) == LockState.BUSY
        os.close(a)
        a = -1
        assert lock_exclusive(b, wait=True) == LockState.HELD
    finally:
        for fd in (a, b):
            if fd >= 0:
                os.close(fd)


def test_directory_lock(tmp_path: Path) -> None:
    a = os.open(tmp_path, os.O_RDONLY)
    b = os.open(tmp_path, os.O_RDONLY)
    try:
        assert lock_exclusive(a, wait=False) == LockState.HELD
        assert lock_exclusive(b, wait=False) == LockState.BUSY
    finally:
        os.close(a)
        os.close(b)


def test_without_fcntl_nothing_is_guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_lock, "fcntl", None)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert lock_exclusive(fd, wait=False) == LockState.UNSUPPORTED
        assert lock_exclusive(fd, wait=True) == LockState.UNSUPPORTED
    finally:
        os.close(fd)
