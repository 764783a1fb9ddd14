"""RoPE settings of real Hugging Face configs, read the way transformers reads them, and decode past the original
context of a scaled RoPE (llama3, yarn, linear) against transformers in float32, both flavors.

The sweep (test_shape_sweep.py) and the parity tests stop at 14 tokens, below every scaling boundary; here the
prompt (20 tokens) and 12 decode steps cross ``original_max_position_embeddings`` (16).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.bundle import open_bundle
from lineside.config import ModelConfig
from lineside.errors import ConfigError, LinesideError
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)

PAST_ORIGINAL = {
    # name: (family, config overrides); every original context is 16 positions, the sequence 32
    "llama3": ("llama", dict(num_hidden_layers=1, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Qwen2.5's long-context recipe: yarn over theta 1e6, with an explicit head_dim and a tied head.
    "qwen2-yarn-1e6": ("qwen2", dict(num_hidden_layers=1, head_dim=32, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16})),
    # yarn with every optional field set (no truncation, explicit betas and attention factor), on Llama with biases.
    "llama-yarn-fields": ("llama", dict(num_hidden_layers=1, attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2, "truncate": False})),
    "linear": ("llama", dict(num_hidden_layers=1, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 4.0})),
}


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(PAST_ORIGINAL))
def test_decode_past_original_context_matches_transformers(dense_checkpoint, tmp_path, name):
    from transformers import AutoModelForCausalLM

    family, over = PAST_ORIGINAL[name]
    ckpt = dense_checkpoint(f"rope-{name}", family, **{**BASE, **over})
    ids = [int(t) for t in np.random.default_rng(7).integers(3, 300, 32)]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    bundle = open_bundle(build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu", "trt"),
                                                                         max_seq_len=64)))
    _assert_flavors_match(bundle, ids, ref)


def _assert_flavors_match(bundle, ids, ref) -> None:
    """Both flavors' float graphs against transformers' logits: a 20-token prompt, then one token a step."""
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0, threads=1)
        be.reset_slot(0)
        pre = be.forward(StepBatch.single(0, ids[:20], 0, all_logits=True))[0]
        dec = np.stack([be.forward(StepBatch.single(0, [t], 20 + i))[0, 0] for i, t in enumerate(ids[20:])])
        assert _rel(pre, ref[:20]) < 1e-4, (flavor, "prefill", _rel(pre, ref[:20]))
        assert _rel(dec, ref[20:]) < 1e-4, (flavor, "decode", _rel(dec, ref[20:]))


# transformers' "dynamic" (NTK) RoPE keeps the default frequencies up to max_position_embeddings and recomputes them
# from the running length past it: built exactly up to it (both spellings), refused past it.
DYNAMIC = {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
           "rope_scaling": {"type": "dynamic", "factor": 2.0}}


@pytest.mark.parametrize("spelling", list(DYNAMIC))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dynamic_rope_matches_transformers_up_to_max_position_embeddings(dense_checkpoint, tmp_path, family,
                                                                          spelling):
    from transformers import AutoModelForCausalLM

    # the sequence fills the whole context: positions 0..31 of max_position_embeddings 32
    ckpt = dense_checkpoint(f"rope-dynamic-{family}", family, **{**BASE, "num_hidden_layers": 1,
                                                                 "max_position_embeddings": 32})
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    if spelling == "rope_scaling":  # transformers 4's spelling, beside a top-level theta
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = 10000.0
    cfg[spelling] = DYNAMIC[spelling]
    (d / "config.json").write_text(json.dumps(cfg))
    ids = [int(t) for t in np.random.default_rng(9).integers(3, 300, 32)]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_type"] == "dynamic"
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    # no --max-seq-len: the model's own context, max_position_embeddings
    bundle = open_bundle(build_bundle(d, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu", "trt"))))
    assert bundle.max_seq_len == 32
    _assert_flavors_match(bundle, ids, ref)
    # past max_position_embeddings transformers rescales by the running length: refused in one line, by name
    with pytest.raises(LinesideError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=33))
    msg = str(e.value)
    assert "\n" not in msg and "--max-seq-len 33" in msg and "'dynamic'" in msg and "at most 32" in msg, msg
    assert "max_position_embeddings" in msg, msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def _hf_config(family: str, d: dict):
    from transformers import LlamaConfig, Qwen2Config

    return (LlamaConfig if family == "llama" else Qwen2Config).from_dict(dict(d))


@pytest.mark.parametrize("rope", [
    dict(rope_theta=1e6),  # transformers 4's spelling
    dict(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),  # transformers 5's
    # both: transformers 5 keeps rope_parameters' theta (a stale top-level one is only a default)
    dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    dict(rope_theta=1e4, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                          "original_max_position_embeddings": 16}),
])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rope_theta_is_the_one_transformers_uses(family, rope):
    d = dict(BASE, model_type=family, **json.loads(json.dumps(rope)))
    want = _hf_config(family, d).rope_parameters["rope_theta"]
    assert ModelConfig.from_hf_dict(d).rope_theta == want


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_partial_rotary_factor_is_refused_in_one_line(dense_checkpoint, tmp_path, family, where):
    """transformers' Llama/Qwen2 rotate the whole head whatever partial_rotary_factor says (other engines rotate
    part of it): a bundle rotating part of the head disagreed with transformers; it is refused, by name."""
    ckpt = dense_checkpoint(f"rope-partial-{family}", family, **{**BASE, "num_hidden_layers": 1, "head_dim": 32})
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    rp = cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    (cfg if where == "top" else rp)["partial_rotary_factor"] = 0.5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu", "trt"), max_seq_len=32))
    msg = str(e.value)
    assert "\n" not in msg and "partial_rotary_factor" in msg and "0.5" in msg, msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    # 1.0 (the whole head) in either spelling is what every engine computes: built as before.
    (cfg if where == "top" else rp)["partial_rotary_factor"] = 1.0
    (d / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_hf_dict(cfg).rotary_dim is None


def _unsupported_rope_types() -> list[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lineside.build.models.rope import SUPPORTED

    return sorted(set(ROPE_INIT_FUNCTIONS) - set(SUPPORTED))


def test_supported_rope_types_are_ones_transformers_computes():
    """Every type the build accepts has a transformers reference (the parity tests above check linear, llama3, yarn)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lineside.build.models.rope import SUPPORTED

    assert set(SUPPORTED) - {"default"} <= set(ROPE_INIT_FUNCTIONS)
    assert "longrope" in _unsupported_rope_types() and "dynamic" in SUPPORTED


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", _unsupported_rope_types())
def test_every_other_transformers_rope_type_is_refused_by_name(dense_checkpoint, tmp_path, kind, spelling):
    """longrope (short/long factors switched by length) and whatever else transformers computes for Llama/Qwen2
    beyond the static tables: one line naming the type, before any work."""
    ckpt = dense_checkpoint("rope-refused", "llama", **{**BASE, "num_hidden_layers": 1})
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    fields = {"factor": 2.0, "original_max_position_embeddings": 32, "short_factor": [1.0] * 8,
              "long_factor": [2.0] * 8}
    if spelling == "rope_scaling":
        cfg.update(rope_theta=10000.0, rope_scaling={"type": kind, **fields})
    else:
        cfg["rope_parameters"] = {"rope_type": kind, "rope_theta": 10000.0, **fields}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu", "trt"), max_seq_len=32))
    msg = str(e.value)
    assert "\n" not in msg and repr(kind) in msg and "not supported" in msg, msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
