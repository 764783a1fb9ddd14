"""Inconsistent checkpoints (config.json fields of the wrong type, tensors of the wrong shape or dtype) are
refused in one line before any work — never a traceback, never a bundle that computes something else."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.config import ModelConfig
from lineside.errors import CheckpointError, ConfigError
from tests.cli.cli_run import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def ckpt(tiny_dense):
    return tiny_dense("llama-gqa")  # hidden 64, 4 heads / 2 kv heads, head_dim 16, untied


def _edit_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _edit_tensors(src, dst, edit):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _drop(key):
    return lambda c: c.pop(key, None)


CONFIG_CASES = {
    # id: (edit, words the one-line message must contain)
    "eps-string": (_set("rms_norm_eps", "abc"), ["rms_norm_eps", "'abc'"]),
    "eps-negative": (_set("rms_norm_eps", -1e-5), ["rms_norm_eps"]),
    "max-pos-string": (_set("max_position_embeddings", "x"), ["max_position_embeddings"]),
    "max-pos-zero": (_set("max_position_embeddings", 0), ["max_position_embeddings"]),
    "kv-heads-string": (_set("num_key_value_heads", "two"), ["num_key_value_heads"]),
    "kv-heads-zero": (_set("num_key_value_heads", 0), ["num_key_value_heads"]),
    "head-dim-string": (_set("head_dim", "x"), ["head_dim"]),
    "tie-string": (_set("tie_word_embeddings", "false"), ["tie_word_embeddings", "true or false"]),
    "bias-string": (_set("attention_bias", "no"), ["attention_bias"]),
    "eos-null-in-list": (_set("eos_token_id", [2, None]), ["eos_token_id"]),
    "bos-string": (_set("bos_token_id", "<s>"), ["bos_token_id"]),
    "theta-negative": (_set("rope_parameters", {"rope_type": "default", "rope_theta": -5}), ["rope_theta"]),
    "rope-scaling-string": (_set("rope_scaling", "linear"), ["rope_scaling", "object"]),
    "rope-linear-no-factor": (_set("rope_scaling", {"rope_type": "linear"}), ["linear", "'factor'"]),
    "rope-factor-string": (_set("rope_scaling", {"rope_type": "linear", "factor": "2"}), ["'factor'"]),
    "rope-llama3-missing": (_set("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), ["llama3",
                                                                                         "low_freq_factor"]),
    "rope-longrope": (_set("rope_scaling", {"type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8,
                                            "long_factor": [2.0] * 8}), ["'longrope'", "not supported"]),
    "rope-dynamic-no-factor": (_set("rope_scaling", {"type": "dynamic"}), ["dynamic", "'factor'"]),
    # a required field left out: named as missing (not "got None"), and where to get it
    "no-hidden-size": (_drop("hidden_size"), ["'hidden_size'", "is missing", "original config.json"]),
    "no-architecture": (lambda c: (c.pop("architectures"), c.pop("model_type")),
                        ["no 'architectures' or 'model_type'", "LlamaForCausalLM"]),
    "heads-not-dividing-hidden": (lambda c: (c.update(num_attention_heads=3, num_key_value_heads=1),
                                             c.pop("head_dim", None)), ["hidden_size", "num_attention_heads"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_field_one_line(ckpt, tmp_path, case):
    edit, words = CONFIG_CASES[case]
    d = _edit_config(ckpt, tmp_path / "c", edit)
    with pytest.raises(ConfigError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu", "trt"), max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


TENSOR_CASES = {
    "q-proj-rows": ("model.layers.0.self_attn.q_proj.weight", np.zeros((32, 64), np.float32), "[32, 64]"),
    "k-proj-rows": ("model.layers.0.self_attn.k_proj.weight", np.zeros((64, 64), np.float32), "[64, 64]"),
    "down-inputs": ("model.layers.1.mlp.down_proj.weight", np.zeros((64, 96), np.float32), "[64, 96]"),
    "embed-vocab": ("model.embed_tokens.weight", np.zeros((200, 64), np.float32), "[200, 64]"),
    "head-vocab": ("lm_head.weight", np.zeros((200, 64), np.float32), "[200, 64]"),
    "norm-2d": ("model.layers.0.input_layernorm.weight", np.ones((1, 64), np.float32), "[1, 64]"),
    "int-weight": ("model.layers.0.self_attn.o_proj.weight", np.zeros((64, 64), np.int32), "I32"),
    # int8 codes with no scale beside them (no weight_scale / scale tensor): they were built as the weights' values
    "int8-embed-unscaled": ("model.embed_tokens.weight", np.ones((300, 64), np.int8), "I8"),
    "uint8-weight-unscaled": ("model.layers.1.mlp.up_proj.weight", np.ones((128, 64), np.uint8), "U8"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_tensor_disagreeing_with_config_one_line(ckpt, tmp_path, case):
    name, value, shown = TENSOR_CASES[case]
    d = _edit_tensors(ckpt, tmp_path / "c", lambda t: t.__setitem__(name, value))
    with pytest.raises(CheckpointError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="w4a16", flavors=("cpu", "trt"), max_seq_len=16,
                                                     group_size=64))
    msg = str(e.value)
    assert "\n" not in msg and name in msg and shown in msg, msg
    assert not (tmp_path / "o.partial").exists()


def test_missing_tensor_one_line_says_what_to_do(ckpt, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    d = _edit_tensors(ckpt, tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and f"{name!r} is missing" in msg and "re-download" in msg, msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("key,value,words", [
    ("eos_token_id", 500, ["eos_token_id", "500", "vocab_size 300", "never"]),  # no logit for it: never stops
    ("eos_token_id", [300, 301], ["eos_token_id", "300", "vocab_size 300"]),
    ("bos_token_id", 300, ["bos_token_id", "300", "vocab_size 300"]),  # prepended to every prompt
])
def test_special_token_ids_outside_the_vocabulary_are_refused(ckpt, tmp_path, key, value, words):
    d = _edit_config(ckpt, tmp_path / "c", _set(key, value))
    gen = json.loads((d / "generation_config.json").read_text())
    gen[key] = value  # where transformers' generate (and the build) looks first
    (d / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(CheckpointError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_chat_template_that_is_not_text_is_refused(ckpt, tmp_path):
    """A chat_template of another JSON type was copied into the bundle and failed only when a chat was rendered."""
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": {"default": tcfg["chat_template"]}}))
    line = assert_one_line_error(run_cli("build", d, "-o", tmp_path / "o", "--quant", "fp32", "--max-seq-len", "16"),
                                 str(d / "tokenizer_config.json"), "chat_template must be a string", code=1)
    assert line.startswith("error: ")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def _template_json(ckpt, d, value):
    """The checkpoint with its template moved out of tokenizer_config.json into chat_template.json (as processors
    save it), holding ``value``."""
    shutil.copytree(ckpt, d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    template = tcfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (d / "chat_template.json").write_text(json.dumps({"chat_template": value(template)}))
    return d


def test_chat_template_json_that_is_not_text_is_refused(ckpt, tmp_path):
    """chat_template.json's template of another JSON type was silently dropped (the bundle had no template); it is
    refused naming that file, as tokenizer_config.json's is."""
    d = _template_json(ckpt, tmp_path / "c", lambda t: {"default": t})
    line = assert_one_line_error(run_cli("build", d, "-o", tmp_path / "o", "--quant", "fp32", "--max-seq-len", "16"),
                                 str(d / "chat_template.json"), "chat_template must be a string", code=1)
    assert line.startswith("error: ")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("value", [lambda t: t, lambda t: [{"name": "tool_use", "template": "x"},
                                                           {"name": "default", "template": t}]])
