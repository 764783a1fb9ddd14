"""Real checkpoint variants that are fine (rotary inv_freq buffers saved by old transformers, a tied LM head stored
anyway, a stored head of other values under a tied config) build, and compute what transformers computes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.bundle import open_bundle
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150]


def _variant(src, dst, edit):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _same_head(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()


def _other_head(t):
    t["lm_head.weight"] = 0.5 * t["model.embed_tokens.weight"][::-1].copy() + 0.01


def _inv_freq(t):
    for i in range(2):  # what transformers < 4.31 saved as a buffer; a value the graph must not take
        t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.full(8, 7.0, np.float32)


@pytest.mark.parametrize("variant,edit", [("qwen2-bias-tied", _same_head), ("qwen2-bias-tied", _other_head),
                                          ("llama-mqa-tied-llama3", _other_head), ("llama-gqa", _inv_freq)])
def test_variant_builds_and_matches_transformers(tiny_dense, tmp_path, variant, edit):
    from transformers import AutoModelForCausalLM

    d = _variant(tiny_dense(variant), tmp_path / "c", edit)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    notes: list[str] = []
    out = build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32,
                                                       accuracy_level=0), log=notes.append)
    be = OnnxRuntimeBackend(open_bundle(out), flavor="cpu", accuracy_level=0)
    got = compute_logits(be, IDS, "prefill")
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 1e-4
    assert any("differs from" in n for n in notes) == (edit is _other_head), notes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_shards_with_index_match_transformers(tiny_dense, tmp_path, dtype):
    """A checkpoint saved as bf16 / fp16 shards with model.safetensors.index.json (how 7B+ models ship): both flavors
    compute what transformers computes from the same files, read in float32."""
    from transformers import AutoModelForCausalLM

    src = tiny_dense("qwen2-bias-tied")
    d = tmp_path / "c"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("model*.safetensors*"))
    AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype)).save_pretrained(d, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 2
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    out = build_bundle(d, tmp_path / "o", BuildOptions(quant="fp32", flavors=("cpu", "trt"), max_seq_len=32))
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(open_bundle(out), flavor=flavor, accuracy_level=0, threads=1)
        for mode in ("prefill", "decode"):
            got = compute_logits(be, IDS, mode)
            assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 1e-4, (flavor, mode)
