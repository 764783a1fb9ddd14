"""Where a bundle's TensorRT engine is written and found, on the strict fake: an engine of older weights, a damaged
engine file, two builds of one engine at once and a full disk while writing it are each refused or rebuilt with one
line, never loaded blindly."""

from __future__ import annotations

import errno
import io
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from lineside.bundle import open_bundle, read_manifest, write_manifest
from lineside.errors import BackendUnavailable, LinesideError
from lineside.file_lock import lock_exclusive
from lineside.runtime.tensorrt import key as keymod
from tests.runtime.tensorrt.bundles import fake_engine_bundle

OPTS = dict(num_slots=2, max_prefill=16, first_bucket=8, bucket_step=16)


@pytest.fixture
def engine_bundle(trt_bundle, monkeypatch, tmp_path):
    b, _dev = fake_engine_bundle(trt_bundle, monkeypatch, tmp_path, num_slots=2)
    return b


def _here():
    return keymod.machine_key()


def _engine_dir(b):
    return b.path / keymod.ENGINES_DIR / _here().key


def test_engine_of_older_weights_is_stale_and_rebuilt_by_ensure_engine(engine_bundle, monkeypatch):
    # The bundle rebuilt in place with new weights of the same shapes: graphs/trt/model.onnx is byte-identical (it
    # names its weights by offset), so its sha256 alone let the old engine serve the old weights.
    from lineside.jetson import ensure_engine as eng
    from lineside.runtime.select import decide_backend

    b = engine_bundle
    data = b.path / "graphs/trt/model.onnx.data"
    raw = np.frombuffer(data.read_bytes(), np.uint8).copy()
    raw[:4096] ^= 0x5A
    data.write_bytes(raw.tobytes())
    write_manifest(b.path, read_manifest(b.path))
    fresh = open_bundle(b.path)
    assert fresh.manifest.graph_sha("trt") == b.manifest.graph_sha("trt")  # the graph file did not change
    with pytest.raises(LinesideError, match="older trt graph or weights") as e:
        decide_backend(fresh, "tensorrt")
    assert "\n" not in str(e.value) and f"lineside engine {b.path}" in str(e.value)
    assert decide_backend(fresh, "auto").backend == "onnxruntime"
    calls = []
    monkeypatch.setattr(eng.subprocess, "run", lambda cmd: calls.append(cmd) or eng.subprocess.CompletedProcess(cmd, 0))
    assert eng.ensure_engine(b.path) == (True, _here().key) and calls  # rebuilt, not "already there"


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_damaged_engine_file_is_refused_before_tensorrt_and_rebuilt(engine_bundle, monkeypatch, damage):
    from lineside.jetson import ensure_engine as eng
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b = engine_bundle
    plan = _engine_dir(b) / keymod.ENGINE_FILE
    raw = plan.read_bytes()
    plan.write_bytes({"truncated": raw[: len(raw) // 2], "flipped": raw[:-1] + bytes([raw[-1] ^ 1]),
                      "empty": b""}[damage])
    with pytest.raises(BackendUnavailable) as e:
        TensorRTBackend(b, num_slots=2)
    msg = str(e.value)
    assert "\n" not in msg and str(plan) in msg and f"`lineside engine {b.path}`" in msg
    assert ("cut short" in msg) if damage != "flipped" else ("sha256" in msg)
    assert not keymod.has_engine_for(b.path, _here(), b.manifest)
    calls = []
    monkeypatch.setattr(eng.subprocess, "run", lambda cmd: calls.append(cmd) or eng.subprocess.CompletedProcess(cmd, 0))
    assert eng.ensure_engine(b.path)[0] and calls


def test_lora_engine_alone_is_not_the_base_engine_for_ensure_engine(engine_bundle):
    b = engine_bundle
    d = _engine_dir(b)
    lora = d.with_name(d.name + "-lora2x8")
    d.rename(lora)
    meta = json.loads((lora / keymod.ENGINE_JSON).read_text())
    (lora / keymod.ENGINE_JSON).write_text(json.dumps({**meta, "lora": {"max_loras": 2, "max_rank": 8}}))
    assert not keymod.has_engine_for(b.path, _here(), b.manifest)


def test_second_build_of_one_engine_waits_for_the_first(engine_bundle):
    from lineside.build.tensorrt.builder import BUILD_LOCK, BuildOptions, build_engine

    b = engine_bundle
    d = _engine_dir(b)
    meta = json.loads((d / keymod.ENGINE_JSON).read_text())
    (d / keymod.ENGINE_JSON).write_text(json.dumps({**meta, "marker": "first build"}))
    first = (d / keymod.ENGINE_JSON).read_text()
    fd = open(d / BUILD_LOCK, "a+")  # noqa: SIM115 - "another build" holds the engine's lock
    assert lock_exclusive(fd.fileno(), wait=False).value == "held"
    waiting = threading.Event()

    class Out(io.StringIO):
        def write(self, s):
            if "waiting for another" in s:
                waiting.set()
            return super().write(s)

    out, errors = Out(), []

    def second():
        try:
            build_engine(b.path, BuildOptions(**OPTS), console=Console(file=out, width=200))
        except Exception as e:  # noqa: BLE001 - reported to the test thread
            errors.append(e)
            waiting.set()

    t = threading.Thread(target=second)
    t.start()
    assert waiting.wait(60) and not errors
    assert (d / keymod.ENGINE_JSON).read_text() == first  # nothing written while the other build holds the lock
    fd.close()  # the other build is done
    t.join(60)
    assert not t.is_alive() and not errors
    assert (d / keymod.ENGINE_JSON).read_text() != first  # then it built its own
    assert keymod.has_engine_for(b.path, _here(), b.manifest)
    assert not [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


def test_disk_full_while_writing_the_engine_is_one_line_and_leaves_no_temporary(engine_bundle, monkeypatch):
    from lineside.build.tensorrt import builder
    from lineside.build.tensorrt.builder import BuildOptions, build_engine

    b = engine_bundle
    d = _engine_dir(b)
    real = builder.os.replace

    def full(src, dst):
        if str(dst).endswith(keymod.ENGINE_FILE):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(builder.os, "replace", full)
    with pytest.raises(LinesideError) as e:
        build_engine(b.path, BuildOptions(**OPTS), console=Console(file=io.StringIO()))
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and "free space" in msg
    assert not [p.name for p in d.iterdir() if p.name.endswith(".tmp")]  # an engine-sized temporary is not left
    assert not keymod.has_engine_for(b.path, _here(), b.manifest)  # and the old record does not claim the new file


def _build(b):
    from lineside.build.tensorrt.builder import BuildOptions, build_engine

    out = io.StringIO()
    d = build_engine(b.path, BuildOptions(**OPTS), console=Console(file=out, width=300))
    return d, out.getvalue()


def test_read_only_bundle_builds_its_engine_into_the_user_cache_and_serves_from_it(engine_bundle, read_only,
                                                                                  tmp_path):
    import shutil

    from lineside.runtime.select import decide_backend
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b = engine_bundle
    shutil.rmtree(b.path / keymod.ENGINES_DIR)  # shipped without an engine (jetson push never copies one)
    read_only(b.path)
    d, said = _build(b)
    assert d.is_relative_to(tmp_path / "user-cache" / "engines") and d.name == _here().key
    assert "can't be written to (Read-only file system): the engine goes to" in said
    assert not list((b.path / keymod.ENGINES_DIR).glob("*/" + keymod.ENGINE_JSON))
    assert keymod.has_engine_for(b.path, _here(), b.manifest)
    assert decide_backend(b, "tensorrt").backend == "tensorrt"
    TensorRTBackend(b, num_slots=2).close()
    # a copy of the same bundle elsewhere shares it; a bundle with other weights never does
    copy = tmp_path / "copy"
    shutil.copytree(b.path, copy)
    read_only(copy)
    assert keymod.has_engine_for(copy, _here(), read_manifest(copy))
    data = copy / "graphs/trt/model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    write_manifest(copy, read_manifest(copy))
    assert not keymod.has_engine_for(copy, _here(), read_manifest(copy))
    # a damaged engine in the user cache is refused before TensorRT reads it, and the next build replaces it
    (d / keymod.ENGINE_FILE).write_bytes((d / keymod.ENGINE_FILE).read_bytes()[:-7])
    with pytest.raises(BackendUnavailable, match="cut short"):
        TensorRTBackend(b, num_slots=2)
    assert _build(b)[0] == d
    TensorRTBackend(b, num_slots=2).close()


def test_read_only_bundle_without_a_user_cache_is_one_line_before_building(engine_bundle, read_only, tmp_path,
                                                                          monkeypatch):
    from lineside import user_cache

    b = engine_bundle
    read_only(b.path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(user_cache.ENV_DIR, str(blocker / "cache"))
    with pytest.raises(LinesideError) as e:
        _build(b)
    msg = str(e.value)
    assert "\n" not in msg and "can't be written to" in msg and "LINESIDE_CACHE_DIR" in msg


def test_ensure_engine_builds_a_read_only_bundles_engine_into_the_user_cache(engine_bundle, read_only, monkeypatch):
    # ensure-engine refused every read-only bundle ("mount it writable"), though `lineside engine` can keep the
    # engine in the per-user cache
    import shutil

    from lineside.jetson import ensure_engine as eng

    b = engine_bundle
    shutil.rmtree(b.path / keymod.ENGINES_DIR)
    read_only(b.path)
    real_access = eng.os.access
    monkeypatch.setattr(eng.os, "access", lambda p, mode: False if Path(p).is_relative_to(b.path)
                        else real_access(p, mode))  # as on a read-only mount (root passes os.access)
    calls = []
    monkeypatch.setattr(eng.subprocess, "run", lambda cmd: calls.append(cmd) or eng.subprocess.CompletedProcess(cmd, 0))
    assert eng.ensure_engine(b.path) == (True, _here().key) and calls[0][-2:] == ["engine", str(b.path)]


def test_an_engine_hashed_once_is_not_hashed_again_until_it_changes(tmp_path, monkeypatch):
    """An engine is gigabytes: hashing it at every start cost seconds on an Orin. The first check stamps it
    (checksum_cache: inode, size, times); later checks trust the stamp, and a rewrite (same bytes, new ctime) or
    a record for another digest is hashed again."""
    d = tmp_path / "engines" / "k"
    d.mkdir(parents=True)
    data = bytes(range(256)) * 64
    (d / keymod.ENGINE_FILE).write_bytes(data)
    meta = keymod.engine_seal(data)
    reads: list[Path] = []
    real = Path.read_bytes

    def counted(self: Path) -> bytes:
        if self.name == keymod.ENGINE_FILE:
            reads.append(self)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", counted)
    assert keymod.engine_damage(d, meta) is None and len(reads) == 1
    assert keymod.engine_damage(d, meta) is None and len(reads) == 1  # stamped: not read again
    (d / keymod.ENGINE_FILE).write_bytes(data)  # rewritten: its ctime moved, so it is hashed again
    assert keymod.engine_damage(d, meta) is None and len(reads) == 2
    other = keymod.engine_seal(data[:-1] + b"x")  # engine.json for other bytes of the same size
    assert "does not match the sha256" in (keymod.engine_damage(d, other) or "") and len(reads) == 3
