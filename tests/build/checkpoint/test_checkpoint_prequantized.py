"""Checkpoints published already quantized: FP8 / INT8 weights with a ``weight_scale`` companion (compressed-tensors
"FP8-dynamic" / "w8a8", FBGEMM FP8, ModelOpt FP8) are read dequantized — checked against transformers on the
dequantized float copy — and packed INT4 formats (GPTQ, AWQ, bitsandbytes, compressed-tensors pack-quantized), which
lineside cannot read, are refused in one line that says so instead of calling the checkpoint incomplete."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.bundle import open_bundle
from lineside.errors import CheckpointError
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 17, 42, 5, 99, 250, 3, 77]
FP8_CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"]}


@pytest.fixture(scope="module")
def base(tiny_dense):
    return tiny_dense("llama-gqa")


def _requantized(base, out, quantize, quant_config):
    """A copy of ``base`` whose q/k/v/o/gate/up/down weights ``quantize`` replaced (name, w → tensors), and the
    float checkpoint those tensors stand for (what transformers runs as the reference)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(base / "model.safetensors")
    stored, floats = {}, {}
    for name, w in tensors.items():
        if name.endswith("proj.weight"):
            parts, floats[name] = quantize(name[: -len(".weight")], w)
            stored.update(parts)
        else:
            stored[name] = floats[name] = w
    for d, t in ((out, stored), (out.with_name(out.name + "-float"), floats)):
        shutil.copytree(base, d)
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(cfg))
    return out, out.with_name(out.name + "-float")


def fp8_per_channel(prefix, w):  # compressed-tensors FP8-dynamic, FBGEMM FP8: bf16 scale [out, 1]
    s = (w.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.bfloat16)
    q = (w / s.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {prefix + ".weight": q, prefix + ".weight_scale": s, prefix + ".input_scale": torch.ones(1)}, \
        q.float() * s.float()


def fp8_per_tensor(prefix, w):  # ModelOpt FP8: one float32 scale per tensor, shape []
    s = w.abs().max() / 448.0
    q = (w / s).to(torch.float8_e4m3fn)
    return {prefix + ".weight": q, prefix + ".weight_scale": s.reshape(())}, q.float() * s


def int8_per_channel(prefix, w):  # compressed-tensors int-quantized (w8a8), symmetric
    s = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(w / s).clamp(-127, 127).to(torch.int8)
    return {prefix + ".weight": q, prefix + ".weight_scale": s}, q.float() * s


@pytest.mark.parametrize("quantize,config", [
    (fp8_per_channel, FP8_CT),
    (fp8_per_tensor, {"quant_method": "modelopt", "quant_algo": "FP8"}),
    (int8_per_channel, {**FP8_CT, "format": "int-quantized"}),
])
def test_scaled_weights_are_dequantized(base, tmp_path, quantize, config):
    from transformers import AutoModelForCausalLM

    ckpt, floats = _requantized(base, tmp_path / "q", quantize, config)
    model = AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    out = build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    got = compute_logits(OnnxRuntimeBackend(open_bundle(out), accuracy_level=0, threads=1), IDS)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 1e-4


def test_asymmetric_int8_is_refused(base, tmp_path):
    def asym(prefix, w):
        parts, deq = int8_per_channel(prefix, w)
        return {**parts, prefix + ".weight_zero_point": torch.zeros(w.shape[0], 1, dtype=torch.int8)}, deq

    ckpt, _ = _requantized(base, tmp_path / "q", asym, {**FP8_CT, "format": "int-quantized"})
    with pytest.raises(CheckpointError) as e:
        build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    msg = str(e.value)
    assert "\n" not in msg and "weight_zero_point" in msg and "q_proj" in msg, msg
    assert not (tmp_path / "b.partial").exists()


def gptq_packed(prefix, w):  # AutoGPTQ / AutoAWQ layout: int32-packed nibbles, no `.weight`
    o, i = w.shape
    return {prefix + ".qweight": torch.zeros(i // 8, o, dtype=torch.int32),
            prefix + ".qzeros": torch.zeros(1, o // 8, dtype=torch.int32),
            prefix + ".scales": torch.ones(1, o, dtype=torch.float16)}, w


def ct_packed(prefix, w):  # compressed-tensors pack-quantized (w4a16)
    o, i = w.shape
    return {prefix + ".weight_packed": torch.zeros(o, i // 8, dtype=torch.int32),
            prefix + ".weight_scale": torch.ones(o, i // 32, dtype=torch.bfloat16),
            prefix + ".weight_shape": torch.tensor([o, i])}, w


def bnb_4bit(prefix, w):  # bitsandbytes nf4 as saved: the weight flattened into uint8 pairs, plus its state
    return {prefix + ".weight": torch.zeros(w.numel() // 2, 1, dtype=torch.uint8),
            prefix + ".weight.absmax": torch.ones(w.numel() // 64)}, w


def nvfp4_packed(prefix, w):  # ModelOpt NVFP4: two e2m1 codes a byte, an FP8 scale per 16 inputs, a global scale
    o, i = w.shape
    return {prefix + ".weight": torch.zeros(o, i // 2, dtype=torch.uint8),
            prefix + ".weight_scale": torch.ones(o, i // 16).to(torch.float8_e4m3fn),
            prefix + ".weight_scale_2": torch.ones(()), prefix + ".input_scale": torch.ones(())}, w


@pytest.mark.parametrize("quantize,config,method", [
    (gptq_packed, {"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
    (gptq_packed, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "awq"),
    (ct_packed, {**FP8_CT, "format": "pack-quantized"}, "compressed-tensors"),
    (bnb_4bit, {"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    (nvfp4_packed, {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"),
])
def test_packed_int4_checkpoints_are_refused_as_such(base, tmp_path, quantize, config, method):
    ckpt, _ = _requantized(base, tmp_path / "q", quantize, config)
    with pytest.raises(CheckpointError) as e:
        build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=32))
    msg = str(e.value)
    assert "\n" not in msg and method in msg and "already quantized" in msg and "re-download" not in msg, msg
    assert not (tmp_path / "b.partial").exists()


def test_a_readable_quantized_checkpoint_missing_a_tensor_is_called_incomplete(base, tmp_path):
    def drop_one(prefix, w):
        parts, deq = fp8_per_channel(prefix, w)
        return ({} if prefix == "model.layers.1.mlp.down_proj" else parts), deq

    ckpt, _ = _requantized(base, tmp_path / "q", drop_one, FP8_CT)
    with pytest.raises(CheckpointError) as e:
        build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    msg = str(e.value)
    assert "'model.layers.1.mlp.down_proj.weight' is missing" in msg and "re-download" in msg, msg
