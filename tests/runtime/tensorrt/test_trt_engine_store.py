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


def _make_base_engine_a_lora_one(b) -> Path:
    """Turn the bundle's base engine into a LoRA engine (its directory and engine.json), leaving no base engine;
    the LoRA engine's directory."""
    d = _engine_dir(b)
    lora = d.with_name(d.name + "-lora2x8")
    d.rename(lora)
    meta = json.loads((lora / keymod.ENGINE_JSON).read_text())
    (lora / keymod.ENGINE_JSON).write_text(json.dumps({**meta, "lora": {"max_loras": 2, "max_rank": 8}}))
    return lora


def test_lora_engine_alone_is_not_the_base_engine_for_ensure_engine(engine_bundle):
    b = engine_bundle
    _make_base_engine_a_lora_one(b)
    assert not keymod.has_engine_for(b.path, _here(), b.manifest)


def test_second_forced_build_of_one_engine_waits_for_the_first_then_builds_its_own(engine_bundle):
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
            build_engine(b.path, BuildOptions(**OPTS), console=Console(file=out, width=200), force=True)
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
        build_engine(b.path, BuildOptions(**OPTS), console=Console(file=io.StringIO()), force=True)
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


class _OtherBuild:
    """Plays another process building ``d``'s engine: it holds the engine's build lock with the engine files moved
    aside, and ``finish`` puts them back (marked, so a rebuild shows) and releases the lock."""

    def __init__(self, d: Path, monkeypatch):
        from lineside.build.tensorrt import builder

        self.d, self.aside = d, d.parent.parent / "engine-aside"  # outside engines/: no engine meanwhile
        d.rename(self.aside)
        d.mkdir()
        self.fd = open(d / builder.BUILD_LOCK, "a+")  # noqa: SIM115 - held until finish()
        assert lock_exclusive(self.fd.fileno(), wait=False).value == "held"
        self.waiting = threading.Event()
        real = builder.lock_exclusive

        def lock(fd, *, wait):  # the waiter blocks on the lock: the moment to finish the "other" build
            if wait:
                self.waiting.set()
            return real(fd, wait=wait)

        monkeypatch.setattr(builder, "lock_exclusive", lock)

    def finish(self) -> str:
        for name in (keymod.ENGINE_FILE, keymod.ENGINE_JSON):
            (self.aside / name).rename(self.d / name)
        meta = json.loads((self.d / keymod.ENGINE_JSON).read_text())
        (self.d / keymod.ENGINE_JSON).write_text(json.dumps({**meta, "marker": "the other build"}))
        self.fd.close()
        return (self.d / keymod.ENGINE_JSON).read_text()


def _race(other: _OtherBuild, waiter) -> tuple[str, list]:
    errors: list = []

    def run():
        try:
            waiter()
        except BaseException as e:  # noqa: BLE001 - reported to the test thread (SystemExit included)
            errors.append(e)
            other.waiting.set()

    t = threading.Thread(target=run)
    t.start()
    assert other.waiting.wait(60) and not errors
    written = other.finish()
    t.join(60)
    assert not t.is_alive()
    return written, errors


def test_build_that_waited_uses_the_engine_the_other_build_wrote(engine_bundle, monkeypatch):
    # the second build waited on the lock, then built the same engine again: minutes on an Orin
    from lineside.build.tensorrt.builder import BuildOptions, build_engine

    b = engine_bundle
    d = _engine_dir(b)
    other = _OtherBuild(d, monkeypatch)
    out = io.StringIO()
    written, errors = _race(other, lambda: build_engine(b.path, BuildOptions(**OPTS),
                                                        console=Console(file=out, width=300)))
    assert not errors
    assert (d / keymod.ENGINE_JSON).read_text() == written  # not rebuilt
    lines = [ln for ln in out.getvalue().splitlines() if "using it" in ln]
    assert len(lines) == 1 and "another `lineside engine` built it while this one waited" in lines[0]
    assert str(d) in lines[0] and "--force" in lines[0]
    assert keymod.has_engine_for(b.path, _here(), b.manifest)


