"""Checks every command runs on its options before any work, written once: numbers in range, input paths
that exist, outputs whose directory exists and is writable, and outputs staged so a failure leaves nothing.

A failed check is one line (a LinesideError, or typer's BadParameter during parsing, which the CLI turns
into one line plus "see `lineside CMD --help`"), raised before a model is read or a socket opened.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from lineside.errors import LinesideError
from lineside.file_lock import LockState, lock_exclusive
from lineside.host_memory import available_memory_bytes

if TYPE_CHECKING:
    from lineside.bundle import Manifest

Number = int | float
MAX_THREADS = 1024  # CPU threads an option may ask for
MAX_SECONDS = 1_000_000.0  # ~11 days: longer timeouts overflow the event loop's clock arithmetic


# ---------------------------------------------------------------------------------------------- numbers


def _bounds_text(low: Number | None, high: Number | None, above: Number | None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above}")
    if low is not None:
        parts.append(f"≥ {low}")
    if high is not None:
        parts.append(f"≤ {high}")
    return " and ".join(parts)


def number_parser(kind: type, *, low: Number | None = None, high: Number | None = None,
                  above: Number | None = None) -> Callable[[Any], Number]:
    """A typer ``parser`` for an int or a finite float in [low, high] (``above``: strictly greater)."""
    if kind not in (int, float):
        raise TypeError(f"number_parser: kind must be int or float, not {kind!r}")
    noun = "an integer" if kind is int else "a number"

    def parse(text: Any) -> Number:
        if isinstance(text, kind) and not isinstance(text, bool):
            value = text
        else:
            try:
                value = kind(str(text).strip().replace("_", ""))
            except ValueError:
                raise typer.BadParameter(f"{text!r} is not {noun}") from None
        if kind is float and not math.isfinite(value):
            raise typer.BadParameter(f"{text!r} is not a finite number")
        if (above is not None and not value > above) or (low is not None and value < low) \
                or (high is not None and value > high):
            raise typer.BadParameter(f"{text} is out of range; give {noun} {_bounds_text(low, high, above)}")
        return value

    parse.__name__ = kind.__name__  # what typer shows as the option's type
    parse.bounds = {"kind": kind, "low": low, "high": high, "above": above}  # type: ignore[attr-defined]
    return parse


_UNSET: Any = object()


def number_option(*param_decls: str, kind: type = int, low: Number | None = None, high: Number | None = None,
                  above: Number | None = None, help: str | None = None, default: Any = _UNSET,
                  **kwargs: Any) -> Any:
    """``typer.Option`` for a number with its range checked while parsing (the range shown in --help).
    ``default``: only for the ``name: int = number_option(default=...)`` style (not inside Annotated)."""
    rng = _bounds_text(low, high, above)
    text = f"{help} [{rng}]" if help and rng else (help or (f"[{rng}]" if rng else None))
    decls = param_decls if default is _UNSET else (default, *param_decls)
    return typer.Option(*decls, parser=number_parser(kind, low=low, high=high, above=above),
                        metavar="INTEGER" if kind is int else "FLOAT", help=text, **kwargs)


def choice(value: str, option: str, choices: tuple[str, ...] | list[str]) -> str:
    """``value`` when it is one of ``choices`` (case-insensitive), else one line listing them."""
    v = value.strip().lower()
    if v not in choices:
        raise LinesideError(f"{option} {value!r}: choose one of {', '.join(choices)}")
    return v


def utf8_text(value: str, option: str) -> str:
    """``value`` when it is valid Unicode. Bytes that are not UTF-8 (a Latin-1 terminal, a file in another
    encoding) reach Python as lone surrogates, which the tokenizer refuses with a TypeError: one line instead."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LinesideError(f"{option} is not valid UTF-8 text (character {e.start + 1} is not); send it in UTF-8 "
                            "(the terminal's or file's encoding)") from None
    return value


def utf8_path(path: Path, option: str) -> Path:
    """``path`` when its name is UTF-8. A name with other bytes (a Latin-1 directory from an older system) reaches
    Python as lone surrogates, which onnx, onnxruntime and the tokenizers library cannot take (a TypeError
    traceback, or a tokenizer called broken): for the paths they open, refused up front, with the bytes shown."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(str(path)).decode("utf-8", "backslashreplace")
        raise LinesideError(f"{option} {shown}: the path is not UTF-8, and onnxruntime and the tokenizers library "
                            "take only UTF-8 paths; rename it (e.g. convmv -f latin1 -t utf8) or choose another") \
            from None
    return path


def at_most(value: int, limit: int, option: str, why: str, fix: str) -> int:
    """``value`` when ≤ ``limit`` (a limit that comes from the model or the machine, named in the error)."""
    if value > limit:
        raise LinesideError(f"{option} {value} is above {why} ({limit}); {fix}")
    return value


# ------------------------------------------------------------------------------------------------ paths


def _show(path: Path) -> str:
    return str(path)


def normalized(path: Path) -> Path:
    """``path`` absolute, with ``.`` and ``..`` resolved (symlinks kept): `-o .` or `-o ..` names a directory with a
    name and a parent, so what is staged beside it lands beside it, not inside the directory it replaces."""
    return Path(os.path.abspath(Path(path).expanduser()))


def input_file(path: Path, option: str, what: str = "file") -> Path:
    """An existing, readable regular file (not a directory)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LinesideError(f"{option} {_show(p)}: no such {what}; check the path")
    if p.is_dir():
        raise LinesideError(f"{option} {_show(p)} is a directory; give a {what}")
    if not os.access(p, os.R_OK):
        raise LinesideError(f"{option} {_show(p)}: permission denied; make it readable or copy it somewhere "
                            "you can read")
    return p


