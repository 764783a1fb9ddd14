"""`lineside build` as a process on a workstation: the disk filling while it writes, its progress output where
stderr is not a terminal. What a user is left with after each is the bundle that was there or none."""

from __future__ import annotations

import errno
import os
import re
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


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but tab and newline: escapes, carriage returns


@pytest.mark.parametrize("env", [{}, {"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}],
                         ids=["plain", "FORCE_COLOR", "TTY_COMPATIBLE"])
def test_progress_in_a_log_is_plain_lines_and_quiet_is_silent(ckpt, tmp_path, env):
    """stderr to a file or a CI log: CI runners set FORCE_COLOR for coloured logs, which made rich take the log for
    a terminal, and every redraw of the bars went into it with cursor codes and carriage returns. Now a log gets a
    few plain lines per stage; --quiet gets nothing but the summary on stdout."""
    base = ["build", str(ckpt), "--quant", "w4a16", "--max-seq-len", "32"]
    run_env = {**_env(), **env}
    proc = subprocess.run([sys.executable, "-m", "lineside", *base, "-o", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=run_env)
    assert proc.returncode == 0, proc.stderr
    assert not CONTROL.search(proc.stderr), repr(proc.stderr[:300])
    # a tiny build's stages each last well under LOG_AFTER_S: no line at all (a longer one's: the test below)
    assert [ln for ln in proc.stderr.splitlines() if not ln.startswith("bundle written to ")] == [], proc.stderr
    quiet = subprocess.run([sys.executable, "-m", "lineside", *base, "-o", str(tmp_path / "b"), "--quiet"],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=run_env)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert quiet.stdout.startswith(f"{tmp_path / 'b'}: llama w4a16") and quiet.stdout.count("\n") == 1


def test_progress_lines_mark_start_quarters_and_end_with_the_injected_clock():
    """A long stage (80 layers) writes five lines, not eighty, once it has run LOG_AFTER_S; its end line times it on
    the clock given. A short stage writes none (its error, if it fails, is all of stderr)."""
    from lineside.build.progress import LOG_AFTER_S, line_progress

    said: list[str] = []
    t = [100.0]
    advance = line_progress(said.append, clock=lambda: t[0])("emit cpu graph", 80)
    for i in range(80):
        t[0] = 100.0 + (i + 1) * 0.25  # 20 s for the stage: the first line once 10 s have passed (layer 40)
        advance(1)
    advance(1)  # past the end: nothing more
    assert LOG_AFTER_S == 10.0
    assert said == ["emit cpu graph: 40/80", "emit cpu graph: 60/80", "emit cpu graph: 80/80 done in 20.0s"]
    said.clear()
    quick = line_progress(said.append, clock=lambda: t[0])("read checkpoint", 4)
    for _ in range(4):
        quick(1)
    assert said == []


def test_bars_only_on_an_interactive_terminal(tmp_path, monkeypatch):
    """The mode is chosen from the stream itself (a TTY) and rich's interactivity (TERM=dumb, TTY_INTERACTIVE)."""
    from rich.console import Console

    from lineside.build.progress import ProgressMode, progress_mode

    class Stream:
        def __init__(self, tty: bool):
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)
    term = Console(force_terminal=True, force_interactive=True)
    assert progress_mode(False, term, Stream(True)) is ProgressMode.BARS
    assert progress_mode(True, term, Stream(True)) is ProgressMode.NONE
    assert progress_mode(False, term, Stream(False)) is ProgressMode.LINES  # FORCE_COLOR over a log
    assert progress_mode(False, Console(force_terminal=True, force_interactive=False), Stream(True)) \
        is ProgressMode.LINES  # TERM=dumb, TTY_INTERACTIVE=0
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    assert progress_mode(False, term, Stream(False)) is ProgressMode.BARS  # asked for in so many words


@pytest.mark.parametrize("where", ["CHECKPOINT", "-o", "-o relative, in a non-UTF-8 cwd"])
def test_a_path_that_is_not_utf8_is_one_line_before_any_work(ckpt, tmp_path, where):
    """A directory named in Latin-1 (b'Mod\\xe8le'): as -o the build wrote the whole bundle, then onnx's checker
    died on the path with a TypeError traceback (onnxruntime could not have loaded it either); as the checkpoint,
    the tokenizer was called broken and to be re-downloaded."""
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/Mod\xe8le")
    os.mkdir(odd)
    ck, out, cwd = str(ckpt), str(tmp_path / "b"), str(REPO)
    if where == "CHECKPOINT":
        ck = os.path.join(odd, "ck")
        shutil.copytree(ckpt, ck)
    elif where == "-o":
        out = os.path.join(odd, "b")
    else:
        out, cwd = "b", odd
    before = tree_snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "lineside", "build", ck, "-o", out, "--max-seq-len", "16", "-q"],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env=_env())
    assert_one_line_error(proc, "not UTF-8", "Mod\\xe8le", "rename it", code=1)
    assert tree_snapshot(tmp_path) == before


def test_what_a_killed_build_left_is_refused_as_unfinished(ckpt, tmp_path):
    """SIGKILL (the OOM killer, a closed ssh session) mid-build leaves OUT.partial; `serve OUT.partial` said only
    "not a lineside bundle (rebuild it)", as if it were anything. It now says what it is and what to do."""
    from tests.cli.cli_run import run_cli

    half = tmp_path / "b.partial"
    (half / "graphs" / "cpu").mkdir(parents=True)
    (half / "graphs" / "cpu" / "model.onnx").write_bytes(b"\0" * 64)
    proc = run_cli("serve", str(half))
    assert_one_line_error(proc, "unfinished build", f"-o {tmp_path / 'b'}", code=1)
