"""Official ↔ HF tensor names (checked by transformers loading them) and the FP8 / MXFP4 dequantizers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lineside.build.checkpoint.fp8_mxfp4 import (
    dequant_fp8_blocks,
    dequant_mxfp4,
    dequantize,
    quantize_fp8_blocks,
    quantize_mxfp4,
    unpack_fp4,
)
from lineside.build.models.deepseek_v4 import hf_to_official, official_to_hf
from lineside.errors import CheckpointError


@pytest.mark.parametrize("schedule", ["a", "b"])
def test_names_round_trip(v4, schedule):
    for name in v4.model(schedule).state_dict():
        if "inv_freq" in name or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        off = hf_to_official(name)
        assert not off.startswith("model.") and official_to_hf(off) == name, (name, off)
        # transformers' save_pretrained writes official names under a "model." prefix; HF names pass unchanged.
        assert official_to_hf(name) == name
    assert official_to_hf("layers.3.ffn.experts.7.w3.weight") == "model.layers.3.mlp.experts.gate_up_proj"
    assert official_to_hf("layers.1.attn.indexer.compressor.ape") == "model.layers.1.self_attn.compressor.indexer.position_bias"


def test_transformers_loads_our_official_names(v4):
    """The official-named copy loads into DeepseekV4ForCausalLM with nothing missing and identical weights."""
    from transformers import DeepseekV4ForCausalLM

    d = v4.official_dir("a", None, False)
    loaded, info = DeepseekV4ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ref = v4.model("a").state_dict()
    for k, t in loaded.state_dict().items():
        assert np.array_equal(t.numpy(), ref[k].numpy()), k


@pytest.mark.parametrize("ue8m0", [True, False])
def test_fp8_blocks_match_transformers_dequant(ue8m0):
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = np.random.default_rng(0).standard_normal((256, 384)).astype(np.float32) * 0.05
    q, s = quantize_fp8_blocks(w, 128, ue8m0=ue8m0)
    ours = dequant_fp8_blocks(q, s, "w")
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    ts = torch.from_numpy(s.view(np.uint8)).view(torch.float8_e8m0fnu) if ue8m0 else torch.from_numpy(s)
    ref = Fp8Dequantize(None)._dequantize_one(tq, ts, torch.float32).numpy()
    assert np.array_equal(ours, ref)
    assert np.abs(ours - w).max() <= 0.07 * np.abs(w).max()  # e4m3: 3 mantissa bits
    if ue8m0:  # raw ue8m0 bytes (uint8 exponents) read the same as float8_e8m0fnu
        assert np.array_equal(dequant_fp8_blocks(q, s.view(np.uint8), "w"), ours)


def test_mxfp4_matches_transformers_dequant():
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    packed, s = quantize_mxfp4(w)
    ours = dequant_mxfp4(packed, s, "e")
    ref = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(packed),
                                              torch.from_numpy(s.view(np.uint8)).view(torch.float8_e8m0fnu),
                                              torch.float32).numpy()
    assert np.array_equal(ours, ref)
    assert np.abs(ours - w).max() <= 0.34 * np.abs(w).max()
    # low nibble first: byte 0x21 holds codes 1 (0.5) then 2 (1.0)
    assert unpack_fp4(np.array([[0x21]], np.uint8)).tolist() == [[0.5, 1.0]]


@pytest.mark.parametrize("raw,scale,words", [
    (np.zeros((4, 4), np.int32), None, "source dtype int32"),
    (np.zeros((4, 4), ml_dtypes.float8_e4m3fn), None, "no block-scale companion"),
    (np.zeros((4, 8), np.int8), np.ones((4, 3), np.float32), "does not match packed weight"),
    (np.zeros((4, 4), ml_dtypes.float8_e4m3fn), np.ones((3, 3), np.float32), "does not tile weight"),
])
def test_bad_source_dtypes(raw, scale, words):
    with pytest.raises(CheckpointError) as e:
        dequantize(raw, scale, "layers.0.attn.wq_a.weight")
    assert words in str(e.value) and "layers.0.attn.wq_a.weight" in str(e.value) and "\n" not in str(e.value)


class _DictReader:
    """The reader interface over a dict of numpy arrays (names as stored)."""

    def __init__(self, d: dict) -> None:
        self.d = d

    def names(self) -> list[str]:
        return list(self.d)

    def get_raw(self, name: str) -> np.ndarray:
        return self.d[name]


def test_hf_named_fp8_stacked_experts_dequantize_per_expert():
    """In-memory HF names with FP8 stacked experts ([E, 2I, D] + ``gate_up_proj_scale_inv``) slice per expert."""
    from lineside.build.models.deepseek_v4 import V4Source

    rng = np.random.default_rng(2)
    e, inter, d = 3, 64, 128
    gu, dn = rng.standard_normal((e, 2 * inter, d)).astype(np.float32), rng.standard_normal((e, d, inter)).astype(np.float32)
    q_gu, s_gu = quantize_fp8_blocks(gu, 128, ue8m0=False)
    q_dn, s_dn = quantize_fp8_blocks(dn, 128, ue8m0=True)
    p = "model.layers.0.mlp.experts"
    qw, sw = quantize_fp8_blocks(rng.standard_normal((64, 128)).astype(np.float32), 128)
    src = V4Source(_DictReader({f"{p}.gate_up_proj": q_gu, f"{p}.gate_up_proj_scale_inv": s_gu,
                                f"{p}.down_proj": q_dn, f"{p}.down_proj_scale_inv": s_dn,
                                "model.layers.0.self_attn.q_a_proj.weight": qw,
                                "model.layers.0.self_attn.q_a_proj.weight_scale_inv": sw}))
    assert not src.official and src.has("model.layers.0.self_attn.q_a_proj.weight")
    assert not src.has("model.layers.0.self_attn.q_a_proj.weight_scale_inv")
    full_gu, full_dn = dequant_fp8_blocks(q_gu, s_gu, "gu"), dequant_fp8_blocks(q_dn, s_dn, "dn")
    for i in range(e):
        g, u, dd = src.expert(0, i, inter)
        assert np.array_equal(g, full_gu[i, :inter]) and np.array_equal(u, full_gu[i, inter:])
        assert np.array_equal(dd, full_dn[i])
    assert np.array_equal(src.get("model.layers.0.self_attn.q_a_proj.weight"), dequant_fp8_blocks(qw, sw, "w"))
