"""The build's summary line says what was built: a Q8_0 GGUF built with --quant w4a16 carries its linears at 8
bits into the cpu graph (recorded in the manifest's carried_from_source), and the line said "w4a16"."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file

from lineside.build.pipeline import BuildOptions, build_bundle, describe
from tests.build.checkpoint.ckpt_gguf_writer import write_model_gguf
from tests.cli.cli_run import run_cli

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tokenizer() -> dict:
    """A byte-level vocabulary for the GGUF (3 specials + the 256 bytes; the model's 300 rows pad it)."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<pad>", "<s>", "</s>", *sorted(ByteLevel.alphabet())]
    return dict(tokens=tokens, types=[3] * 3 + [1] * 256, merges=[], pre="default", bos=1, eos=2)


@pytest.fixture(scope="module")
def gguf(tiny_dense, tmp_path_factory):
    """qtype for every linear → a GGUF of the tiny Llama with its linears in that GGML type (the rest F32)."""
    ck = tiny_dense("llama-gqa")
    cfg = json.loads((ck / "config.json").read_text())
    state = load_file(str(ck / "model.safetensors"))
    d = tmp_path_factory.mktemp("gguf")

    def make(name: str, qtype_of) -> str:
        path = d / f"{name}.gguf"
        qtypes = {n: q for n in state if n.endswith("proj.weight") and (q := qtype_of(n)) != "F32"}
        write_model_gguf(path, "llama", cfg, state, qtypes, tokenizer=_tokenizer())
        return str(path)

    return make


def _built(path: str, out, **opts) -> str:
    options = BuildOptions(**{"quant": "w4a16", "flavors": ("cpu",), "max_seq_len": 32, **opts})
    return describe(build_bundle(path, out, options))


def test_a_q8_0_gguf_built_w4a16_is_summarised_as_8_bit(gguf, tmp_path):
    q8 = gguf("q8", lambda n: "Q8_0")
    line = _built(q8, tmp_path / "a")
    assert line.startswith("llama w8a16 (every linear carried at 8 bits from GGUF Q8_0, not re-quantized to "
                           "w4a16) flavors=cpu "), line
    both = _built(q8, tmp_path / "b", flavors=("cpu", "trt"))
    assert both.startswith("llama w4a16 (trt), cpu graph w8a16 (every linear carried at 8 bits from GGUF Q8_0, "), both
    mixed = _built(gguf("mixed", lambda n: "Q8_0" if ".down_proj." in n else "Q4_0"), tmp_path / "c")
    assert mixed.startswith("llama w4a16 + 8-bit (2 of 14 linears carried at 8 bits from GGUF Q8_0) "), mixed
    assert _built(gguf("q4", lambda n: "Q4_0"), tmp_path / "d").startswith("llama w4a16 flavors=cpu ")
    assert _built(q8, tmp_path / "e", quant="fp16").startswith("llama fp16 flavors=cpu ")  # nothing carried


def test_the_cli_prints_it(gguf, tmp_path):
    proc = run_cli("build", gguf("q8", lambda n: "Q8_0"), "-o", tmp_path / "o", "--max-seq-len", "32", "-q")
    assert proc.returncode == 0, proc.stderr
    assert f"{tmp_path / 'o'}: llama w8a16 (every linear carried at 8 bits from GGUF Q8_0" in proc.stdout
