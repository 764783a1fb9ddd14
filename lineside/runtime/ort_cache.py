"""onnxruntime's optimized graph, cached next to a bundle's graph so later starts skip graph optimization.

The first session of a graph saves what onnxruntime's optimizer made of it
(``SessionOptions.optimized_model_filepath``); its weights are pointed back at the bundle's own data
file wherever the bytes are unchanged, so the cache costs kilobytes, not a second copy of the weights.
Later sessions load the cached graph with optimizations off. The cache lives beside the graph (onnxruntime
only reads external data inside the model's directory) but is not one of the bundle's checksummed files:
its name carries a key of the onnxruntime version, the graph's sha256, the session settings that change
the optimized graph, and the machine. Each cache is sealed with a digest of its bytes and key (cache_seal): one
that changed on disk, was cut short or sits under another key's name is deleted and rebuilt, as is one that fails
to load. A bundle directory that can't be written to (read-only storage) keeps its caches in the per-user cache
(user_cache) instead, named by the graph files' sha256 and the same key, and loaded from bytes with onnxruntime told
to read the weights from the bundle's graph folder: a copy of the bundle elsewhere shares them (same bytes, read
from its own files), a rebuilt one never does. Without a writable cache either, the graphs are optimized each start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lineside import user_cache
from lineside.file_lock import LockState, lock_exclusive
from lineside.runtime.cache_seal import seal_file, sealed

log = logging.getLogger("lineside.runtime")

SUFFIX = ".ort-opt.onnx"
TMP_SUFFIX = ".tmp.onnx"  # an optimized graph being written (its weights beside it in <name>.data)
ENV_DISABLE = "LINESIDE_ORT_CACHE"  # "0" turns the cache off
USER_FOLDER = "ort"  # under the per-user cache directory, for bundles that can't be written to
# onnxruntime >= 1.20: where a model loaded from bytes finds its external data (else it refuses any)
_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


KEEP_OTHERS = 2  # caches of one graph kept under other keys than the one just saved (each is kilobytes)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


@dataclass(frozen=True)
class GraphRewrite:
    """A custom-op library and what it does to a graph before onnxruntime sees it: ``apply(graph)`` returns the
    rewritten model's bytes (its weights still read from the graph's folder), or None when nothing changed. The
    caller puts what identifies the rewrite in the cache key's settings."""

    library: Path
    apply: Callable[[Path], bytes | None]


@dataclass(frozen=True)
class CachedGraph:
    """Where a graph's optimized copy lives for one key: beside the graph, or in the per-user ``folder``, where
    ``tag`` (the graph files' sha256) tells one bundle's graphs from another's of the same name."""

    graph: Path
    key: str
    folder: Path | None = None
    tag: str = ""

    @property
    def directory(self) -> Path:
        return self.folder if self.folder is not None else self.graph.parent

    @property
    def prefix(self) -> str:
        return f"{self.tag}.{self.graph.name}" if self.tag else self.graph.name

    @property
    def path(self) -> Path:
        return self.directory / f"{self.prefix}.{self.key}{SUFFIX}"

    def stale(self) -> list[Path]:
        """Caches of the same graph under other keys (an older onnxruntime, other settings) past the newest
        KEEP_OTHERS: a switch turned back and forth (LINESIDE_ROWS_KERNEL in an A/B run) finds its own cache."""
        others = [p for p in self.directory.glob(f"{self.prefix}.*{SUFFIX}") if p != self.path]
        return sorted(others, key=_mtime, reverse=True)[KEEP_OTHERS:]


