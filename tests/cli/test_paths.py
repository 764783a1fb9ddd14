"""Every path option of every command, through the real command line: a missing parent, a file where a
directory is expected (or the reverse), an unwritable place, an existing output. Each is one line on
stderr naming the option and what to do, exit 1, checked before any work, and nothing is left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from tests.cli.cli_run import (
    REPO,
    all_commands,
    assert_one_line_error,
    base_type,
    lineside_app,
    run_cli,
    tree_snapshot,
)

UNWRITABLE = Path("/proc/lineside-test")  # /proc takes no new files, even from root (os.access would say yes)


@pytest.fixture(scope="module")
def ckpt(tiny_dense):
    return tiny_dense("llama-gqa")


@pytest.fixture(scope="module")
def bundle(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("pb") / "bundle"
    build_bundle(ckpt, out, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    return out


@pytest.fixture
def ws(tmp_path):
    """A workspace with a regular file and a non-empty directory in it."""
    w = tmp_path / "ws"
    w.mkdir()
    (w / "afile").write_text("not a directory\n")
    (w / "full").mkdir()
    (w / "full" / "keep.txt").write_text("keep me\n")
    (w / "link").symlink_to(w / "full")
    return w


# (case id, command, argv builder(ckpt, bundle, ws) -> argv, words the line must contain)
OUTPUT_CASES = [
    ("build -o missing-parent", "build", lambda c, b, w: ["build", c, "-o", w / "no/such/out"], ["does not exist", "mkdir -p"]),
    ("build -o under-a-file", "build", lambda c, b, w: ["build", c, "-o", w / "afile/out"], ["afile", "is a file"]),
    ("build -o is-a-file", "build", lambda c, b, w: ["build", c, "-o", w / "afile"], ["-o", "is a file"]),
    ("build -o unwritable", "build", lambda c, b, w: ["build", c, "-o", UNWRITABLE], ["cannot write"]),
    ("build -o existing", "build", lambda c, b, w: ["build", c, "-o", w / "full"], ["not empty", "--force"]),
    ("build -o not-a-bundle --force", "build", lambda c, b, w: ["build", c, "-o", w / "full", "--force"], ["not a lineside bundle", "remove it yourself"]),
    ("build -o a-symlink --force", "build", lambda c, b, w: ["build", c, "-o", w / "link", "--force"], ["symbolic link", "full"]),
    ("build -o the-checkpoint --force", "build", lambda c, b, w: ["build", c, "-o", c, "--force"], ["would replace", "checkpoint"]),
    ("build -o above-the-calib --force", "build", lambda c, b, w: ["build", c, "-o", w, "--force", "--calib", w / "afile"], ["would replace", "--calib"]),
    ("logits -o missing-parent", "logits", lambda c, b, w: ["logits", b, "--ids", "1,2", "-o", w / "no/x.npy"], ["does not exist"]),
    ("logits -o under-a-file", "logits", lambda c, b, w: ["logits", b, "--ids", "1,2", "-o", w / "afile/x.npy"], ["is a file"]),
    ("logits -o is-a-dir", "logits", lambda c, b, w: ["logits", b, "--ids", "1,2", "-o", w / "full"], ["is a directory"]),
    ("logits -o unwritable", "logits", lambda c, b, w: ["logits", b, "--ids", "1,2", "-o", UNWRITABLE], ["cannot write"]),
    ("serve --latency-log missing-parent", "serve", lambda c, b, w: ["serve", b, "--latency-log", w / "no/l.jsonl"], ["--latency-log", "does not exist"]),
    ("serve --latency-log is-a-dir", "serve", lambda c, b, w: ["serve", b, "--latency-log", w / "full"], ["--latency-log", "is a directory"]),
    ("serve --latency-log unwritable", "serve", lambda c, b, w: ["serve", b, "--latency-log", UNWRITABLE], ["cannot write"]),
    ("bench --out is-a-file", "bench", lambda c, b, w: ["bench", "--bundle", b, "--out", w / "afile"], ["--out", "is a file"]),
    ("bench --out missing-parent", "bench", lambda c, b, w: ["bench", "--bundle", b, "--out", w / "no/r"], ["--out", "does not exist"]),
    ("bench --out under-a-file", "bench", lambda c, b, w: ["bench", "--url", "http://127.0.0.1:9", "--out", w / "afile/r"], ["is a file"]),
    ("bench --out unwritable", "bench", lambda c, b, w: ["bench", "--bundle", b, "--out", UNWRITABLE], ["cannot write"]),
    ("bench --out existing", "bench", lambda c, b, w: ["bench", "--bundle", b, "--out", w / "full"], ["not empty", "--force"]),
    ("bench --out the-bundle --force", "bench", lambda c, b, w: ["bench", "--bundle", b, "--out", b, "--force"], ["would replace", "--bundle"]),
    ("jetson push TARGET missing-parent", "jetson push", lambda c, b, w: ["jetson", "push", b, w / "no/t"], ["TARGET", "does not exist"]),
    ("jetson push TARGET is-a-file", "jetson push", lambda c, b, w: ["jetson", "push", b, w / "afile"], ["TARGET", "is a file"]),
    ("jetson push TARGET unwritable", "jetson push", lambda c, b, w: ["jetson", "push", b, UNWRITABLE], ["cannot write"]),
    ("fleet gateway -o missing-parent", "fleet gateway", lambda c, b, w: ["fleet", "gateway", w / "afile", "-o", w / "no/g", "--dry-run"], ["--output", "does not exist"]),
    ("fleet gateway -o is-a-file", "fleet gateway", lambda c, b, w: ["fleet", "gateway", w / "afile", "-o", w / "afile", "--dry-run"], ["--output", "is a file"]),
    ("deploy datacenter -o is-a-file", "deploy datacenter", lambda c, b, w: ["deploy", "datacenter", "deepseek-v4-flash", "--gpus", "8xH200", "--engine", "vllm", "-o", w / "afile"], ["--output", "is a file"]),
    ("deploy datacenter -o unwritable", "deploy datacenter", lambda c, b, w: ["deploy", "datacenter", "deepseek-v4-flash", "--gpus", "8xH200", "--engine", "vllm", "-o", UNWRITABLE], ["cannot write"]),
    ("jetson service -o missing-parent", "jetson service", lambda c, b, w: ["jetson", "service", "-o", w / "no/u.service"], ["does not exist"]),
    ("jetson service -o under-a-file", "jetson service", lambda c, b, w: ["jetson", "service", "-o", w / "afile/u"], ["is a file"]),
    ("jetson service -o unwritable", "jetson service", lambda c, b, w: ["jetson", "service", "-o", UNWRITABLE], ["cannot write"]),
]

INPUT_CASES = [
    ("build CHECKPOINT missing", "build", lambda c, b, w: ["build", w / "nope", "-o", w / "o"], ["nope"]),
    ("build --calib missing", "build", lambda c, b, w: ["build", c, "-o", w / "o", "--calib", w / "nope.txt"], ["--calib"]),
    ("build --calib is-a-dir", "build", lambda c, b, w: ["build", c, "-o", w / "o", "--calib", w / "full"], ["--calib", "directory"]),
    ("logits BUNDLE missing", "logits", lambda c, b, w: ["logits", w / "nope", "--ids", "1", "-o", w / "x.npy"], ["nope"]),
    ("logits BUNDLE is-a-file", "logits", lambda c, b, w: ["logits", w / "afile", "--ids", "1", "-o", w / "x.npy"], ["afile"]),
    ("generate BUNDLE missing", "generate", lambda c, b, w: ["generate", w / "nope", "--prompt", "hi"], ["nope"]),
    ("generate BUNDLE not-a-bundle", "generate", lambda c, b, w: ["generate", w / "full", "--prompt", "hi"], ["manifest"]),
    ("chat BUNDLE missing", "chat", lambda c, b, w: ["chat", w / "nope"], ["nope"]),
    ("chat --system-file missing", "chat", lambda c, b, w: ["chat", b, "--system-file", w / "nope"], ["--system-file", "no such file"]),
    ("chat --system-file is-a-dir", "chat", lambda c, b, w: ["chat", b, "--system-file", w / "full"], ["--system-file", "is a directory"]),
    ("generate --system-file under-a-file", "generate", lambda c, b, w: ["generate", b, "--chat", "--prompt", "hi", "--system-file", w / "afile/x"], ["--system-file", "cannot read"]),
    ("serve BUNDLE missing", "serve", lambda c, b, w: ["serve", w / "nope"], ["nope"]),
    ("serve --api-key-file missing", "serve", lambda c, b, w: ["serve", b, "--api-key-file", w / "key"], ["--api-key-file"]),
    ("serve --api-key-file is-a-dir", "serve", lambda c, b, w: ["serve", b, "--api-key-file", w / "full"], ["--api-key-file", "directory"]),
    ("serve --slo-policy missing", "serve", lambda c, b, w: ["serve", b, "--slo-policy", w / "p.yaml"], ["--slo-policy"]),
    ("serve --fallback is-a-file", "serve", lambda c, b, w: ["serve", b, "--fallback", w / "afile"], ["--fallback"]),
    ("engine BUNDLE missing", "engine", lambda c, b, w: ["engine", w / "nope"], ["nope"]),
    ("check BUNDLE missing", "check", lambda c, b, w: ["check", w / "nope"], ["nope"]),
    ("check BUNDLE is-a-file", "check", lambda c, b, w: ["check", w / "afile"], ["afile"]),
    ("bench --bundle missing", "bench", lambda c, b, w: ["bench", "--bundle", w / "nope"], ["--bundle", "nope"]),
    ("bench --bundle is-a-file", "bench", lambda c, b, w: ["bench", "--bundle", w / "afile"], ["--bundle", "afile"]),
    ("bench --prompts-file missing", "bench", lambda c, b, w: ["bench", "--url", "http://127.0.0.1:9", "--prompts-file", w / "p.jsonl"], ["--prompts-file"]),
    ("bench --tokenizer is-a-dir", "bench", lambda c, b, w: ["bench", "--url", "http://127.0.0.1:9", "--tokenizer", w / "full"], ["--tokenizer"]),
    ("bench --compare missing", "bench", lambda c, b, w: ["bench", "--compare", w / "a.json", w / "b.json"], ["a.json"]),
    ("fleet check FLEET_FILE missing", "fleet check", lambda c, b, w: ["fleet", "check", w / "fleet.yaml"], ["fleet.yaml"]),
    ("fleet plan FLEET_FILE is-a-dir", "fleet plan", lambda c, b, w: ["fleet", "plan", w / "full"], ["full", "directory"]),
    ("fleet push FLEET_FILE missing", "fleet push", lambda c, b, w: ["fleet", "push", w / "fleet.yaml"], ["fleet.yaml"]),
    ("fleet gateway FLEET_FILE missing", "fleet gateway", lambda c, b, w: ["fleet", "gateway", w / "fleet.yaml", "--dry-run", "-o", w / "g"], ["fleet.yaml"]),
    ("fleet status FLEET_FILE missing", "fleet status", lambda c, b, w: ["fleet", "status", w / "fleet.yaml"], ["fleet.yaml"]),
    ("jetson plan MODEL missing", "jetson plan", lambda c, b, w: ["jetson", "plan", w / "nope", "--device", "agx-orin-64"], ["nope"]),
    ("jetson push BUNDLE missing", "jetson push", lambda c, b, w: ["jetson", "push", w / "nope", w / "t"], ["nope"]),
    ("jetson ensure-engine BUNDLE missing", "jetson ensure-engine", lambda c, b, w: ["jetson", "ensure-engine", w / "nope"], ["nope"]),
    ("jetson probe --sysroot missing", "jetson probe", lambda c, b, w: ["jetson", "probe", "--sysroot", w / "nope"], ["--sysroot"]),
    ("jetson power --sysroot is-a-file", "jetson power", lambda c, b, w: ["jetson", "power", "--sysroot", w / "afile"], ["--sysroot"]),
    ("jetson service --sysroot missing", "jetson service", lambda c, b, w: ["jetson", "service", "--sysroot", w / "nope"], ["--sysroot"]),
    ("lora add BUNDLE missing", "lora add", lambda c, b, w: ["lora", "add", w / "nope", w / "full", "--name", "a"], ["BUNDLE", "nope"]),
    ("lora add ADAPTER_DIR is-a-file", "lora add", lambda c, b, w: ["lora", "add", b, w / "afile", "--name", "a"], ["ADAPTER_DIR", "afile"]),
    ("lora list BUNDLE is-a-file", "lora list", lambda c, b, w: ["lora", "list", w / "afile"], ["BUNDLE", "afile"]),
]


def _run(case, ckpt, bundle, ws):
    _id, _cmd, argv, needles = case
    before = tree_snapshot(ws)
    proc = run_cli(*(str(a) for a in argv(ckpt, bundle, ws)))
    assert_one_line_error(proc, *needles, code=1)
    assert tree_snapshot(ws) == before, "a failed command left something behind"
    assert not UNWRITABLE.exists()
    return proc


@pytest.mark.parametrize("case", OUTPUT_CASES, ids=[c[0] for c in OUTPUT_CASES])
def test_output_paths_are_checked_before_work(case, ckpt, bundle, ws):
    _run(case, ckpt, bundle, ws)


@pytest.mark.parametrize("case", INPUT_CASES, ids=[c[0] for c in INPUT_CASES])
def test_input_paths_are_one_line(case, ckpt, bundle, ws):
    proc = _run(case, ckpt, bundle, ws)  # one stderr line naming the path, exit 1, nothing left behind
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1


def test_every_path_option_is_covered_here():
    """A command that grows a path option must get its cases above (this fails until it does)."""
    covered = {(c[1], str(tok)) for c in OUTPUT_CASES + INPUT_CASES
               for tok in c[2]("C", "B", Path("W")) if str(tok).startswith("-")}
    covered_cmds = {c[1] for c in OUTPUT_CASES + INPUT_CASES}
    missing = []
    for name, cmd in all_commands(lineside_app()).items():
        for p in cmd.params:
            if base_type(p) is not Path:
                continue
            if p.param_type_name == "argument":
                if name not in covered_cmds:
                    missing.append(f"{name} {p.name.upper()}")
            elif not any((name, o) in covered for o in p.opts):
                missing.append(f"{name} {p.opts[0]}")
    assert not missing, missing


def _bundle_at(bundle: Path, ws: Path, name: str = "full") -> Path:
    """``ws/name`` made a bundle (a copy of ``bundle``) holding also a file of the user's (keep.txt)."""
    shutil.rmtree(ws / name, ignore_errors=True)
    shutil.copytree(bundle, ws / name)
    (ws / name / "keep.txt").write_text("keep me\n")
    return ws / name


