"""AWQ folds its scales into norms and neighbouring linears exactly, and the AWQ build runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lineside.build.checkpoint import open_checkpoint
from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.build.quant.calibrate import awq_plan_dense, calibration_ids, default_calibration_text
from lineside.bundle import open_bundle
from lineside.config import ModelConfig
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150]


@pytest.mark.parametrize("variant", ["qwen2-bias-tied", "llama-bias"])
def test_folded_scales_preserve_the_float_model(tiny_dense, variant):
    from transformers import AutoModelForCausalLM

    path = tiny_dense(variant)
    ck = open_checkpoint(path)
    cfg = ModelConfig.from_hf_dict(ck.hf_config)
    ids = calibration_ids(lambda t: [b % cfg.vocab_size for b in t.encode()], default_calibration_text())
    plan = awq_plan_dense(cfg, ck.get, ids[:, :64], group_size=64, bits=4)
    assert any(not np.allclose(s, 1) for s in plan.col_scale.values()), "AWQ picked no scaling at all"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
        for name, p in model.named_parameters():
            if name in plan.input_scale:  # the graph feeds x/s to W*s: equal to W x in float
                continue
            p.copy_(torch.from_numpy(plan.transform(name, p.numpy())))
        out = model(torch.tensor([IDS])).logits[0].numpy()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-4
    for rtn, awq in plan.errors.values():
        assert awq <= rtn + 1e-9


def test_awq_bundle_runs_and_decode_equals_prefill(tiny_dense, tmp_path):
    out = build_bundle(tiny_dense("llama-gqa"), tmp_path / "b",
                       BuildOptions(quant="w4a16", method="awq", group_size=64, flavors=("cpu", "trt"),
                                    max_seq_len=32, accuracy_level=0))
    b = open_bundle(out)
    awq = b.manifest.quantization["awq"]
    assert "relative_output_error" in awq and awq["guard_tokens"] > 0
    assert isinstance(awq["guard_held_out"], bool)
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(b, flavor=flavor, accuracy_level=0)
        pre, dec = compute_logits(be, IDS, "prefill"), compute_logits(be, IDS, "decode")
        assert np.abs(pre - dec).max() / np.abs(pre).max() < 1e-4


def test_lora_on_an_awq_bundle_matches_peft(tiny_dense, peft_adapter, tmp_path, monkeypatch):
    """AWQ folds 1/s into the norms and up_proj's rows, so the graph's q/k/v, gate/up and down inputs are x/s:
    a LoRA delta must still see x (B·A·x, as peft computes it), not x/s. w8a16 keeps the weights' own error small,
    so the adapter's delta (adapter logits minus base logits) is compared with peft's (an int8 grid still moves it
a few percent)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lineside.build.quant import calibrate
    from lineside.lora import read_adapter
    from lineside.runtime.lora_stack import LoraSlotsConfig

    losses = iter([1.5, 1.0])  # RTN, then AWQ: keep AWQ's scales (a random model's losses are noise)
    monkeypatch.setattr(calibrate, "calibration_nll", lambda *_a: next(losses))
    path = tiny_dense("llama-gqa")
    out = build_bundle(path, tmp_path / "b", BuildOptions(quant="w8a16", method="awq", flavors=("cpu", "trt"),
                                                          max_seq_len=32, accuracy_level=0, max_lora_rank=8))
    b = open_bundle(out)
    assert b.manifest.quantization["awq"]["fell_back_to_rtn"] is False
    adapter = peft_adapter("llama-gqa", "all-rslora")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_base = base(torch.tensor([IDS])).logits[0].numpy()
        ref = PeftModel.from_pretrained(base, adapter).eval()(torch.tensor([IDS])).logits[0].numpy()
    ref_delta = ref - ref_base
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(b, flavor=flavor, accuracy_level=0, lora=LoraSlotsConfig(1, 8))
        be.load_adapter(1, read_adapter(adapter, b.config, "all-rslora"))
        delta = compute_logits(be, IDS, "prefill", adapter=1) - compute_logits(be, IDS, "prefill", adapter=0)
        err = float(np.abs(delta - ref_delta).max() / np.abs(ref_delta).max())
        assert err < 0.12, (flavor, err)  # 0.28 when the delta saw x/s; an RTN w8a16 bundle: 0.03
