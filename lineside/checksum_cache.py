"""Bundle files already found to match their sha256, so opening a bundle again hashes only what changed.

An entry keeps what the kernel reports about the file (device, inode, size, mtime and ctime in ns) when
its digest matched the manifest's; ctime changes on every write or metadata change and cannot be set back
from user space, so a file rewritten since — even with its mtime restored — is hashed again, as is any
file whose manifest digest changed. Kept as ``.lineside-verified.json`` in the bundle directory (not one of
the manifest's files); a directory that can't be written to hashes every time. ``LINESIDE_VERIFY_CACHE=0``
turns it off.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

NAME = ".lineside-verified.json"
ENV_DISABLE = "LINESIDE_VERIFY_CACHE"


def _stamp(st: os.stat_result, sha256: str) -> list[int | str]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256]


class ChecksumCache:
    """The verified stamps of one bundle directory; ``save`` writes them back if any were added."""

    def __init__(self, root: Path):
        self.root = root
        self.enabled = os.environ.get(ENV_DISABLE, "1") != "0"
        self._stamps: dict[str, list[int | str]] = {}
        self._dirty = False
        if self.enabled:
            try:
                data = json.loads((root / NAME).read_text())
                if isinstance(data, dict):
                    self._stamps = {k: v for k, v in data.items() if isinstance(v, list)}
            except (OSError, ValueError):
                pass

    def known_good(self, rel: str, st: os.stat_result, sha256: str) -> bool:
        return self.enabled and self._stamps.get(rel) == _stamp(st, sha256)

    def add(self, rel: str, st: os.stat_result, sha256: str) -> None:
        if self.enabled:
            self._stamps[rel] = _stamp(st, sha256)
            self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=".lineside-verified.", suffix=".tmp", dir=self.root)
            with os.fdopen(fd, "w") as f:
                json.dump(self._stamps, f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.root / NAME)
        except OSError:  # a read-only bundle is hashed on every open
            try:
                os.unlink(tmp)
            except (OSError, UnboundLocalError):
                pass
        self._dirty = False
