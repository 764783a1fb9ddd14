"""The per-user cache directory: where a bundle that can't be written to keeps what it would keep beside its files.

A bundle on read-only storage (a squashfs image, a read-only NFS or bind mount, another user's files) can't hold
its verification record or onnxruntime's optimized graphs, so without this every start hashes every file and
optimizes every graph again. ``LINESIDE_CACHE_DIR`` names the directory; otherwise ``$XDG_CACHE_HOME/lineside``
(an absolute XDG_CACHE_HOME only, as the XDG spec says) or ``~/.cache/lineside``. What is kept here is keyed by
the bundle's content and checked before use, as beside the bundle; a directory that can't be made is no cache.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

log = logging.getLogger("lineside")

ENV_DIR = "LINESIDE_CACHE_DIR"

_said: set[Path] = set()
_said_lock = threading.Lock()


def root() -> Path | None:
    """The cache directory's path (not created); None when there is no home to put it in."""
    chosen = os.environ.get(ENV_DIR, "").strip()
    if chosen:
        return Path(chosen).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "lineside"
    try:
        return Path.home() / ".cache" / "lineside"
    except RuntimeError:  # no HOME and no passwd entry (a bare container's user)
        return None


def folder(kind: str, make: bool = True) -> Path | None:
    """``root()/kind``, made if missing and ``make`` (only the user can read or write the folders it makes: what
    is kept here is trusted once its key and seal match); None when it is missing and not ``make``, and None, with
    one warning per folder and process, when it can't be made or written, or when every user can write to it."""
    base = root()
    if base is None:
        return None
    path = base / kind
    if not make and not path.is_dir():
        return None
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        if path.stat().st_mode & stat.S_IWOTH:  # anyone could put a record or graph there that this one trusts
            raise PermissionError(1, f"it is writable by every user: `chmod o-w {path}`")
    except OSError as e:
        with _said_lock:
            if path in _said:
                return None
            _said.add(path)
        log.warning("no per-user cache in %s (%s): set %s to a directory only you can write to keep the verification "
                    "record and optimized graphs of read-only bundles", path, e.strerror or type(e).__name__, ENV_DIR)
        return None
    return path
