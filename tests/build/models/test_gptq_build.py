"""--method gptq: the bundle holds GPTQ's grids exactly (both flavors), and the guard falls back to RTN."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from lineside.build.checkpoint import open_checkpoint
from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.build.quant import calibrate_gptq
from lineside.build.quant.spec import QuantSpec
from lineside.bundle import open_bundle
from lineside.config import ModelConfig
from lineside.errors import LinesideError
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12, 200, 33]
SPEC = QuantSpec(scheme="w4a16", group_size=64)


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def grid_reference(path, grids, ids, flavor):
    """transformers with every linear set to GPTQ's dequantized grid, the head int8 per channel and the
    embedding as the flavor's graph stores them."""
    from transformers import AutoModelForCausalLM

    from lineside.build.graph.embedding import embedding_reference
    from lineside.build.quant.rtn import fake_quantize

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grids:
                p.copy_(torch.from_numpy(grids[name].dequantize()))
        head_q = fake_quantize(model.lm_head.weight.numpy().copy(), 8, None,
                               np.float16 if flavor == "trt" else np.float32)
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.from_numpy(embedding_reference(emb.numpy().copy(), SPEC, flavor)))
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
        float_logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0].numpy()
    return hidden @ head_q.T, float_logits


@pytest.fixture(autouse=True)
def short_calibration(monkeypatch):
    monkeypatch.setattr(calibrate_gptq, "GPTQ_MAX_SEQS", 4)  # 1024 calibration tokens keep these tests quick


def test_gptq_bundle_equals_its_grids(tiny_dense, tmp_path, monkeypatch):
    path = tiny_dense("llama-gqa")
    plans = []
    real = calibrate_gptq.gptq_plan_for
    monkeypatch.setattr(calibrate_gptq, "gptq_plan_for", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    # A random-weight model's calibration losses are noise (~log vocab): script the guard's comparison so it
    # keeps GPTQ whatever the calibration text is (the fallback is test_guard_falls_back_to_rtn).
    losses = iter([1.5, 1.0])  # RTN, then GPTQ
    monkeypatch.setattr(calibrate_gptq, "calibration_nll", lambda *_a: next(losses))
    out = build_bundle(path, tmp_path / "b", BuildOptions(quant="w4a16", method="gptq", group_size=64,
                                                          flavors=("cpu", "trt"), max_seq_len=32, accuracy_level=0))
    rec = open_bundle(out).manifest.quantization
    g = rec["gptq"]
    assert rec["method"] == "gptq" and not g["fell_back_to_rtn"], (g["calibration_nll_rtn"], g["calibration_nll_gptq"])
    assert all(e["gptq"] < e["rtn"] for e in g["relative_output_error"].values())
    (plan,) = plans
    assert len(plan.grids) == 7 * 2 and {x.group_size for x in plan.grids.values()} == {64}
    bundle = open_bundle(out)
    for flavor in ("cpu", "trt"):
        ref_q, ref = grid_reference(path, plan.grids, IDS, flavor)
        be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0)
        pre, dec = compute_logits(be, IDS, "prefill"), compute_logits(be, IDS, "decode")
        assert rel_err(dec, ref_q) < 2e-3, (flavor, rel_err(dec, ref_q))
        assert rel_err(pre, dec) < 1e-4, flavor
        assert rel_err(dec, ref) < 0.35, (flavor, rel_err(dec, ref))


def test_guard_falls_back_to_rtn(tiny_dense, tmp_path, monkeypatch):
    """When GPTQ's calibration loss is not lower, the bundle is the RTN one and both losses are recorded.

    A random-weight model's losses are noise (~log vocab), so the loss comparison is scripted here.
    """
    losses = iter([1.0, 1.5])  # RTN, then GPTQ
    monkeypatch.setattr(calibrate_gptq, "calibration_nll", lambda *_a: next(losses))
    path = tiny_dense("llama-gqa")
    opts = dict(quant="w4a16", group_size=64, flavors=("cpu",), max_seq_len=32, accuracy_level=0)
    gptq = open_bundle(build_bundle(path, tmp_path / "g", BuildOptions(method="gptq", **opts)))
    rtn = open_bundle(build_bundle(path, tmp_path / "r", BuildOptions(method="rtn", **opts)))
    g = gptq.manifest.quantization["gptq"]
    assert g["fell_back_to_rtn"] is True and (g["calibration_nll_rtn"], g["calibration_nll_gptq"]) == (1.0, 1.5)
    a = compute_logits(OnnxRuntimeBackend(gptq, accuracy_level=0), IDS, "prefill")
    b = compute_logits(OnnxRuntimeBackend(rtn, accuracy_level=0), IDS, "prefill")
    np.testing.assert_array_equal(a, b)


def test_refusals_are_one_line(tiny_dense):
    with pytest.raises(LinesideError) as e:
        BuildOptions(quant="w8a16", method="gptq").validate()
    assert "\n" not in str(e.value) and "w4a16" in str(e.value)
    ck = open_checkpoint(tiny_dense("llama-gqa"))
    try:
        cfg = replace(ModelConfig.from_hf_dict(ck.hf_config), architecture="deepseek_v4")
        with pytest.raises(LinesideError) as e:
            calibrate_gptq.gptq_plan_for(cfg, ck, SPEC, ("cpu",), None, progress=lambda _d, _t: (lambda _n: None),
                                         log=lambda _m: None)
        assert "\n" not in str(e.value) and "--method rtn" in str(e.value)
    finally:
        ck.close()
