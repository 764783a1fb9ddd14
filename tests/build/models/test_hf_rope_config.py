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