def input_dir(path: Path, option: str, what: str = "directory") -> Path:
    """An existing, readable directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LinesideError(f"{option} {_show(p)}: no such {what}; check the path")
    if not p.is_dir():
        raise LinesideError(f"{option} {_show(p)} is a file, not a {what}")
    if not os.access(p, os.R_OK | os.X_OK):
        raise LinesideError(f"{option} {_show(p)}: permission denied; make it readable")
    return p


def _probe_writable(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried for real: read-only mounts fool os.access as root)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".lineside-write-check-"):
            return True
    except OSError:
        return False


def writable_parent(path: Path, option: str) -> Path:
    """The directory ``path`` will be created in: it must exist, be a directory and be writable."""
    parent = path.parent
    if not parent.exists():
        missing = parent
        while not missing.parent.exists() and missing.parent != missing:
            missing = missing.parent
        if missing.parent.exists() and not missing.parent.is_dir():
            raise LinesideError(f"{option} {_show(path)}: {_show(missing.parent)} is a file, not a directory; "
                                "choose another path")
        raise LinesideError(f"{option} {_show(path)}: directory {_show(parent)} does not exist; "
                            f"create it first (mkdir -p {_show(parent)}) or choose another path")
    if not parent.is_dir():
        raise LinesideError(f"{option} {_show(path)}: {_show(parent)} is a file, not a directory; choose another path")
    if not _probe_writable(parent):
        raise LinesideError(f"{option} {_show(path)}: cannot write in {_show(parent)} (permission denied or "
                            "read-only); choose a directory you can write to")
    return parent


def output_file(path: Path, option: str, *, append: bool = False) -> Path:
    """A file to write (or append to): not a directory, its directory exists and is writable; an existing file
    must itself be writable. The path is used exactly as given (no suffix added)."""
    p = Path(path).expanduser()
    if str(path).endswith(os.sep) or p.is_dir():
        raise LinesideError(f"{option} {_show(p)} is a directory; give a file path such as {_show(p / 'out')}"
                            + (".npy" if option in ("-o", "--output") else ""))
    writable_parent(p, option)
    if p.exists() and not os.access(p, os.W_OK):
        raise LinesideError(f"{option} {_show(p)}: the file exists and is not writable; choose another path")
    if append and p.exists() and not p.is_file():
        raise LinesideError(f"{option} {_show(p)} is not a regular file; give a file to append to")
    return p


def output_dir(path: Path, option: str, *, force: bool = False, what: str = "directory") -> Path:
    """A directory to create: not a file, its parent exists and is writable, and it is absent or empty unless
    ``force`` (then it is replaced once the new one is complete)."""
    p = normalized(path)
    if p.is_symlink():  # replacing it would replace the link, not the directory it points to
        raise LinesideError(f"{option} {_show(path)} is a symbolic link (to {os.readlink(p)}); give the directory "
                            "itself or another path")
    if p.exists() and not p.is_dir():
        raise LinesideError(f"{option} {_show(path)} is a file; a {what} is a directory: choose another path")
    writable_parent(p, option)
    if p.is_dir() and any(p.iterdir()) and not force:
        raise LinesideError(f"{option} {_show(p)} exists and is not empty; choose another {option} "
                            "or pass --force to replace it")
    return p


def target_dir(path: Path, option: str) -> Path:
    """A directory written into (created if absent, kept if present): not a file; writable, or its parent is."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise LinesideError(f"{option} {_show(p)} is a file, not a directory; choose another path")
    if p.is_dir():
        if not _probe_writable(p):
            raise LinesideError(f"{option} {_show(p)}: cannot write in it (permission denied or read-only); "
                                "choose a directory you can write to")
        return p
    writable_parent(p, option)
    return p


def apart_from(output: Path, option: str, inputs: dict[str, Path | None]) -> None:
    """An output that would replace (or hold) one of the command's inputs is refused: with --force it would
    delete the very checkpoint or bundle being read."""
    out = Path(output).expanduser().resolve()
    for name, path in inputs.items():
        if path is None:
            continue
        src = Path(path).expanduser().resolve()
        if src == out or out in src.parents:
            raise LinesideError(f"{option} {output} would replace {name} {path} that this command reads; "
                                f"choose another {option}")


