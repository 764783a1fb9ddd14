"""`lineside build` as a process on a workstation: the disk filling while it writes, its progress output where
stderr is not a terminal. What a user is left with after each is the bundle that was there or none."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.errors import LinesideError
from tests.cli.cli_run import REPO, assert_one_line_error, tree_snapshot


@pytest.fixture(scope="module")
def ckpt(tiny_dense):
    return tiny_dense("llama-gqa")


def _tmpfs_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


# size of the tmpfs → where the build ran out of room in it: the tokenizer's copy (whose error named the
# checkpoint's file, as if that were broken) or the graph's weights (whose error named no file at all)
TMPFS_SIZES = {"4k": "tokenizer copy", "100k": "graph weights"}


@pytest.mark.parametrize("size", TMPFS_SIZES, ids=list(TMPFS_SIZES.values()))
def test_a_disk_that_fills_during_the_build_is_one_line_naming_it_and_leaves_nothing(ckpt, tmp_path, size):
    if not _tmpfs_available():
        pytest.skip("no user namespace to mount a small tmpfs in (unshare -rm)")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f'mount -t tmpfs -o size={size} tmpfs "$1" || exit 99; shift; '
              f'"$@"; rc=$?; ls -A "$DISK"; exit $rc')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), sys.executable, "-m", "lineside",
                           "build", str(ckpt), "-o", str(disk / "out"), "--max-seq-len", "32", "-q"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**_env(), "DISK": str(disk)})
    assert proc.returncode != 99, proc.stderr
    assert_one_line_error(proc, "no space left", f"in {disk} ", "partial bundle was removed", "df -h", code=1)
    assert str(ckpt) not in proc.stderr  # the checkpoint is not what is wrong
    assert proc.stdout == ""  # the tmpfs was empty afterwards (listed inside the namespace): no out, no out.partial


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_a_disk_that_fills_under_force_keeps_the_old_bundle_and_says_so(ckpt, tmp_path, monkeypatch):
    """Where no tmpfs can be mounted: the graph's data file hits ENOSPC (as a full disk makes it) in a --force
    build over a bundle; the line says the old bundle is kept and that --force needs room for both."""
    import lineside.build.graph.builder as builder

    out = tmp_path / "b"
    opts = BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16, force=True)
    build_bundle(ckpt, out, opts)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real = builder.GraphBuilder.raw_weight

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # what the data file's write raises on a full disk

    monkeypatch.setattr(builder.GraphBuilder, "raw_weight", full_disk)
    with pytest.raises(LinesideError) as e:
        build_bundle(ckpt, out, opts)
    monkeypatch.setattr(builder.GraphBuilder, "raw_weight", real)
    line = str(e.value)
    assert "\n" not in line and "No space left on device" in line and str(tmp_path) in line
    assert "bundle that was there is kept" in line and "room for both" in line
    assert tree_snapshot(tmp_path) == {str(p.relative_to(tmp_path)) for p in [out, *out.rglob("*")]}
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
