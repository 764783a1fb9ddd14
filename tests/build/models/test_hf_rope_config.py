"""RoPE settings of real Hugging Face configs, read the way transformers reads them."""

from __future__ import annotations

import json
import shutil

import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.config import ModelConfig
from lineside.errors import ConfigError

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


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
