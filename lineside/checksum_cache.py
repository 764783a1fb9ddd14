"""Bundle files already found to match their sha256, so opening a bundle again hashes only what changed.

An entry keeps what the kernel reports about the file (device, inode, size, mtime and ctime in ns) when
its digest matched the manifest's; ctime changes on every write or metadata change and cannot be set back
from user space, so a file rewritten since — even with its mtime restored — is hashed again, as is any
file whose manifest digest changed. Kept as ``.lineside-verified.json`` in the bundle directory (not one of
the manifest's files); a bundle directory that can't be written to keeps it in the per-user cache (user_cache),
named by the bundle's real path and the manifest's sha256, so a copy elsewhere or a new build in its place starts
a record of its own. ``LINESIDE_VERIFY_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from lineside import user_cache

NAME = ".lineside-verified.json"
ENV_DISABLE = "LINESIDE_VERIFY_CACHE"
USER_FOLDER = "verified"  # under the per-user cache directory


def _stamp(st: os.stat_result, sha256: str) -> list[int | str]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256]


class ChecksumCache:
    """The verified stamps of one bundle directory; ``save`` writes them back if any were added."""

    def __init__(self, root: Path, manifest_sha256: str = ""):
        self.root = root
        self.manifest_sha256 = manifest_sha256
        self.enabled = os.environ.get(ENV_DISABLE, "1") != "0"
        self._stamps: dict[str, list[int | str]] = {}
        self._dirty = False
        if self.enabled:
            self._stamps = _read(root / NAME)
            mine = user_cache.folder(USER_FOLDER, make=False) if manifest_sha256 else None
            if mine is not None:  # a read-only bundle's record: its entries count only where they match exactly
                self._stamps.update(_read(mine / self._user_name()))

    def _user_name(self) -> str:
        """This bundle's record in the per-user cache: its real path and manifest, so never another's (a copy
        elsewhere, a new build in its place); the stamps inside still name each file's inode and times."""
        return hashlib.sha256(f"{os.path.realpath(self.root)}\0{self.manifest_sha256}".encode()).hexdigest()[:32] \
            + ".json"

    def known_good(self, rel: str, st: os.stat_result, sha256: str) -> bool:
        return self.enabled and self._stamps.get(rel) == _stamp(st, sha256)

    def add(self, rel: str, st: os.stat_result, sha256: str) -> None:
        if self.enabled:
            self._stamps[rel] = _stamp(st, sha256)
            self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        if _write(self.root, NAME, self._stamps) or not self.manifest_sha256:
            return
        where = user_cache.folder(USER_FOLDER)  # the bundle directory can't be written to
        if where is not None:
            _write(where, self._user_name(), self._stamps)


def _read(path: Path) -> dict[str, list[int | str]]:
    """The stamps in a record; none for a missing, unreadable or malformed one (its files are hashed again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list)} if isinstance(data, dict) else {}


def _write(folder: Path, name: str, stamps: dict[str, list[int | str]]) -> bool:
    """Write a record whole or not at all (another process may read or write it at once); False if it can't be."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".lineside-verified.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(stamps, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / name)
        return True
    except OSError:  # a read-only directory, a full disk
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
