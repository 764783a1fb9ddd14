"""Bad DeepSeek-V4 inputs fail with one line that names the problem (missing tensor, config, dtype)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lineside.errors import CheckpointError, ConfigError, LinesideError


def _edit(src: Path, dst: Path, drop: str | None = None, replace: dict | None = None, config: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    if drop is not None:
        assert drop in sd, drop
        del sd[drop]
    for k, v in (replace or {}).items():
        sd[k] = v(sd[k]) if callable(v) else v
    save_file({k: t.contiguous() for k, t in sd.items()}, str(dst / "model.safetensors"))
    if config:
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _build(d: Path, tmp: Path) -> None:
    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.models import deepseek_v4 as v4
    from lineside.build.quant.spec import QuantSpec

    ck = open_checkpoint(d)
    try:
        v4.emit_graph(ck.hf_config, ck, QuantSpec(scheme="fp32"), "cpu", tmp / "g" / "model.onnx", 32)
    finally:
        ck.close()


def _one_line(e: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("kind,name", [
    ("hf", "model.layers.1.attn.indexer.wq_b.weight"),  # transformers' save_pretrained naming
    ("official", "layers.2.ffn.experts.3.w2.weight"),
    ("official", "layers.0.ffn.gate.tid2eid"),
    ("official", "head.weight"),
])
def test_missing_tensor_is_named(v4, tmp_path, kind, name):
    src = v4.hf_dir("a") if kind == "hf" else v4.official_dir("a", None, False)
    d = _edit(src, tmp_path / "ck", drop=name)
    with pytest.raises(CheckpointError) as e:
        _build(d, tmp_path)
    _one_line(e, repr(name), "missing")


def test_inconsistent_config(v4, tmp_path):
    d = _edit(v4.hf_dir("a"), tmp_path / "ck", config={"layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ConfigError) as e:
        _build(d, tmp_path)
    _one_line(e, "layer_types has 2 entries but num_hidden_layers is 3")


def test_unsupported_source_dtype(v4, tmp_path):
    import torch

    name = "layers.1.attn.wq_a.weight"
    d = _edit(v4.official_dir("a", None, False), tmp_path / "ck", replace={name: lambda t: t.to(torch.int32)})
    with pytest.raises(CheckpointError) as e:
        _build(d, tmp_path)
    _one_line(e, repr(name), "int32")


def test_fp8_without_scale(v4, tmp_path):
    d = _edit(v4.official_dir("a", "ue8m0", False), tmp_path / "ck", drop="layers.0.attn.wq_b.scale")
    with pytest.raises(CheckpointError) as e:
        _build(d, tmp_path)
    _one_line(e, "'layers.0.attn.wq_b.weight'", "no block-scale companion")


def test_hash_table_out_of_range(v4, tmp_path):
    d = _edit(v4.official_dir("a", None, False), tmp_path / "ck",
              replace={"layers.0.ffn.gate.tid2eid": lambda t: t + 10})
    with pytest.raises(CheckpointError) as e:
        _build(d, tmp_path)
    _one_line(e, "'layers.0.ffn.gate.tid2eid'", "expert ids in [0, 4)")


def test_unknown_flavor(v4, tmp_path):
    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.models import deepseek_v4 as v4m
    from lineside.build.quant.spec import QuantSpec

    ck = open_checkpoint(v4.hf_dir("a"))
    try:
        with pytest.raises(LinesideError) as e:
            v4m.emit_graph(ck.hf_config, ck, QuantSpec(scheme="fp32"), "gpu", tmp_path / "m.onnx", 32)
    finally:
        ck.close()
    _one_line(e, "flavor 'gpu'")


def test_a_4bit_head_it_would_not_build_is_refused(v4, tmp_path):
    """DeepSeek-V4's graphs keep the LM head at 8 bits: --lm-head-bits 4 is refused in one line, not dropped."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    with pytest.raises(LinesideError) as e:
        build_bundle(v4.hf_dir("a"), tmp_path / "o", BuildOptions(quant="w4a16", group_size=64, lm_head_bits=4))
    _one_line(e, "--lm-head-bits 4", "8 bits")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_prefill_graph_it_would_not_build_is_refused(v4, tmp_path):
    """The int8 prompt graph is built for Llama and Qwen2 only: --prefill-graph on DeepSeek-V4 is refused in one
    line, not dropped (the bundle came out without one)."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    with pytest.raises(LinesideError) as e:
        build_bundle(v4.hf_dir("a"), tmp_path / "o", BuildOptions(quant="w4a16", group_size=64, prefill_graph=True))
    _one_line(e, "--prefill-graph", "Llama and Qwen2")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_calibration_text_it_would_not_read_is_refused(v4, tmp_path):
    """An rtn build reads --calib only for a Llama/Qwen2 int8 prefill graph (or int4 trt KV): for DeepSeek-V4 the
    text would be ignored, so it is refused in one line."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    calib = tmp_path / "calib.txt"
    calib.write_text("Pump 4 tripped at 03:12; the bearing ran at 91 C before the alarm. " * 40)
    with pytest.raises(LinesideError) as e:
        build_bundle(v4.hf_dir("a"), tmp_path / "o", BuildOptions(quant="w4a16", group_size=64, calib=calib))
    _one_line(e, "--calib", "rtn")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("kind,patch,name", [  # names as saved (transformers saves DeepSeek's names)
    ("hf", {"o_groups": 4}, "model.layers.0.attn.wo_a.weight"),  # was built with the wrong head groups
    ("hf", {"moe_intermediate_size": 32}, "model.layers.0.ffn.experts.0.w1.weight"),  # wrong gate/up split
    ("hf", {"hc_mult": 3}, "model.hc_head.hc_fn"),  # was a ValueError traceback
    ("hf", {"index_n_heads": 4}, "model.layers.1.attn.indexer.wq_b.weight"),  # failed in onnxruntime
    ("mxfp4", {"moe_intermediate_size": 32}, "layers.0.ffn.experts.0.w1.weight"),  # packed experts: logical shape
])
def test_config_that_disagrees_with_the_tensors_is_refused(v4, tmp_path, kind, patch, name):
    src = v4.hf_dir("a") if kind == "hf" else v4.official_dir("a", "ue8m0", True)
    d = _edit(src, tmp_path / "ck", config=patch)
    with pytest.raises(CheckpointError) as e:
        _build(d, tmp_path)
    _one_line(e, repr(name), "config.json")