def test_ensure_engine_racing_another_build_uses_its_engine(engine_bundle, monkeypatch, capsys):
    # a unit restart racing a manual `jetson ensure-engine`: both find no engine, the second waits, then rebuilds
    from lineside.cli import main
    from lineside.jetson import ensure_engine as eng

    b = engine_bundle
    d = _engine_dir(b)
    engine_args = "--slots 2 --max-prefill 16"
    with pytest.raises(SystemExit):  # the engine the other run builds: the CLI's settings (the fixture's differ)
        main(["engine", str(b.path), *engine_args.split()])
    other = _OtherBuild(d, monkeypatch)
    assert not keymod.has_engine_for(b.path, _here(), b.manifest)

    def run_cli(cmd):  # `python -m lineside engine ...`, in this process (the fake TensorRT is installed here)
        assert cmd[1:4] == ["-m", "lineside", "engine"]
        try:
            main(cmd[3:])
        except SystemExit as e:
            return eng.subprocess.CompletedProcess(cmd, e.code)
        return eng.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(eng.subprocess, "run", run_cli)
    capsys.readouterr()
    written, errors = _race(other, lambda: eng.ensure_engine(b.path, engine_args))
    assert not errors
    assert (d / keymod.ENGINE_JSON).read_text() == written
    io_ = capsys.readouterr()
    assert "built it while this one waited): using it" in io_.err and f"engine kept in {d}" in io_.out


@pytest.mark.parametrize("change", [{}, {"num_slots": 3}, {"max_prefill": 8}, {"opt_level": 1},
                                    {"workspace_gb": 2.0}, {"fp16": False}])
def test_engine_of_other_settings_is_rebuilt_and_of_the_same_reused(engine_bundle, change):
    from lineside.build.tensorrt.builder import BuildOptions, ensure_built

    b = engine_bundle
    d = _engine_dir(b)
    before = (d / keymod.ENGINE_JSON).read_text()
    done = ensure_built(b.path, BuildOptions(**{**OPTS, **change}), console=Console(file=io.StringIO()))
    assert done.path == d and done.built == bool(change)
    assert ((d / keymod.ENGINE_JSON).read_text() == before) == (not change)
    if change.get("num_slots"):
        assert json.loads((d / keymod.ENGINE_JSON).read_text())["limits"]["max_batch"] == 3


def test_damaged_or_stale_engine_of_the_same_settings_is_rebuilt_not_reused(engine_bundle):
    from lineside.build.tensorrt.builder import BuildOptions, ensure_built

    b = engine_bundle
    plan = _engine_dir(b) / keymod.ENGINE_FILE
    plan.write_bytes(plan.read_bytes()[:-1])
    assert ensure_built(b.path, BuildOptions(**OPTS), console=Console(file=io.StringIO())).built
    meta = json.loads((_engine_dir(b) / keymod.ENGINE_JSON).read_text())
    (_engine_dir(b) / keymod.ENGINE_JSON).write_text(json.dumps({**meta, keymod.CONTENT_FIELD: "0" * 64}))
    assert ensure_built(b.path, BuildOptions(**OPTS), console=Console(file=io.StringIO())).built
    assert keymod.has_engine_for(b.path, _here(), b.manifest)


def test_cli_engine_keeps_a_matching_engine_and_force_rebuilds_it(engine_bundle, monkeypatch, capsys):
    from lineside.cli import main

    b = engine_bundle
    d = _engine_dir(b)
    args = ["engine", str(b.path), "--slots", "2", "--max-prefill", "16"]
    with pytest.raises(SystemExit) as e:  # the fixture's engine has other past-length buckets: built
        main(args)
    assert e.value.code == 0 and f"engine written to {d}" in capsys.readouterr().out
    before = (d / keymod.ENGINE_JSON).read_text()
    with pytest.raises(SystemExit) as e:
        main(args)
    io_ = capsys.readouterr()
    assert e.value.code == 0 and f"engine kept in {d}" in io_.out and "(already built): using it" in io_.err
    assert (d / keymod.ENGINE_JSON).read_text() == before
    (d / keymod.ENGINE_JSON).write_text(json.dumps({**json.loads(before), "marker": "kept"}))  # a rebuild drops it
    before = (d / keymod.ENGINE_JSON).read_text()
    with pytest.raises(SystemExit) as e:
        main([*args, "--force"])
    assert e.value.code == 0 and f"engine written to {d}" in capsys.readouterr().out
    assert (d / keymod.ENGINE_JSON).read_text() != before


def test_ensure_engine_with_only_a_lora_engine_builds_the_base_one(engine_bundle, monkeypatch):
    from lineside.build.tensorrt.builder import BuildOptions, ensure_built
    from lineside.jetson import ensure_engine as eng

    b = engine_bundle
    lora = _make_base_engine_a_lora_one(b)
    built = []
    monkeypatch.setattr(eng.subprocess, "run", lambda cmd: built.append(
        ensure_built(b.path, BuildOptions(**OPTS), console=Console(file=io.StringIO())).built)
        or eng.subprocess.CompletedProcess(cmd, 0))
    assert eng.ensure_engine(b.path) == (True, _here().key) and built == [True]
    assert keymod.has_engine_for(b.path, _here(), b.manifest) and (lora / keymod.ENGINE_FILE).is_file()