def test_force_replaces_only_once_the_new_bundle_is_complete(ckpt, bundle, ws):
    _bundle_at(bundle, ws)
    proc = run_cli("build", str(ckpt), "-o", str(ws / "full"), "--quant", "fp32", "--max-seq-len", "16", "-q",
                   "--force")
    assert proc.returncode == 0, proc.stderr
    assert (ws / "full" / "manifest.json").is_file() and not (ws / "full" / "keep.txt").exists()
    assert not list(ws.glob("*.partial"))


# A directory of the user's own named by mistake: --force replaced it with a bundle, deleting whatever it held.
NOT_BUNDLES = {
    "plain files": {"thesis.txt": "years of work\n"},
    "another tool's manifest.json": {"manifest.json": '{"name": "my web app", "icons": []}', "index.html": "<p>"},
    "a manifest.json that is not JSON": {"manifest.json": "not json", "notes.txt": "mine"},
}


@pytest.mark.parametrize("kind", NOT_BUNDLES, ids=list(NOT_BUNDLES))
def test_force_never_replaces_a_directory_that_is_not_a_bundle(ckpt, tmp_path, kind):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in NOT_BUNDLES[kind].items():
        (mine / name).write_text(text)
    before = tree_snapshot(tmp_path)
    proc = run_cli("build", str(ckpt), "-o", str(mine), "--quant", "fp32", "--max-seq-len", "16", "-q", "--force")
    assert_one_line_error(proc, "not a lineside bundle", "--force", str(mine), code=1)
    with pytest.raises(LinesideError, match="not a lineside bundle"):  # the library call refuses it too
        build_bundle(ckpt, mine, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16, force=True))
    assert tree_snapshot(tmp_path) == before
    assert all((mine / n).read_text() == t for n, t in NOT_BUNDLES[kind].items())


