"""The verification record of a bundle that can't be written to (a read-only mount, another user's files): kept in
the per-user cache, so a restart hashes nothing, and never vouching for another bundle, another build or a file
changed since."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import lineside.bundle as bundle_mod
from lineside import checksum_cache
from lineside.bundle import MANIFEST, open_bundle, read_manifest
from lineside.errors import BundleError
from tests.test_bundle import flip_a_byte_keeping_mtime


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The bundle-relative names sha256_file hashed, in order."""
    seen: list[str] = []
    real = bundle_mod.sha256_file
    monkeypatch.setattr(bundle_mod, "sha256_file", lambda p: seen.append(p.name) or real(p))
    return seen


@pytest.fixture
def bundle(tiny_bundle, tmp_path, read_only) -> Path:
    out = tmp_path / "b"
    shutil.copytree(tiny_bundle, out, ignore=shutil.ignore_patterns(checksum_cache.NAME))
    return read_only(out)


def records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "user-cache" / checksum_cache.USER_FOLDER).glob("*.json"))


def test_read_only_bundle_is_hashed_once_not_on_every_open(bundle, tmp_path, hashed):
    open_bundle(bundle)
    assert len(hashed) == len(read_manifest(bundle).files)
    assert not (bundle / checksum_cache.NAME).exists() and len(records(tmp_path)) == 1
    open_bundle(bundle)
    assert len(hashed) == len(read_manifest(bundle).files)  # nothing hashed again


def test_a_changed_file_of_a_read_only_bundle_is_still_refused(bundle, hashed):
    open_bundle(bundle)
    data = bundle / "graphs/cpu/model.onnx.data"
    flip_a_byte_keeping_mtime(data)
    with pytest.raises(BundleError, match="model.onnx.data fails its sha256 check"):
        open_bundle(bundle)


def test_a_copy_or_a_new_build_in_place_keeps_a_record_of_its_own(bundle, tmp_path, hashed, read_only):
    open_bundle(bundle)
    copy = read_only(tmp_path / "copy")
    shutil.copytree(bundle, copy)
    open_bundle(copy)
    assert len(records(tmp_path)) == 2
    files = len(read_manifest(bundle).files)
    assert len(hashed) == 2 * files
    raw = json.loads((bundle / MANIFEST).read_text())  # a new build put where the old one was
    raw["model_name"] = "rebuilt"
    (bundle / MANIFEST).write_text(json.dumps(raw))
    open_bundle(bundle)
    assert len(hashed) == 3 * files and len(records(tmp_path)) == 3


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b'{"graphs/cpu/model.onnx.data": [0, 0, 0, 0, 0, "x"]}'])
def test_a_corrupt_record_is_hashed_again_never_trusted(bundle, tmp_path, hashed, damage):
    open_bundle(bundle)
    [record] = records(tmp_path)
    record.write_bytes(damage)
    open_bundle(bundle)
    assert len(hashed) == 2 * len(read_manifest(bundle).files)
    assert json.loads(record.read_text()).keys() == read_manifest(bundle).files.keys()  # written afresh


def test_no_writable_user_cache_hashes_every_open(bundle, tmp_path, hashed, monkeypatch):
    (tmp_path / "user-cache").write_text("not a folder")
    open_bundle(bundle)
    open_bundle(bundle)
    assert len(hashed) == 2 * len(read_manifest(bundle).files)


def test_a_writable_bundle_keeps_its_record_beside_its_files(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("LINESIDE_CACHE_DIR", str(tmp_path / "user-cache"))
    out = tmp_path / "b"
    shutil.copytree(tiny_bundle, out, ignore=shutil.ignore_patterns(checksum_cache.NAME))
    open_bundle(out)
    assert (out / checksum_cache.NAME).is_file() and not records(tmp_path)
