"""Bad input gets one clear line on stderr and a non-zero exit — never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.cli_run import run_cli


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n.lower() in err.lower(), (n, err)


@pytest.fixture(scope="module")
def ckpt(tiny_dense):
    return tiny_dense("llama-gqa")


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    return tiny_bundle


def _copy_ckpt(ckpt: Path, dst: Path) -> Path:
    shutil.copytree(ckpt, dst)
    return dst


def test_missing_config(ckpt, tmp_path):
    d = _copy_ckpt(ckpt, tmp_path / "c")
    (d / "config.json").unlink()
    assert_one_line_error(run_cli("build", str(d), "-o", str(tmp_path / "o")), "config.json")


def test_malformed_config(ckpt, tmp_path):
    d = _copy_ckpt(ckpt, tmp_path / "c")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    assert_one_line_error(run_cli("build", str(d), "-o", str(tmp_path / "o")), "config.json")


def test_unsupported_architecture(ckpt, tmp_path):
    d = _copy_ckpt(ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("build", str(d), "-o", str(tmp_path / "o")), "unsupported architecture",
                          "GPT2LMHeadModel")


def test_truncated_safetensors(ckpt, tmp_path):
    d = _copy_ckpt(ckpt, tmp_path / "c")
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    proc = run_cli("build", str(d), "-o", str(tmp_path / "o"))
    assert_one_line_error(proc, "model.safetensors")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_missing_tensor_named(ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_ckpt(ckpt, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(run_cli("build", str(d), "-o", str(tmp_path / "o")), "model.layers.1.mlp.up_proj.weight")


def test_truncated_gguf(smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(3_000_000))
    assert_one_line_error(run_cli("build", str(cut), "-o", str(tmp_path / "o")), "cut.gguf")


def test_group_size_not_dividing(ckpt, tmp_path):
    # TensorRT's INT4 blocks are 64 or 128; a group that no layer can use is refused before any work.
    # (A layer that 128 doesn't tile falls back to 64 on trt; cpu takes a ragged last group.)
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(tmp_path / "o"), "--group-size", "256",
                                  "--flavors", "cpu,trt"), "--group-size")


def test_bad_options(ckpt, tmp_path):
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(tmp_path / "o"), "--quant", "int3"), "--quant")
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(tmp_path / "o"), "--flavors", "gpu"), "flavors")


# Options that would do nothing in the combination given are refused before any work, not dropped.
DOES_NOTHING = [
    (["--calib", "CALIB", "--no-prefill-graph"], "--method rtn"),  # RTN reads no calibration text (the prefill
    (["--calib", "CALIB", "--quant", "fp16"], "--method rtn"),  # graph's forms are chosen on it: w4a16/w8a16 cpu)
    (["--quant", "fp16", "--lm-head-bits", "4"], "--quant w4a16"),
    (["--quant", "w8a16", "--lm-head-bits", "8"], "--quant w4a16"),
    (["--lora-targets", "q,v"], "--max-lora-rank"),
    (["--quant", "fp16", "--method", "awq"], "w8a16"),  # AWQ scales weights for integer quantization only
    (["--requantize"], "GGUF"),  # an HF checkpoint has no GGUF blocks to carry or re-quantize
    (["--quant", "fp16", "--prefill-graph"], "w4a16"),  # float weights: no int8 prompt graph is built
    (["--flavors", "trt", "--group-size", "64", "--prefill-graph"], "cpu flavor"),  # the prompt graph is cpu's
]


@pytest.mark.parametrize(("extra", "needle"), DOES_NOTHING, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_options_that_would_do_nothing_are_refused(ckpt, tmp_path, extra, needle):
    (tmp_path / "calib.txt").write_text("some calibration text\n")
    argv = [str(tmp_path / "calib.txt") if a == "CALIB" else a for a in extra]
    option = next(a for a in extra if a in ("--calib", "--lm-head-bits", "--lora-targets", "--method", "--requantize",
                                            "--prefill-graph"))
    root = Path(__file__).resolve().parents[2]
    for proc in (run_cli("build", str(ckpt), "-o", str(tmp_path / "o"), *argv),
                 subprocess.run([sys.executable, str(root / "build_engine.py"), str(ckpt), "-o", str(tmp_path / "o"),
                                 *argv], capture_output=True, text=True, timeout=120)):
        assert_one_line_error(proc, option, needle)
        assert proc.returncode == 1 and not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_options_used_in_their_combination_pass_validation(tmp_path):
    """The defaults, and each option where it does something, are not refused."""
    from lineside.build.pipeline import BuildOptions
    from lineside.errors import LinesideError
    from lineside.lora import ALL_TARGETS, parse_targets

    calib = tmp_path / "calib.txt"
    calib.write_text("some calibration text\n")
    accepted = (BuildOptions(), BuildOptions(quant="fp16"), BuildOptions(lm_head_bits=4),
                BuildOptions(calib=calib), BuildOptions(quant="w8a16", calib=calib),  # the prefill graph reads it
                BuildOptions(method="awq", calib=calib), BuildOptions(method="gptq", calib=calib),
                BuildOptions(quant="w8a16", method="awq", calib=calib),
                BuildOptions(kv_dtype="int4", flavors=("trt",), calib=calib),  # int4 KV centres keys on it
                BuildOptions(prefill_graph=True, accuracy_level=0), BuildOptions(quant="fp16", prefill_graph=False),
                BuildOptions(max_lora_rank=8, lora_targets=parse_targets("q,v")))
    refused = []
    for opts in accepted:
        try:
            opts.validate()
        except LinesideError as e:
            refused.append(f"{opts}: {e}")
    assert refused == []
    # unset options resolve to their defaults where the build reads them; a given one is kept
    assert BuildOptions().lm_head_bits is None and BuildOptions().targets == ALL_TARGETS
    assert accepted[-1].targets == parse_targets("q,v") != ALL_TARGETS


def test_output_exists_not_overwritten(ckpt, bundle):
    before = (bundle / "manifest.json").read_bytes()
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(bundle)), "exists", "--force")
    assert (bundle / "manifest.json").read_bytes() == before


def test_bundle_file_changed_after_build(bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    data = b / "graphs/cpu/model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = run_cli("logits", str(b), "--ids", "1,2,3", "-o", str(tmp_path / "x.npy"))
    assert_one_line_error(proc, "graphs/cpu/model.onnx.data", "sha256")


def test_ids_out_of_vocab(bundle, tmp_path):
    proc = run_cli("logits", str(bundle), "--ids", "1,2,99999", "-o", str(tmp_path / "x.npy"))
    assert_one_line_error(proc, "99999", "vocab")
    assert_one_line_error(run_cli("logits", str(bundle), "--ids", "1,a", "-o", str(tmp_path / "x.npy")), "--ids")
    # "1,,2" was read as 1,2 (an id left out without a word)
    assert_one_line_error(run_cli("logits", str(bundle), "--ids", "1,,2", "-o", str(tmp_path / "x.npy")), "--ids", "empty")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_ids_longer_than_the_context_are_refused_up_front(bundle, tmp_path, mode):
    """--mode decode ran a step per id up to the context, then failed naming context + 1 tokens, not the prompt's
    length: both modes refuse the whole prompt first, with the same line."""
    proc = run_cli("logits", str(bundle), "--ids", ",".join(["5"] * 262), "--mode", mode, "-o", str(tmp_path / "x.npy"))
    assert_one_line_error(proc, "sequence of 262 tokens exceeds the bundle's max_seq_len 256")


@pytest.mark.parametrize("ids", ["1 2 3", "1, 2, 3", " 1,2,3 "])
def test_ids_separated_by_spaces_are_each_an_id(bundle, tmp_path, ids):
    import numpy as np

    # "1 2 3" lost its spaces: one token, 123, and logits [1, vocab] for a three-token question
    proc = run_cli("logits", str(bundle), "--ids", ids, "-o", str(tmp_path / "x.npy"))
    assert proc.returncode == 0, proc.stderr
    assert np.load(tmp_path / "x.npy").shape == (3, 300)


@pytest.mark.parametrize("args", [["--help"], ["lora", "list", "nope"]])
def test_python_m_lineside_cli_runs_the_cli_as_python_m_lineside(tmp_path, args):
    """`python -m lineside.cli ...` exited 0 having done nothing: cli.py had no __main__ block."""
    def run(module: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    want, got = run("lineside"), run("lineside.cli")
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert (want.returncode, bool(want.stdout)) == ((0, True) if args == ["--help"] else (1, False)), want


def test_not_a_bundle(tmp_path):
    assert_one_line_error(run_cli("generate", str(tmp_path), "--prompt", "hi"), "manifest")


def test_text_that_is_not_utf8_is_one_line(bundle):
    """Bytes that are not UTF-8 (a Latin-1 terminal, a file in another encoding) reach Python as lone surrogates,
    which the tokenizer refuses with a TypeError: --prompt, --system and a chat line are refused in one line."""
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # what argv holds for those bytes
    assert_one_line_error(run_cli("generate", str(bundle), "--prompt", bad, fresh=True), "--prompt", "UTF-8")
    assert_one_line_error(run_cli("chat", str(bundle), "--system", bad, fresh=True), "--system", "UTF-8")
    # a chat line: one line on stderr, and the chat goes on (the next line is answered; the conversation is kept)
    proc = subprocess.run([sys.executable, "-m", "lineside", "chat", str(bundle), "--max-tokens", "3"],
                          input=b"caf\xe9\nhi\n\n",
                          capture_output=True, timeout=120)
    err = proc.stderr.decode(errors="replace").split("chatting with", 1)[-1].strip().splitlines()[1:]
    assert proc.returncode == 1, proc.stderr  # piped: the skipped line makes the exit non-zero at the end
    assert len(err) == 1 and "UTF-8" in err[0] and "Traceback" not in proc.stderr.decode(errors="replace")
    # "hi" answered; piped, stdout holds only the answers (no "you> " prompts)
    out = proc.stdout.decode(errors="replace")
    assert out.count("model> ") == 1 and "you> " not in out, out


def test_a_chat_line_longer_than_the_context_is_one_line_and_the_chat_goes_on(bundle):
    """A pasted line past the bundle's context (256) ended the chat and the conversation with it; now it is one line,
    the chat goes on, and (piped) the exit is 1 at the end so a script sees the answer it lacks."""
    lines = ["hi", "x" * 400, "hi again", ""]
    proc = subprocess.run([sys.executable, "-m", "lineside", "chat", str(bundle), "--max-tokens", "3"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    err = proc.stderr.split("chatting with", 1)[-1].strip().splitlines()[1:]
    assert proc.returncode == 1, proc.stderr  # piped: the skipped line makes the exit non-zero at the end
    assert len(err) == 1 and "context" in err[0] and "256" in err[0] and "skipped" in err[0] and "shorten" in err[0], proc.stderr
    assert "you> " not in proc.stdout and proc.stdout.count("model> ") == 2, proc.stdout  # blank line skipped


def test_chat_with_stdin_closed_is_one_line_before_loading(bundle):
    """`lineside chat BUNDLE <&-` (a service or a cron job with no stdin) loaded the model, then died in input() with a
    RuntimeError traceback ("lost sys.stdin")."""
    proc = subprocess.run([sys.executable, "-m", "lineside", "chat", str(bundle)], stdin=None, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.close(0))
    assert_one_line_error(proc, "stdin", "generate --prompt")
    assert "chatting with" not in proc.stderr  # refused before the model loads


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"]])
def test_generate_and_chat_with_stdout_closed_are_one_line_before_loading(bundle, command):
    """`lineside generate BUNDLE --prompt hi >&-` (a cron job or service with fd 1 closed) loaded the model, generated,
    then died on an AttributeError traceback ('NoneType' object has no attribute 'write'); `chat >&-` died in
    input() on "RuntimeError: lost sys.stdout"."""
    proc = subprocess.run([sys.executable, "-m", "lineside", command[0], str(bundle), *command[1:], "--max-tokens",
                           "3"], input="hi\n", capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert_one_line_error(proc, "stdout", "closed")
    assert "chatting with" not in proc.stderr  # refused before the model loads


def test_bench_on_a_damaged_bundle_says_why(bundle, tmp_path):
    """`bench --bundle` on a bundle failing its checksum logged why, then waited out the 120 s startup timeout and
    ended on "the in-process server was not ready within 120s"."""
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    data = b / "graphs" / "cpu" / "model.onnx"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # same size, other bytes: only the sha256 check sees it
    data.write_bytes(bytes(raw))
    proc = run_cli("bench", "--bundle", str(b), "--num-requests", "1", "--max-tokens", "4", "--prompt-len", "8")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "sha256" in last and "copy" in last and "within" not in last, proc.stderr


def test_logits_cli_writes_npy(bundle, tmp_path):
    import numpy as np

    out = tmp_path / "x.npy"
    proc = run_cli("logits", str(bundle), "--ids", "1,2,3,4", "--mode", "decode", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert np.load(out).shape == (4, 300)


def test_logits_defaults_to_the_flavor_a_trt_only_bundle_has(tiny_bundles, tmp_path):
    """A head_dim GroupQueryAttention can't take is built --flavors trt (the build says so); `logits` without
    --flavor then runs that graph instead of asking for a cpu rebuild the build just refused."""
    import numpy as np

    out = tmp_path / "x.npy"
    proc = run_cli("logits", str(tiny_bundles(flavors=("trt",))), "--ids", "1,2,3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "trt" in proc.stdout and np.load(out).shape == (3, 300)


def test_build_engine_takes_every_build_option():
    import importlib.util
    import inspect

    from lineside.build.commands import build

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("build_engine", root / "build_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    missing = set(inspect.signature(build).parameters) - set(inspect.signature(script.main).parameters)
    assert not missing, missing


def test_build_engine_skips_the_engine_without_a_gpu(tmp_path, monkeypatch, capsys):
    """TensorRT importable (pip installs it on GPU-less machines) but no GPU/driver: the bundle is complete, so
    the engine is skipped with the same line as without TensorRT, not an error after the bundle was written."""
    import importlib.util

    from lineside.build import commands as build_commands
    from lineside.errors import BackendUnavailable
    from lineside.runtime.tensorrt import env as trt_env
    from lineside.runtime.tensorrt import key as keymod

    def no_gpu():
        raise BackendUnavailable(trt_env.NO_GPU.format(err="cudaErrorNoDevice"))

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("build_engine", root / "build_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(build_commands, "build", lambda *a, **k: None)
    monkeypatch.setattr(trt_env, "import_tensorrt", lambda: object())
    monkeypatch.setattr(keymod, "machine_key", no_gpu)
    script.main(tmp_path / "ckpt", tmp_path / "b")
    err = capsys.readouterr().err
    assert err.startswith("skipping the TensorRT engine: no CUDA GPU found") and f"lineside engine {tmp_path}" in err


def test_build_engine_script(ckpt, tmp_path):
    """build_engine.py takes `lineside build`'s options and says why it skips the engine without TensorRT."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "b"
    proc = subprocess.run([sys.executable, str(root / "build_engine.py"), str(ckpt), "-o", str(out), "--quant",
                           "fp16", "--max-seq-len", "32", "-q"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "graphs/trt/model.onnx").is_file() and (out / "graphs/cpu/model.onnx").is_file()
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert "skipping the TensorRT engine" in proc.stderr
    bad = subprocess.run([sys.executable, str(root / "build_engine.py"), str(tmp_path / "nope"), "-o",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert_one_line_error(bad, "nope")
