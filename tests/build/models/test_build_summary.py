"""The build's summary line says what was built: a Q8_0 GGUF built with --quant w4a16 carries its linears at 8
bits into the cpu graph (recorded in the manifest's carried_from_source), and the line said "w4a16"; `jetson plan`
sizes such a bundle from what its weight file holds, each carried linear at its own bits."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file

from lineside.build.pipeline import BuildOptions, build_bundle, describe
from tests.build.checkpoint.ckpt_gguf_writer import write_model_gguf
from tests.cli.cli_run import run_cli

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tokenizer() -> dict:
    """A byte-level vocabulary for the GGUF (3 specials, the 256 bytes and one merge, which a gpt2
    vocabulary must have; the model's 300 rows pad it)."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<pad>", "<s>", "</s>", *sorted(ByteLevel.alphabet()), "ĠĠ"]
    return dict(tokens=tokens, types=[3] * 3 + [1] * 257, merges=["Ġ Ġ"], pre="default", bos=1, eos=2)


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


def _linear_arrays(bundle) -> dict[str, tuple[int, int]]:
    """(8-bit code bytes, scale count) of each linear in the bundle's cpu graph, read from its weight file."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(bundle / "graphs" / "cpu" / "model.onnx"), load_external_data=True)
    out: dict[str, tuple[int, int]] = {}
    for init in model.graph.initializer:
        stem, _, part = init.name.rpartition(".")
        if "_proj" in stem and part in ("qweight", "scales"):
            codes, scales = out.get(stem, (0, 0))
            a = numpy_helper.to_array(init)
            out[stem] = (codes + a.nbytes, scales) if part == "qweight" else (codes, scales + a.size)
    return out


def test_the_planner_sizes_a_q8_0_carried_bundle_from_its_weight_file(gguf, tmp_path):
    """`jetson plan` read only 4-bit types from carried_from_source and sized these linears as 4-bit with 128-row
    groups; they hold one byte per weight and a scale per 32 (the planner's fp16 scales: the file's are fp32)."""
    from lineside.jetson.planner import plan

    bundle = build_bundle(gguf("q8", lambda n: "Q8_0"), tmp_path / "q8",
                          BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=32))
    arrays = _linear_arrays(bundle)
    assert len(arrays) == 8  # 2 layers x (qkv, o, gate_up, down): the fused linears
    p = plan(str(bundle), "orin-nano-8")
    assert p.quant == "w8a16" and any("Q8_0 blocks" in n and "per 32 weights" in n for n in p.notes), p.notes
    codes, scales = (sum(v[i] for v in arrays.values()) for i in (0, 1))
    assert p.weights_breakdown["linear"] == codes + scales * 2
    assert plan(str(bundle), "orin-nano-8", quant="w4a16").weights_breakdown["linear"] < codes  # a what-if still wins
    q4 = build_bundle(gguf("q4", lambda n: "Q4_0"), tmp_path / "q4",
                      BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=32))
    four = plan(str(q4), "orin-nano-8")
    codes4, scales4 = (sum(v[i] for v in _linear_arrays(q4).values()) for i in (0, 1))
    assert four.quant == "w4a16" and four.weights_breakdown["linear"] == codes4 + scales4 * 2


def test_the_planner_sizes_each_linear_of_a_mixed_bundle_as_carried(gguf, tmp_path):
    """Q8_0 down_proj, Q4_0 the rest (llama.cpp's mixes keep some linears at more bits): each sized as it is held."""
    from lineside.jetson.planner import plan

    bundle = build_bundle(gguf("mixed", lambda n: "Q8_0" if ".down_proj." in n else "Q4_0"), tmp_path / "m",
                          BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=32))
    arrays = _linear_arrays(bundle)
    p = plan(str(bundle), "orin-nano-8")
    codes, scales = (sum(v[i] for v in arrays.values()) for i in (0, 1))
    assert p.quant == "w4a16" and p.weights_breakdown["linear"] == codes + scales * 2
    assert any("2 of 14 in w8a16" in n for n in p.notes), p.notes


def test_the_planner_sizes_linears_quantized_at_build_in_the_bundles_group_size(gguf, tmp_path):
    """An F32 down_proj (quantized at build, in --group-size groups: 128) beside Q4_0 linears (carried, blocks of
    32): the planner sized the quantized ones in the carried blocks of 32 too, four fp16 scales per row for one."""
    from lineside.jetson.planner import plan

    bundle = build_bundle(gguf("q4-f32", lambda n: "F32" if ".down_proj." in n else "Q4_0"), tmp_path / "m",
                          BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=32))
    carried = json.loads((bundle / "manifest.json").read_text())["quantization"]["carried_from_source"]
    assert len(carried) == 12 and not any(".down_proj." in n for n in carried)
    p = plan(str(bundle), "orin-nano-8")
    codes, scales = (sum(v[i] for v in _linear_arrays(bundle).values()) for i in (0, 1))
    assert p.quant == "w4a16" and p.weights_breakdown["linear"] == codes + scales * 2
