"""Which Python and lineside a device serves a pushed bundle with, and whether they can open it.

`jetson push` asks before copying: a device whose lineside is missing, reads an older bundle format, or whose Python
lineside does not support would get `current` switched onto a bundle its service cannot open (and restart-loop).
The interpreter asked is the one the systemd unit runs (its ExecStart's shebang), not whichever `python3` ssh finds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from lineside import __version__
from lineside.errors import LinesideError

if TYPE_CHECKING:
    from lineside.bundle import Manifest
    from lineside.jetson.targets import SshTarget

MIN_PYTHON = (3, 10)  # pyproject.toml's requires-python (a test keeps them equal)
UNIT = "lineside.service"  # the unit `jetson service` writes and its install hint names
FORCE = "--force"  # the `jetson push` flag that pushes past a refusal

# Runs on the device's interpreter, which may be far older than 3.10: no syntax newer than 3.6 (or 2.7).
_PROBE = r"""
import json, os, shutil, sys, tempfile
out = {"python": list(sys.version_info[:3])}
try:
    import lineside
    out["lineside"] = str(getattr(lineside, "__version__", "unknown"))
    from lineside import bundle
    out["format_version"] = getattr(bundle, "FORMAT_VERSION", None)
    d = tempfile.mkdtemp()
    try:
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write(sys.stdin.read())
        bundle.read_manifest(d)
    except Exception as e:
        out["read_error"] = str(e).replace(d + os.sep, "").replace(d, "bundle")
    finally:
        shutil.rmtree(d, ignore_errors=True)