def cache_key(ort_version: str, graph_sha: str, settings: dict[str, str]) -> str:
    """The cache's name tag. The CPU's features are not in it: the cache is optimized at ORT_ENABLE_EXTENDED, short
    of the CPU-tied layouts, and prepacked weights are not saved; onnxruntime 1.32 wrote the same bytes for a tiny
    W4A16 bundle's graphs on an AVX-512/VNNI/AMX host and under qemu's Haswell (no AVX-512, no VNNI)."""
    parts = [ort_version, graph_sha, platform.machine(), *(f"{k}={v}" for k, v in sorted(settings.items()))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1") != "0"


def open_session(ort: Any, graph: Path, graph_sha: str | None, make_options: Callable[[], Any],
                 settings: dict[str, str], providers: list[str],
                 rewrite: GraphRewrite | None = None) -> tuple[Any, str]:
    """An InferenceSession for ``graph``; ``(session, how)`` with how = "cache" (loaded the optimized copy),
    "saved" (optimized now and cached) or "plain" (no cache: disabled, no sha, or it could not be written).

    ``make_options()`` returns fresh SessionOptions (threads, config entries); this sets the optimization
    level and the output path. Errors of the graph itself come from the plain path, as without a cache.
    ``rewrite``: a custom-op library registered on every session, and the graph rewritten for it before it
    is optimized (a cached graph holds the rewrite already).
    """
    if rewrite is not None:
        made = make_options

        def make_options() -> Any:
            so = made()
            so.register_custom_ops_library(str(rewrite.library))
            return so

    def source(so: Any) -> str | bytes:
        """What a session is opened on: the graph's path, or its rewritten bytes (weights from its folder)."""
        raw = rewrite.apply(graph) if rewrite is not None else None
        if raw is None:
            return str(graph)
        so.add_session_config_entry(_DATA_FOLDER, str(graph.parent))
        return raw

    def plain() -> Any:
        so = make_options()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(source(so), so, providers=providers)

    if not (enabled() and graph_sha):
        return plain(), "plain"
    key = cache_key(ort.__version__, graph_sha, settings)
    beside = CachedGraph(graph, key)
    mine = user_cache.folder(USER_FOLDER, make=False)
    candidates = [beside] + ([CachedGraph(graph, key, mine, graph_sha[:16])] if mine is not None else [])
    for cached in candidates:
        if cached.path.is_file():
            session = _load(ort, cached, make_options, providers)
            if session is not None:
                return session, "cache"
    cached = beside
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{cached.prefix}.", suffix=TMP_SUFFIX, dir=cached.directory)
    except OSError as e:  # a read-only bundle: its caches go to the per-user cache, or it goes without
        fallback = _in_user_cache(graph, key, graph_sha, e)
        if fallback is None:
            return plain(), "plain"
        cached, fd, tmp_name = fallback
    tmp = Path(tmp_name)
    lock_exclusive(fd, wait=False)  # ours while this process writes it: _remove_abandoned leaves it alone
    _remove_abandoned(cached, tmp)
    data = tmp.with_name(tmp.name + ".data")
    so = make_options()
    # Extended is everything the CPU provider does short of layout changes tied to this CPU (NCHWc).
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data.name)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        try:
            session = ort.InferenceSession(source(so), so, providers=providers)
        except Exception:  # noqa: BLE001 - saving may be what failed (disk full): the plain path decides
            return plain(), "plain"
        try:
            _point_at_source(tmp, data, graph)
            seal_file(tmp, cached.key)  # checked before every load: a cache that changed is rebuilt, not run
            tmp.chmod(0o644)  # mkstemp's 0600 would hide it from other users serving the same bundle
            os.replace(tmp, cached.path)
        except Exception as e:  # noqa: BLE001 - the session is fine; only the cache is lost
            log.info("not caching onnxruntime's optimized graph of %s in %s (%s)", graph, cached.directory, e)
            return session, "plain"
        for old in cached.stale():
            _remove(old)
        return session, "saved"
    finally:
        _remove(tmp)
        _remove(data)
        os.close(fd)


def _load(ort: Any, cached: CachedGraph, make_options: Callable[[], Any], providers: list[str]) -> Any:
    """A session on the cached graph, or None (said, and the cache removed) when it is not the sealed copy for
    its key or fails to load. One in the per-user cache is loaded from the bytes just checked, its weights read
    from the bundle's graph folder (onnxruntime reads external data only beside the model file otherwise)."""
    try:
        raw = cached.path.read_bytes()
        why = None if sealed(raw, cached.key) else \
            "its checksum does not match: changed on disk, or written by another lineside or for other settings"
        if why is None:
            so = make_options()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if cached.folder is None:
                return ort.InferenceSession(str(cached.path), so, providers=providers)
            so.add_session_config_entry(_DATA_FOLDER, str(cached.graph.parent))
            return ort.InferenceSession(raw, so, providers=providers)
    except Exception as e:  # noqa: BLE001 - a bad cache is rebuilt, never fatal
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
    log.warning("ignoring onnxruntime's cached graph %s (%s); optimizing the graph again", cached.path, why)
    _remove(cached.path)
    return None