@contextlib.contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically, on failure it is
    removed (an interrupted write never leaves a truncated file under the name asked for)."""
    while True:  # mkstemp would make it 0600, a mode the file keeps when renamed: open it as a plain file would be
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.partial"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_dir(new: Path, path: Path) -> None:
    """Put the complete directory ``new`` at ``path``. An existing ``path`` is renamed aside and deleted only once
    ``new`` is in place, so an interruption or an error leaves the old directory or the new one at ``path``, never
    a half-deleted one; ``new`` is removed when it could not be put in place."""
    aside = path.with_name(f".{path.name}.replaced")  # bundle.py names it to a user who finds ``path`` gone
    old = aside if path.exists() or path.is_symlink() else None
    try:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # one an earlier interrupted replace left
            os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
            raise
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    # what it replaced, or what a replace killed between its two renames set aside (``path`` was gone then)
    shutil.rmtree(aside, ignore_errors=True)


def claim_staging(tmp: Path, path: Path) -> int:
    """Make ``tmp`` (``<path>.partial``) a fresh, empty directory this process alone writes: returns a descriptor
    holding an flock on it (the kernel drops it when the process dies, SIGKILL included). One an interrupted
    run left is removed; one another run is writing now is refused, since removing it would pull the files
    from under that run and leave a bundle with some of them missing."""
    while True:
        try:
            tmp.mkdir(parents=True)
        except FileExistsError:
            if tmp.is_symlink() or not tmp.is_dir():  # not one a run left: nothing to remove
                raise LinesideError(f"{tmp} is in the way: {path} is staged there; move it away or choose another "
                                    "output") from None
            fd = _lock_dir(tmp, path)
            if fd is not None:  # no one holds it: an interrupted run's
                try:
                    shutil.rmtree(tmp)  # what cannot be removed is reported, not tried again forever
                finally:
                    os.close(fd)
            continue
        fd = _lock_dir(tmp, path)
        if fd is not None:
            return fd


def _lock_dir(tmp: Path, path: Path) -> int | None:
    """An flock on the directory ``tmp`` (None when it went away or changed under us: try again)."""
    try:
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return None
    if lock_exclusive(fd, wait=False) == LockState.BUSY:  # UNSUPPORTED: go on unguarded, as before
        os.close(fd)
        raise LinesideError(f"another lineside command is writing {path} now ({tmp.name} is in use); wait for it to "
                            "finish, or choose another output")
    try:
        same = os.path.samestat(os.fstat(fd), os.stat(tmp))
    except FileNotFoundError:
        same = False
    if not same:  # removed (and maybe made again) by another run between our open and lock
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def staged_dir(path: Path) -> Iterator[Path]:
    """Yield ``<path>.partial`` (fresh); on success it takes ``path``'s place (replacing an existing one), on
    failure it is removed, so a half-written directory is never left behind."""
    path = normalized(path)
    tmp = path.with_name(path.name + ".partial")
    lock = claim_staging(tmp, path)
    try:
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        replace_dir(tmp, path)
    finally:
        os.close(lock)


# ----------------------------------------------------------------------------------------------- memory

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
                "uint4x2": 1}  # a packed int4 KV state: its shape counts bytes (two values each)


def decode_state_bytes(manifest: Manifest, num_slots: int) -> int:
    """Bytes of the decode state (KV cache, ...) the onnxruntime backend allocates for ``num_slots`` sequences
    of the bundle's max_seq_len, from the state tensors its manifest lists."""
    from lineside.graph_io import StateTensor, resolve_shape

    flavors = manifest.flavors
    flavor = "cpu" if "cpu" in flavors else next(iter(flavors), None)
    if flavor is None:
        return 0
    states = flavors[flavor].state
    max_seq = int(manifest.max_seq_len or 0)
    dims = {"batch": num_slots, "max_seq": max_seq, "past_seq": max_seq}
    total = 0
    for raw in states:
        s = raw if isinstance(raw, StateTensor) else StateTensor.from_dict(raw)
        total += math.prod(resolve_shape(s.shape, dims)) * _DTYPE_BYTES.get(s.dtype, 4)
    return total


def fits_in_memory(need: int, what: str, fix: str, available: int | None = None) -> None:
    """Refuse, before allocating, what cannot fit in this machine's available memory (the alternative is the
    kernel's OOM killer: exit 137 and nothing printed)."""
    have = available_memory_bytes() if available is None else available
    if have is not None and need > have:
        raise LinesideError(f"{what} needs {need / 2**30:.1f} GiB, and {have / 2**30:.1f} GiB of memory is "
                            f"available; {fix}")