def test_chat_template_json_string_or_named_list_is_the_bundles_template(ckpt, tmp_path, value):
    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer

    template = json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"]
    d = _template_json(ckpt, tmp_path / "c", value)
    out = build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    assert Tokenizer.from_bundle(open_bundle(out)).chat_template == template


def test_an_extra_eos_id_outside_the_vocabulary_is_harmless(ckpt, tmp_path):
    """One of several EOS ids past the vocabulary never matches, the others still stop the answer: built."""
    d = _edit_config(ckpt, tmp_path / "c", _set("eos_token_id", [2, 300]))
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 300]
    (d / "generation_config.json").write_text(json.dumps(gen))
    out = build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    from lineside.bundle import open_bundle

    assert open_bundle(out).config.eos_token_ids == [2, 300]  # kept as given: 2 still ends an answer


def test_missing_kv_heads_key_is_caught_by_shapes(ckpt, tmp_path):
    """Without num_key_value_heads transformers assumes MHA; the 2-head k_proj then disagrees, by name."""
    d = _edit_config(ckpt, tmp_path / "c", _drop("num_key_value_heads"))
    with pytest.raises(CheckpointError, match="k_proj"):
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))


def test_cli_exit_1_one_line(ckpt, tmp_path):
    d = _edit_tensors(ckpt, tmp_path / "c", lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight",
                                                                    np.zeros((96, 64), np.float32)))
    proc = run_cli("build", d, "-o", tmp_path / "o")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.layers.1.mlp.up_proj.weight" in lines[0] and "[96, 64]" in lines[0]
    d2 = _edit_config(ckpt, tmp_path / "c2", _set("rope_scaling", {"rope_type": "longrope", "factor": 2.0}))
    proc = run_cli("build", d2, "-o", tmp_path / "o2")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "longrope" in lines[0], proc.stderr
    assert not (tmp_path / "o2.partial").exists()


def test_bias_and_window_flags_parse_like_transformers():
    """Llama's attention_bias covers o_proj, Qwen2 always has q/k/v biases and slides from max_window_layers."""
    base = dict(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2)
    llama = ModelConfig.from_hf_dict(dict(base, model_type="llama", attention_bias=True, mlp_bias=True))
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    qwen = ModelConfig.from_hf_dict(dict(base, model_type="qwen2", attention_bias=False, mlp_bias=True,
                                         use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert qwen.attention_bias and not qwen.o_proj_bias and not qwen.mlp_bias
    assert [qwen.layer_window(i) for i in range(3)] == [None, 8, 8]
    off = ModelConfig.from_hf_dict(dict(base, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                                        max_window_layers=28))
    assert off.sliding_window is None and off.layer_window(2) is None
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                                      layer_types=["full_attention"]))
