"""Checkpoint companion files a bundle would carry unusable (a tokenizer.json the tokenizers library cannot load, a
generation_config.json serve refuses) are refused by the build in one line naming the file — not after it, by serve."""

from __future__ import annotations

import json
import shutil

import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.errors import CheckpointError
from tests.cli.cli_run import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def ckpt(tiny_dense):
    return tiny_dense("llama-gqa")


def _edit_json(src, dst, fname, edit):
    shutil.copytree(src, dst)
    data = json.loads((dst / fname).read_text())
    edit(data)
    (dst / fname).write_text(json.dumps(data))
    return dst


TOKENIZER_CASES = {
    # id: an edit of tokenizer.json's object (each one loaded before, and the bundle failed only when served)
    "no-model": lambda t: t.clear(),
    "model-a-list": lambda t: t.__setitem__("model", []),
    "post-processor-of-another-shape": lambda t: t.__setitem__(
        "post_processor", {"type": "TemplateProcessing", "single": [1]}),
    "added-token-id-not-a-number": lambda t: t.__setitem__("added_tokens", [{"content": "<x>", "id": "abc"}]),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_a_tokenizer_json_the_tokenizers_library_cannot_load_is_refused(ckpt, tmp_path, case):
    d = _edit_json(ckpt, tmp_path / "c", "tokenizer.json", TOKENIZER_CASES[case])
    with pytest.raises(CheckpointError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and str(d / "tokenizer.json") in msg and "not a tokenizer the tokenizers library can load" in msg, msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_bad_tokenizer_json_is_one_line_from_the_cli(ckpt, tmp_path):
    d = _edit_json(ckpt, tmp_path / "c", "tokenizer.json", TOKENIZER_CASES["no-model"])
    assert_one_line_error(run_cli("build", d, "-o", tmp_path / "o", "--quant", "fp32", "--max-seq-len", "16"),
                          "tokenizer.json", "re-download", code=1)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("field,value", [("temperature", "hot"), ("top_p", 5), ("top_k", 2.5),
                                         ("repetition_penalty", -1)])
def test_a_sampling_field_serve_would_refuse_is_refused_by_the_build(ckpt, tmp_path, field, value):
    """serve (--generation-config auto, its default) reads the copied generation_config.json and refused to start on
    such a field; the build says so first, naming the checkpoint's file and the field."""
    d = _edit_json(ckpt, tmp_path / "c", "generation_config.json", lambda g: g.__setitem__(field, value))
    line = assert_one_line_error(run_cli("build", d, "-o", tmp_path / "o", "--quant", "fp32", "--max-seq-len", "16"),
                                 str(d / "generation_config.json"), f"{field} is {value!r}", "build again", code=1)
    assert "--generation-config" not in line
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_sampling_fields_in_range_are_carried(ckpt, tmp_path):
    from lineside.bundle import open_bundle
    from lineside.runtime.sampling_defaults import read_sampling_defaults

    d = _edit_json(ckpt, tmp_path / "c", "generation_config.json", lambda g: g.update(temperature=0.6, top_p=0.95))
    out = build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    tok_dir = open_bundle(out).path / "tokenizer"
    got = read_sampling_defaults(tok_dir / "generation_config.json")
    assert (got.temperature, got.top_p) == (0.6, 0.95)


ARCHITECTURE_CASES = {
    # id: (config.json edit, words of the one line); each was a TypeError traceback or a garbled line before
    "architectures-ints": (lambda c: (c.update(architectures=[5]), c.pop("model_type")),
                           ["'architectures'", "list of class names", "[5]"]),
    "architectures-object": (lambda c: c.update(architectures={"LlamaForCausalLM": 1}), ["'architectures'"]),
    "model-type-list": (lambda c: (c.pop("architectures"), c.update(model_type=["llama"])),
                        ["'model_type'", "string", "['llama']"]),
    "lone-unsupported-name": (lambda c: (c.update(architectures="MistralForCausalLM"), c.pop("model_type")),
                              ["unsupported architecture MistralForCausalLM;"]),
    # a classifier / bare model checkpoint: it has no lm_head.weight, which was all the build said
    "classifier": (lambda c: c.update(architectures=["LlamaForSequenceClassification"]),
                   ["LlamaForSequenceClassification", "no LM head", "LlamaForCausalLM"]),
    "bare-model": (lambda c: c.update(architectures=["Qwen2Model"], model_type="qwen2"), ["Qwen2Model", "no LM head"]),
}


@pytest.mark.parametrize("case", list(ARCHITECTURE_CASES))
def test_architectures_and_model_type_of_another_shape_are_one_line(ckpt, tmp_path, case):
    from lineside.errors import ConfigError

    edit, words = ARCHITECTURE_CASES[case]
    d = _edit_json(ckpt, tmp_path / "c", "config.json", edit)
    with pytest.raises(ConfigError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_lone_architecture_name_is_taken_as_a_list(ckpt, tmp_path):
    """`"architectures": "LlamaForCausalLM"` (a string, not a list) names the model as clearly as the list does."""
    d = _edit_json(ckpt, tmp_path / "c", "config.json",
                   lambda c: (c.update(architectures="LlamaForCausalLM"), c.pop("model_type")))
    out = build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    from lineside.bundle import open_bundle

    assert open_bundle(out).manifest.architecture == "llama"


def test_another_generators_model_class_is_unsupported_not_headless():
    """GPT2LMHeadModel ends in "Model" yet generates: it is named as unsupported, not as a model without a head."""
    from lineside.config import family_of
    from lineside.errors import ConfigError

    with pytest.raises(ConfigError, match="unsupported architecture GPT2LMHeadModel;"):
        family_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