def test_force_replaces_a_bundle_whose_manifest_is_damaged(ckpt, bundle, ws):
    """A bundle is still one when its manifest.json was truncated: --force rebuilds it rather than refusing."""
    old = _bundle_at(bundle, ws)
    (old / "manifest.json").write_text('{"architecture": "lla')
    build_bundle(ckpt, old, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16, force=True))
    assert not (old / "keep.txt").exists() and open_bundle(old).architecture == "llama"


def test_build_into_an_existing_empty_directory(ckpt, ws):
    (ws / "empty").mkdir()
    proc = run_cli("build", str(ckpt), "-o", str(ws / "empty"), "--quant", "fp32", "--max-seq-len", "16", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (ws / "empty" / "manifest.json").is_file()


def test_copy_of_bundle_keeps_working(bundle, tmp_path):
    """Sanity for the fixtures above: the bundle the cases point at is a real one (so they test the checks)."""
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    proc = run_cli("logits", str(b), "--ids", "1,2", "-o", str(tmp_path / "x.npy"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("rel", [".", ".."])
def test_build_into_dot_or_dotdot(ckpt, bundle, ws, rel):
    """`-o .` / `-o ..` name a directory like any other (they crashed on an empty name, or staged the new bundle
    inside the directory --force then deleted, leaving neither)."""
    _bundle_at(bundle, ws)
    cwd = ws / "full" if rel == "." else ws / "full" / "sub"
    cwd.mkdir(exist_ok=True)
    proc = run_cli("build", str(ckpt), "-o", rel, "--quant", "fp32", "--max-seq-len", "16", "-q", "--force", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert (ws / "full" / "manifest.json").is_file() and not (ws / "full" / "keep.txt").exists()
    assert sorted(p.name for p in ws.iterdir()) == ["afile", "full", "link"]  # no .partial, nothing set aside


# A build that gets SIGTERM (`kill`, `timeout`, systemd) once its bundle is written but before it is put in place.
SIGTERM_BUILD = """
import signal, sys
import lineside.build.pipeline as pipeline
write = pipeline._write_bundle
def write_then_sigterm(*args, **kwargs):
    write(*args, **kwargs)
    signal.raise_signal(signal.SIGTERM)  # its Python handler runs as this call returns
pipeline._write_bundle = write_then_sigterm
from lineside.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "over-a-bundle"])
def test_sigterm_during_build_leaves_nothing_and_keeps_the_old_bundle(ckpt, bundle, ws, existing):
    out = ws / "b"
    if existing:
        shutil.copytree(bundle, out)
    before = tree_snapshot(ws)
    proc = subprocess.run([sys.executable, "-c", SIGTERM_BUILD, "build", str(ckpt), "-o", str(out), "--quant", "fp32",
                           "--max-seq-len", "16", "-q", "--force"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert_one_line_error(proc, "interrupted", "SIGTERM", code=128 + signal.SIGTERM)
    assert tree_snapshot(ws) == before  # no b.partial; a bundle that was there is there as it was
    if existing:
        assert run_cli("logits", str(out), "--ids", "1,2", "-o", str(ws / "x.npy")).returncode == 0


def test_ctrl_c_during_build_is_one_line_and_leaves_nothing(ckpt, ws):
    """Ctrl-C (SIGINT) mid-build: typer turns the KeyboardInterrupt into exit 130 and printed nothing at all."""
    out = ws / "b"
    before = tree_snapshot(ws)
    proc = subprocess.run([sys.executable, "-c", SIGTERM_BUILD.replace("SIGTERM", "SIGINT"), "build", str(ckpt), "-o",
                           str(out), "--quant", "fp32", "--max-seq-len", "16", "-q"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert_one_line_error(proc, "interrupted", code=128 + signal.SIGINT)
    assert tree_snapshot(ws) == before  # no b.partial


def test_replace_dir_puts_the_old_directory_back_when_the_new_one_cannot_go_in(tmp_path, monkeypatch):
    from lineside.cli_checks import replace_dir

    old, new = tmp_path / "out", tmp_path / "out.partial"
    old.mkdir()
    (old / "keep.txt").write_text("old")
    new.mkdir()
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == new:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        replace_dir(new, old)
    assert (old / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_second_build_into_the_same_output_is_refused_while_the_first_runs(ckpt, tmp_path, monkeypatch):
    """Two builds into one -o at once: the second removed the first's OUT.partial and staged its own there; the
    first went on writing into a directory that was gone or was the second's, and both said they succeeded,
    leaving a bundle without its tokenizer that every check accepted. The second is now refused, the first
    finishes whole."""
    import lineside.build.pipeline as pipeline
    from lineside.bundle import open_bundle
    from lineside.errors import LinesideError

    out = tmp_path / "b"
    opts = BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16, force=True)
    write, second = pipeline._write_bundle, []

    def write_while_another_build_starts(ckpt_reader, *args, **kwargs):
        if not second:  # the first build is under way: its tokenizer is written (tmp is args[-4])
            second.append("started")
            ckpt_reader.write_tokenizer(args[-4] / "tokenizer")
            try:
                build_bundle(ckpt, out, opts)
            except LinesideError as e:
                second[0] = str(e)
        write(ckpt_reader, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_write_bundle", write_while_another_build_starts)
    build_bundle(ckpt, out, opts)
    assert len(second) == 1 and "another lineside command is writing" in second[0] and str(out) in second[0], second
    b = open_bundle(out)
    assert (b.tokenizer_dir / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_build_without_force_never_replaces_a_bundle_finished_while_it_started(ckpt, tmp_path, monkeypatch):
    """Two builds into one new -o, no --force: the second looked at -o (empty) before the first put its bundle
    there and staged after it had; it then replaced the first's bundle, which --force alone may do. It is now
    refused once it holds OUT.partial, and the first's bundle stays."""
    import lineside.build.pipeline as pipeline
    from lineside.errors import LinesideError

    out = tmp_path / "b"
    opts = BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16)
    claim = pipeline.claim_staging

    def first_build_finishes_meanwhile(staging, path):
        monkeypatch.setattr(pipeline, "claim_staging", claim)
        build_bundle(ckpt, out, opts)  # the first build: done between the second's look at -o and its staging
        (out / "first.txt").write_text("the first build's")
        return claim(staging, path)

    monkeypatch.setattr(pipeline, "claim_staging", first_build_finishes_meanwhile)
    with pytest.raises(LinesideError, match=r"exists and is not empty.*--force") as e:
        build_bundle(ckpt, out, opts)
    assert "\n" not in str(e.value)
    assert (out / "first.txt").read_text() == "the first build's" and (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_build_killed_earlier_does_not_block_the_next(ckpt, tmp_path):
    """What a SIGKILLed build left (OUT.partial, no one writing it) is removed by the next build, not refused."""
    out = tmp_path / "b"
    (tmp_path / "b.partial" / "graphs").mkdir(parents=True)
    (tmp_path / "b.partial" / "graphs" / "half.onnx").write_bytes(b"\0" * 10)
    build_bundle(ckpt, out, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    assert (out / "manifest.json").is_file() and not (out / "graphs" / "half.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_link_where_the_build_stages_is_refused_and_kept(ckpt, tmp_path):
    """OUT.partial that no build made (a link to someone's directory) is one line, and stays as it was."""
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "keep.txt").write_text("keep")
    (tmp_path / "b.partial").symlink_to(tmp_path / "theirs")
    proc = run_cli("build", str(ckpt), "-o", str(tmp_path / "b"), "--quant", "fp32", "--max-seq-len", "16", "-q",
                   timeout=60)
    assert_one_line_error(proc, "b.partial", "in the way")
    assert (tmp_path / "theirs" / "keep.txt").read_text() == "keep" and (tmp_path / "b.partial").is_symlink()


def test_a_file_size_limit_during_a_build_is_one_line_that_names_it(ckpt, tmp_path):
    """`ulimit -f` (or a filesystem's largest file) reached while writing the bundle: Python ignores SIGXFSZ, so
    the write fails with EFBIG, which said only "File too large; check the path" (no path to check)."""
    import resource

    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
              "from lineside.cli import main\nmain(sys.argv[1:])\n")
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] != 0
    proc = subprocess.run([sys.executable, "-c", script, "build", str(ckpt), "-o", str(tmp_path / "b"), "--quant",
                           "fp32", "--max-seq-len", "16", "-q"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert_one_line_error(proc, "file too large", "ulimit -f", code=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_bundle_set_aside_by_a_killed_replace_is_named_then_cleared(ckpt, bundle, tmp_path):
    """SIGKILL between `build --force` setting the old bundle aside (.OUT.replaced) and renaming the new one in:
    OUT is gone and the good old bundle hides under a dot name. Opening OUT said only "it does not exist"; the
    next build into OUT then left the old one there for good (a whole bundle's bytes on a device's disk)."""
    aside = tmp_path / ".b.replaced"
    shutil.copytree(bundle, aside)
    proc = run_cli("logits", str(tmp_path / "b"), "--ids", "1,2", "-o", str(tmp_path / "x.npy"))
    assert_one_line_error(proc, ".b.replaced", "mv ")
    build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