except Exception as e:
    out["import_error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""


class DeviceRefused(LinesideError):
    """The device's lineside cannot open the bundle: ``reason`` is the one line without `jetson push`'s override
    hint, so a caller with its own override (`fleet push --force`) can name that instead."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Source(str, Enum):
    """Where the interpreter came from (said in every refusal, so a user knows which install was asked)."""

    UNIT = f"the ExecStart of {UNIT}"
    PATH_LINESIDE = "`lineside` on the ssh PATH"
    CONTAINER = "the container serving it"
    PATH_PYTHON = "`python3` on the ssh PATH (no lineside.service, no lineside)"


@dataclass(frozen=True)
class DeviceRuntime:
    """What the probe found; ``problem`` is the probe's own failure (no interpreter, unreadable output)."""

    interpreter: tuple[str, ...]
    source: Source
    python: tuple[int, ...] | None = None
    lineside: str | None = None
    format_version: int | None = None
    read_error: str | None = None
    problem: str | None = None

    def describe(self) -> str:
        py = ".".join(map(str, self.python)) if self.python else "?"
        return f"lineside {self.lineside or 'none'} on Python {py} ({shlex.join(self.interpreter)}, {self.source.value})"


def _unit_exe(exec_start: str) -> str | None:
    """The program an ExecStart= value runs: its first word without systemd's -@:+! prefixes."""
    try:
        words = shlex.split(exec_start)
    except ValueError:
        return None
    exe = words[0].lstrip("-@:+!") if words else ""
    return exe or None


def _is_python(word: str) -> bool:
    return re.fullmatch(r"python[0-9.]*", os.path.basename(word)) is not None


def interpreter_of(script_head: str) -> tuple[str, ...] | None:
    """The Python a console script runs, from its first lines: `#!/venv/bin/python3`, `#!/usr/bin/env python3`, or
    pip's `#!/bin/sh` + `'''exec' "/long/path/python" "$0" "$@"` for paths too long for a shebang."""
    lines = script_head.splitlines()
    if not lines or not lines[0].startswith("#!"):
        return None
    # the kernel's reading: the interpreter up to the first blank, the rest one argument (for env: the program)
    exe, _, arg = lines[0][2:].strip().replace("\t", " ").partition(" ")
    if _is_python(exe):
        return (exe,)
    if os.path.basename(exe) == "env":
        words = arg.split()
        for i, w in enumerate(words):
            if _is_python(w):
                return (exe, *words[: i + 1])
    m = re.match(r"""^'''exec' (.+?) "\$0" "\$@"$""", lines[1]) if len(lines) > 1 else None
    if m:
        try:
            words = shlex.split(m.group(1))
        except ValueError:
            return None
        return tuple(words) if words and _is_python(words[0]) else None
    return None


# Each running container and its mounts' host paths, tab-separated: the Dockerfile.jetson way serves TARGET/current
# from a container, whose lineside the host has no trace of.
_CONTAINERS = ("command -v docker >/dev/null 2>&1 && docker ps -q 2>/dev/null | while read -r id; do "
               "printf 'docker\\t%s\\n' \"$(docker inspect --format "
               "'{{.Id}}{{range .Mounts}}{{printf \"\\t%s\" .Source}}{{end}}' \"$id\" 2>/dev/null)\"; done; true")


def _container_serving(lines: list[str], root: str) -> str | None:
    """The id of a running container with TARGET (or a version under it: docker resolves `current`) mounted."""
    base = root.rstrip("/")
    for ln in lines:
        kind, _, rest = ln.partition("\t")
        cid, *sources = rest.split("\t")
        if kind == "docker" and cid and any(s.rstrip("/") == base or s.startswith(base + "/") for s in sources):
            return cid
    return None


def probe(t: SshTarget, manifest_text: str) -> DeviceRuntime:
    """Find the interpreter the service runs and ask its lineside about this manifest (three short ssh commands)."""
    found = t.command(
        f"u=$({{ systemctl cat {UNIT} 2>/dev/null || cat /etc/systemd/system/{UNIT} 2>/dev/null; }} "
        "| sed -n 's/^[[:space:]]*ExecStart=//p' | tail -n 1); "
        "printf 'unit\\t%s\\nlineside\\t%s\\npython3\\t%s\\n' \"$u\" \"$(command -v lineside)\" \"$(command -v python3)\"; "
        + _CONTAINERS
    ).stdout
    where = dict(ln.split("\t", 1) for ln in found.splitlines() if "\t" in ln)
    exe = _unit_exe(where.get("unit", "").strip())
    source = Source.UNIT
    container = _container_serving(found.splitlines(), t.root) if exe is None else None
    if container:  # the image's PATH puts its venv first (Dockerfile.jetson)
        return _ask(t, ("docker", "exec", "-i", container, "python3"), Source.CONTAINER, manifest_text)
    if exe is None and where.get("lineside", "").strip():
        exe, source = where["lineside"].strip(), Source.PATH_LINESIDE
    if exe is None:
        py = where.get("python3", "").strip()
        if not py:
            return DeviceRuntime(("python3",), Source.PATH_PYTHON, problem="has no python3 (and no lineside)")
        return _ask(t, (py,), Source.PATH_PYTHON, manifest_text)
    if _is_python(exe):
        return _ask(t, (exe,), source, manifest_text)
    head = t.command(f"p=$(command -v -- {shlex.quote(exe)}) || exit 3; head -n 2 -- \"$p\" | cut -c1-400")
    if head.returncode != 0:
        guess = (os.path.join(os.path.dirname(exe), "python3"),) if "/" in exe else ("python3",)
        return DeviceRuntime(guess, source, problem=f"has no {exe} ({source.value} runs it)")
    interp = interpreter_of(head.stdout)
    if interp is None:
        return DeviceRuntime((exe,), source, problem=f"runs {exe} ({source.value}), which is not a Python console "
                                                     "script; cannot tell which Python it uses")
    return _ask(t, interp, source, manifest_text)


def _ask(t: SshTarget, interp: tuple[str, ...], source: Source, manifest_text: str) -> DeviceRuntime:
    p = t.command(shlex.join([*interp, "-c", _PROBE]), stdin=manifest_text)
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
        python = tuple(int(x) for x in out["python"])
    except (IndexError, ValueError, KeyError, TypeError):
        last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return DeviceRuntime(interp, source, problem=f"cannot run {shlex.join(interp)} ({source.value}): {last}")
    fv = out.get("format_version")
    err = out.get("read_error")
    return DeviceRuntime(interp, source, python, out.get("lineside") if "import_error" not in out else None,
                         fv if type(fv) is int else None, " ".join(str(err).split()) if err else None)


def _needed(manifest: Manifest) -> str:
    """The lineside release to install: the bundle's builder when it names one, else this one."""
    v = manifest.lineside_version
    return v if isinstance(v, str) and re.fullmatch(r"\d+(\.\d+)*", v) else __version__


def refusal(rt: DeviceRuntime, manifest: Manifest, where: str) -> str | None:
    """One line saying why the device cannot serve this bundle and the pip command that fixes it; None if it can."""
    need = _needed(manifest)
    pip = f"`{shlex.join([*rt.interpreter, '-m', 'pip', 'install', '-U', f'lineside>={need}'])}`"
    if rt.source is Source.CONTAINER:  # pip inside a container is lost when it is recreated: the image is the fix
        pip = (f"a lineside:jetson image of lineside >= {need} (`docker build -f Dockerfile.jetson -t lineside:jetson .` "
               "from that source), then recreate the container")
    if rt.problem:
        return f"{where} {rt.problem}: install lineside there ({pip})"
    assert rt.python is not None
    py = ".".join(map(str, rt.python))
    if rt.python[:2] < MIN_PYTHON:
        want = ".".join(map(str, MIN_PYTHON))
        return (f"{where} would serve with Python {py} ({shlex.join(rt.interpreter)}, {rt.source.value}) and lineside "
                f"needs Python >= {want}: install Python {want}+ there, lineside into it (`python{want} -m pip install "
                f"'lineside>={need}'`) and point {UNIT} at that lineside")
    if rt.lineside is None:
        return f"{where} has no lineside for {shlex.join(rt.interpreter)} ({rt.source.value}): install it with {pip}"
    if rt.read_error or (rt.format_version is not None and rt.format_version < manifest.format_version):
        why = rt.read_error or f"it reads bundle format {rt.format_version}, this bundle is {manifest.format_version}"
        fix = f"upgrade it with {pip}"
        if rt.format_version is not None and rt.format_version > manifest.format_version:  # the device is newer
            fix = (f"rebuild the bundle with lineside {rt.lineside} (it reads bundle format {rt.format_version}) "
                   "and push that")
        return (f"{where} has lineside {rt.lineside} ({shlex.join(rt.interpreter)}, {rt.source.value}), which cannot "
                f"open this bundle ({why}): {fix}")
    return None
