"""onnxruntime's optimized graph cached beside a bundle's graph: used on later loads, same numbers, never in
the way (stale, corrupt, read-only, disabled)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from lineside.bundle import open_bundle
from lineside.runtime import ort_cache
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 5, 9, 2, 7, 3]


@pytest.fixture
def bundle(tiny_bundle, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(tiny_bundle, out, ignore=shutil.ignore_patterns(f"*{ort_cache.SUFFIX}"))
    return out


def caches(bundle) -> list:
    return sorted((bundle / "graphs" / "cpu").glob(f"*{ort_cache.SUFFIX}"))


def logits(be: OnnxRuntimeBackend) -> np.ndarray:
    be.reset_slot(0)
    first = be.forward(StepBatch.single(0, IDS, 0, all_logits=True))
    step = be.forward(StepBatch.single(0, [4], len(IDS)))
    return np.concatenate([first[0], step[0]])


def test_saved_then_loaded_with_the_same_logits(bundle, monkeypatch):
    monkeypatch.setenv(ort_cache.ENV_DISABLE, "0")
    plain = OnnxRuntimeBackend(open_bundle(bundle))
    assert plain.session_source == "plain" and not caches(bundle)
    monkeypatch.delenv(ort_cache.ENV_DISABLE)
    first = OnnxRuntimeBackend(open_bundle(bundle))
    assert first.session_source == "saved"
    [cached] = caches(bundle)
    # the cached graph reads the bundle's own weights: kilobytes, not a copy of the data file
    assert cached.stat().st_size < (bundle / "graphs" / "cpu" / "model.onnx").stat().st_size * 4
    locations = {e.value for t in onnx.load(str(cached), load_external_data=False).graph.initializer
                 for e in t.external_data if e.key == "location"}
    assert locations <= {"model.onnx.data"}
    assert not [p for p in cached.parent.iterdir() if p.name.endswith((".tmp.onnx", ".tmp.onnx.data"))]
    second = OnnxRuntimeBackend(open_bundle(bundle))
    assert second.session_source == "cache"
    ref = logits(plain)
    np.testing.assert_array_equal(logits(first), ref)
    np.testing.assert_allclose(logits(second), ref, rtol=0, atol=1e-6)


def test_corrupt_cache_is_replaced(bundle):
    OnnxRuntimeBackend(open_bundle(bundle))
    [cached] = caches(bundle)
    cached.write_bytes(b"not a model")
    be = OnnxRuntimeBackend(open_bundle(bundle))
    assert be.session_source == "saved" and caches(bundle) == [cached] and cached.stat().st_size > 100


def test_a_new_key_keeps_the_newest_other_caches_only(bundle, monkeypatch):
    import os

    OnnxRuntimeBackend(open_bundle(bundle))
    [old] = caches(bundle)
    be = OnnxRuntimeBackend(open_bundle(bundle), accuracy_level=0)  # a setting that changes the optimized graph
    assert be.session_source == "saved"
    [new] = [p for p in caches(bundle) if p != old]
    # switched back (an A/B run): the first setting's cache is still there and loads
    assert OnnxRuntimeBackend(open_bundle(bundle)).session_source == "cache"
    # past KEEP_OTHERS other keys the oldest go (each settings' cache is its own name: fakes stand for more)
    for i, age in enumerate((300, 200, 100)):
        fake = old.with_name(old.name.replace(old.name.split(".")[-3], f"{i:016x}"))
        fake.write_bytes(old.read_bytes())
        os.utime(fake, (old.stat().st_mtime - age,) * 2)
    os.utime(new, (old.stat().st_mtime - 50,) * 2)
    (bundle / "graphs" / "cpu" / old.name).unlink()  # the current key's cache is saved again
    assert OnnxRuntimeBackend(open_bundle(bundle)).session_source == "saved"
    assert {p.name for p in caches(bundle)} == {old.name, new.name, old.name.replace(old.name.split(".")[-3],
                                                                                     f"{2:016x}")}


def test_unwritable_bundle_runs_without_cache(bundle, monkeypatch, caplog):
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ort_cache.tempfile, "mkstemp", refuse)  # what a read-only bundle directory answers
    with caplog.at_level("WARNING", logger="lineside.runtime"):
        be = OnnxRuntimeBackend(open_bundle(bundle))
    assert be.session_source == "plain" and not caches(bundle)
    assert logits(be).shape[0] == len(IDS) + 1
    # one line per graph saying why every start optimizes again, and what to do
    [line] = [r.getMessage() for r in caplog.records if "no onnxruntime graph cache" in r.getMessage()]
    assert "Permission denied" in line and "make the bundle directory writable" in line


def test_key_covers_version_graph_and_settings():
    k = ort_cache.cache_key("1.32.0", "a" * 64, {"x": "1"})
    assert len({k, ort_cache.cache_key("1.33.0", "a" * 64, {"x": "1"}),
                ort_cache.cache_key("1.32.0", "b" * 64, {"x": "1"}),
                ort_cache.cache_key("1.32.0", "a" * 64, {"x": "0"})}) == 4


def test_temporary_copies_a_killed_start_left_are_removed(bundle):
    """A start killed while onnxruntime wrote its optimized graph (SIGKILL, the OOM killer, a unit's start
    timeout) left the temporary graph and its data file — as large as the weights — in the bundle, one pair per
    killed start, until the disk was full. The next start that writes a cache removes them; a copy another
    process is writing now (it holds a lock on it) is left alone."""
    import fcntl
    import os

    cpu = bundle / "graphs" / "cpu"
    for tag in ("abandon1", "writing2"):
        (cpu / f".model.onnx.{tag}.tmp.onnx").write_bytes(b"half a graph")
        (cpu / f".model.onnx.{tag}.tmp.onnx.data").write_bytes(b"\0" * 4096)
    other = cpu / ".model.onnx.writing2.tmp.onnx"
    fd = os.open(other, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a start still writing it holds it
        assert OnnxRuntimeBackend(open_bundle(bundle)).session_source == "saved"
    finally:
        os.close(fd)
    left = sorted(p.name for p in cpu.iterdir() if ".tmp.onnx" in p.name)
    assert left == [".model.onnx.writing2.tmp.onnx", ".model.onnx.writing2.tmp.onnx.data"]


def _flip_inline_norm_weight(cached) -> None:
    """Change one bit of a norm weight the cached graph holds inline (below onnxruntime's external-data size): what a
    bad sector or a broken copy does to the file; the result still parses."""
    model = onnx.load(str(cached), load_external_data=False)
    norm = next(t for t in model.graph.initializer
                if t.data_location != onnx.TensorProto.EXTERNAL and "norm" in t.name and len(t.raw_data) >= 16)
    data = cached.read_bytes()
    at = data.index(norm.raw_data) + 2  # a float32's high mantissa byte: the weight moves, it stays finite
    cached.write_bytes(data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:])


def test_cache_changed_on_disk_is_rebuilt_not_run(bundle):
    """A cache whose inline tensors changed still loads in onnxruntime and gives other answers (a norm weight bit:
    logits moved 0.11 on a tiny W4A16 bundle); the bundle's files are checksummed, so the cache is sealed too."""
    import onnxruntime as ort

    ref = logits(OnnxRuntimeBackend(open_bundle(bundle)))
    [cached] = caches(bundle)
    _flip_inline_norm_weight(cached)
    ort.InferenceSession(str(cached), providers=["CPUExecutionProvider"])  # the damage alone is not a load error
    be = OnnxRuntimeBackend(open_bundle(bundle))
    assert be.session_source == "saved"
    np.testing.assert_allclose(logits(be), ref, rtol=0, atol=1e-6)
    assert OnnxRuntimeBackend(open_bundle(bundle)).session_source == "cache"  # the rebuilt one is used again


def test_cache_under_another_key_is_not_loaded(bundle):
    """A cache put under another key's name (written with other settings, renamed or copied by hand) is rebuilt:
    its name says which settings it was optimized for, its seal says which it was."""
    OnnxRuntimeBackend(open_bundle(bundle))
    [default] = caches(bundle)
    written_for_default = default.read_bytes()
    OnnxRuntimeBackend(open_bundle(bundle), accuracy_level=0)
    [level0] = [p for p in caches(bundle) if p != default]
    level0.write_bytes(written_for_default)
    assert OnnxRuntimeBackend(open_bundle(bundle), accuracy_level=0).session_source == "saved"


def test_unwritable_bundle_says_so_once_for_all_its_graphs(tiny_bundles, tmp_path, monkeypatch, caplog):
    """A read-only bundle (a read-only mount, another user's files) is served without a cache; a W4A16 bundle opens
    two graphs from one folder (the 4-bit graph and its int8 prefill graph), and that is still one line."""
    out = tmp_path / "w4"
    shutil.copytree(tiny_bundles(quant="w4a16", group_size=32), out,
                    ignore=shutil.ignore_patterns(f"*{ort_cache.SUFFIX}"))

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(ort_cache.tempfile, "mkstemp", refuse)
    with caplog.at_level("INFO", logger="lineside.runtime"):
        be = OnnxRuntimeBackend(open_bundle(out))
        assert be.prefill_session is not None  # both graphs opened
        OnnxRuntimeBackend(open_bundle(out))  # a second backend in this process (draft, adapters): said already
    lines = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(lines) == 1, lines
    assert str(out / "graphs" / "cpu") in lines[0] and "Read-only file system" in lines[0]


def user_caches(tmp_path) -> list:
    return sorted((tmp_path / "user-cache" / ort_cache.USER_FOLDER).glob(f"*{ort_cache.SUFFIX}"))


def test_read_only_bundle_caches_in_the_user_cache_with_the_same_logits(bundle, read_only, tmp_path, caplog,
                                                                        monkeypatch):
    """A bundle on read-only storage optimized its graphs on every start; its cache now lives in the per-user cache
    and reads the bundle's own weights (kilobytes), with the logits of the plain graph."""
    read_only(bundle)
    monkeypatch.setenv(ort_cache.ENV_DISABLE, "0")
    plain = OnnxRuntimeBackend(open_bundle(bundle))
    monkeypatch.delenv(ort_cache.ENV_DISABLE)
    with caplog.at_level("INFO", logger="lineside.runtime"):
        first = OnnxRuntimeBackend(open_bundle(bundle))
    assert first.session_source == "saved" and not caches(bundle)
    [cached] = user_caches(tmp_path)
    assert cached.stat().st_size < (bundle / "graphs" / "cpu" / "model.onnx").stat().st_size * 4
    assert not [p for p in cached.parent.iterdir() if p.name.endswith((".tmp.onnx", ".tmp.onnx.data"))]
    assert any(str(cached.parent) in r.getMessage() and r.levelname == "INFO" for r in caplog.records)
    second = OnnxRuntimeBackend(open_bundle(bundle))
    assert second.session_source == "cache"
    np.testing.assert_allclose(logits(second), logits(first), rtol=0, atol=1e-6)
    np.testing.assert_allclose(logits(second), logits(plain), rtol=0, atol=1e-5)


def test_user_cache_is_shared_by_copies_but_not_by_another_build(bundle, tiny_bundles, read_only, tmp_path):
    """A copy at another path has the same graph bytes and reads its own weights: it uses the entry. A different
    build put where the first was (a new graph sha) never loads the first one's entry."""
    read_only(bundle)
    OnnxRuntimeBackend(open_bundle(bundle))
    copy = read_only(tmp_path / "copy")
    shutil.copytree(bundle, copy)
    be = OnnxRuntimeBackend(open_bundle(copy))
    assert be.session_source == "cache"
    shutil.rmtree(bundle)  # the entry reads the copy's weights, not the first bundle's
    np.testing.assert_array_equal(logits(be), logits(OnnxRuntimeBackend(open_bundle(copy))))
    shutil.copytree(tiny_bundles(max_seq_len=128), bundle, ignore=shutil.ignore_patterns(f"*{ort_cache.SUFFIX}"))
    other = OnnxRuntimeBackend(open_bundle(bundle))
    assert other.session_source == "saved" and len(user_caches(tmp_path)) == 2
    assert OnnxRuntimeBackend(open_bundle(bundle)).session_source == "cache"


def test_corrupt_user_cache_entry_is_rebuilt_not_run(bundle, read_only, tmp_path):
    read_only(bundle)
    OnnxRuntimeBackend(open_bundle(bundle))
    [cached] = user_caches(tmp_path)
    raw = bytearray(cached.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # a flipped bit that may still load: the seal says no
    cached.write_bytes(bytes(raw))
    be = OnnxRuntimeBackend(open_bundle(bundle))
    assert be.session_source == "saved" and user_caches(tmp_path) == [cached] and cached.read_bytes() != bytes(raw)


@pytest.mark.parametrize("where", ["a file", "unset home"])
def test_no_writable_user_cache_runs_plain_in_one_line(bundle, read_only, tmp_path, monkeypatch, caplog, where):
    read_only(bundle)
    if where == "a file":
        (tmp_path / "user-cache").write_text("not a folder")
    else:  # no LINESIDE_CACHE_DIR, XDG_CACHE_HOME nor a home to find
        monkeypatch.delenv("LINESIDE_CACHE_DIR")
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    monkeypatch.setattr(ort_cache, "_unwritable_said", set())
    with caplog.at_level("WARNING"):
        be = OnnxRuntimeBackend(open_bundle(bundle))
    assert be.session_source == "plain"
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said and all("\n" not in m for m in said) and "LINESIDE_CACHE_DIR" in said[-1], said
