"""Where POST /v1/load_lora_adapter may read adapters from: the operator's ``--lora-dir`` directories and nothing else.

A client names a path the server reads, so without a bound any file the server's user can read would be opened on a
client's word (``..``, an absolute path, a symlink planted to point out). The check follows symlinks (the directory's
and its two files'), and refuses before anything outside is looked at."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lineside.errors import LinesideError
from lineside.lora import CONFIG_FILE, WEIGHTS_FILE, _short


class AdapterPathRefused(LinesideError):
    """A lora_path outside every --lora-dir (after following symlinks): the client may not have it read."""


@dataclass(frozen=True)
class AdapterDirs:
    """The directories (as given, and with symlinks resolved) runtime adapter loads read from; none: every path
    is refused (a server started without --lora-dir)."""

    given: tuple[Path, ...] = ()
    resolved: tuple[Path, ...] = ()

    @classmethod
    def of(cls, dirs: Sequence[str | os.PathLike[str]]) -> AdapterDirs:
        """Each of ``dirs`` checked to be a directory (LinesideError naming it otherwise, for `serve`'s one line)."""
        given, resolved = [], []
        for d in dirs:
            path = Path(d).expanduser().absolute()
            try:
                is_dir = stat.S_ISDIR(path.stat().st_mode)
            except OSError:
                is_dir = False
            if not is_dir:
                raise LinesideError(f"--lora-dir {d}: not a directory; give the directory that holds the adapters "
                                    "POST /v1/load_lora_adapter may load")
            given.append(path)
            resolved.append(Path(os.path.realpath(path)))
        return cls(tuple(given), tuple(resolved))

    def client_view(self, message: str, path: Path, lora_path: str) -> str:
        """``message`` about ``path`` (what locate made of ``lora_path``) with the path as the client sent it: a
        relative one must not come back joined to the server's directory."""
        if path == Path(lora_path):
            return message
        # lora.py elides a long path's middle: that form holds the directory's name too
        return message.replace(str(path), lora_path).replace(_short(path), _short(Path(lora_path)))

    def locate(self, lora_path: str) -> Path:
        """The adapter directory ``lora_path`` names: absolute, or relative to the first --lora-dir. Kept as the
        client spelled it (messages echo what it sent, never a symlink's target); AdapterPathRefused when it, its
        adapter_config.json or its weights resolve outside every --lora-dir."""
        if not self.resolved:
            raise AdapterPathRefused("this server loads no adapters from paths (it was started without --lora-dir); "
                                     "start `lineside serve` with --lora-dir DIR, the directory holding the adapters")
        named = Path(lora_path)
        path = named if named.is_absolute() else self.given[0] / named
        for target in (path, path / CONFIG_FILE, path / WEIGHTS_FILE):
            real = Path(os.path.realpath(target))
            if not any(real == root or real.is_relative_to(root) for root in self.resolved):
                # the directories are not named: a client learns no path of the server it did not send
                raise AdapterPathRefused(
                    f"lora_path {lora_path!r} is outside the server's adapter directories (--lora-dir; symlinks "
                    "followed); give the adapter directory's path relative to the server's --lora-dir")
        return path


def runtime_lora_dirs(allow: bool, dirs: Sequence[str], host: str, api_key: str | None) -> AdapterDirs:
    """`serve`'s --allow-runtime-lora / --lora-dir, checked before the model loads: the directories, given and real;
    without a key, only on loopback (anyone reaching the port could otherwise have the server read adapters)."""
    from lineside.server.browser_guard import is_loopback

    if not allow:
        if dirs:
            raise LinesideError("--lora-dir is where --allow-runtime-lora loads adapters from; add "
                                "--allow-runtime-lora, or drop --lora-dir (use --lora-modules NAME=DIR at start)")
        return AdapterDirs()
    if not dirs:
        raise LinesideError("--allow-runtime-lora reads adapters only from the directories --lora-dir names; add "
                            "--lora-dir DIR (the directory holding the adapters)")
    if api_key is None and not is_loopback(host):
        raise LinesideError(f"--allow-runtime-lora on {host} without an API key lets anyone who reaches the port load "
                            "adapters; give a key (--api-key-file FILE or LINESIDE_API_KEY), or bind to 127.0.0.1")
    return AdapterDirs.of(dirs)