def _in_user_cache(graph: Path, key: str, graph_sha: str, e: OSError) -> tuple[CachedGraph, int, str] | None:
    """Where a graph whose folder can't be written to is cached instead: (cache, fd, temporary file), or None when
    the per-user cache can't be written either (said once per folder, with what to do)."""
    folder = user_cache.folder(USER_FOLDER)
    if folder is not None:
        cached = CachedGraph(graph, key, folder, graph_sha[:16])
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{cached.prefix}.", suffix=TMP_SUFFIX, dir=folder)
        except OSError as e2:
            _say_unwritable(graph.parent, e, f"nor is the per-user cache {folder} ({e2.strerror or type(e2).__name__})")
        else:
            _say_unwritable(graph.parent, e, "", folder)
            return cached, fd, tmp_name
    else:
        _say_unwritable(graph.parent, e, "and there is no per-user cache")
    return None


_unwritable_said: set[Path] = set()
_unwritable_lock = threading.Lock()


def _say_unwritable(folder: Path, e: OSError, why_not: str, kept_in: Path | None = None) -> None:
    """One line per folder and process: a flavor's graphs (the 4-bit one, its int8 prefill graph, drafts, the LoRA
    graph) share a folder and open at once, and a read-only bundle is one fact, not a line per graph."""
    with _unwritable_lock:
        if folder in _unwritable_said:
            return
        _unwritable_said.add(folder)
    reason = e.strerror or type(e).__name__
    if kept_in is not None:
        log.info("onnxruntime's graph cache for %s is kept in %s: the bundle directory is not writable (%s)",
                 folder, kept_in, reason)
        return
    log.warning("no onnxruntime graph cache in %s: it is not writable (%s), %s; every start optimizes the bundle's "
                "graphs again: make the bundle directory writable, or set %s to a writable directory",
                folder, reason, why_not, user_cache.ENV_DIR)


def _remove_abandoned(cached: CachedGraph, mine: Path) -> None:
    """The temporary copies of ``cached``'s graph (and their data files, as large as the weights) that a start killed
    mid-write left behind (SIGKILL, the OOM killer, a start timeout): one pair per killed start, which filled the
    disk. A copy another process holds locked is being written now and stays."""
    for p in cached.directory.glob(f".{cached.prefix}.*{TMP_SUFFIX}"):
        if p == mine:
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        if lock_exclusive(fd, wait=False) != LockState.HELD:  # a live writer's (or no locks here: left, to be safe)
            os.close(fd)
            continue
        try:
            _remove(p.with_name(p.name + ".data"))
            _remove(p)
        finally:
            os.close(fd)


def _point_at_source(optimized: Path, data: Path, graph: Path) -> None:
    """Rewrite ``optimized`` so each external weight whose bytes equal the source graph's same-named weight
    reads the source's data file; any other external weight is embedded (optimizer-made tensors are small)."""
    import onnx

    src = {t.name: _external(t) for t in onnx.load(str(graph), load_external_data=False).graph.initializer}
    model = onnx.load(str(optimized), load_external_data=False)
    handles: dict[Path, Any] = {}
    try:
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            mine = _external(t)
            raw = _read(handles, optimized.parent / mine["location"], mine)
            theirs = src.get(t.name)
            if theirs and theirs.get("length") == mine["length"] and \
                    _read(handles, graph.parent / theirs["location"], theirs) == raw:
                _set_external(t, theirs)
            else:
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
                t.raw_data = raw
    finally:
        for h in handles.values():
            h.close()
    onnx.save(model, str(optimized))
    if data.exists():
        data.unlink()


def _external(t: Any) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _set_external(t: Any, info: dict[str, str]) -> None:
    del t.external_data[:]
    for k in ("location", "offset", "length"):
        if k in info:
            e = t.external_data.add()
            e.key, e.value = k, info[k]


def _read(handles: dict[Path, Any], path: Path, info: dict[str, str]) -> bytes:
    h = handles.get(path)
    if h is None:
        h = handles[path] = path.open("rb")
    h.seek(int(info.get("offset", 0)))
    return h.read(int(info["length"]))


def _remove(p: Path) -> None:
    try:
        p.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.debug("could not remove %s (%s)", p, e)
