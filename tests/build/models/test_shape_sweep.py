"""Shapes and knobs real checkpoints use, against transformers in float32 (prefill and decode, both flavors).

Scaled-down look-alikes of DeepSeek-R1-Distill-Qwen-1.5B / 7B and -Llama-8B keep their head ratios, bias and
tie settings; the others cover dimensions INT4 groups don't tile, odd vocabularies, head_dim 80/112/256,
MHA/MQA, Qwen2's per-layer sliding window and a prompt longer than max_position_embeddings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.build.quant.spec import QuantSpec
from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
SWEEP = {
    # name: (family, config overrides)
    # R1-Distill-Qwen-1.5B: 12 heads / 2 kv heads, untied, sliding window configured but off, theta 1e4.
    "r1-qwen-1.5b": ("qwen2", dict(hidden_size=192, intermediate_size=1152, num_attention_heads=12,
                                   num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=False,
                                   use_sliding_window=False, sliding_window=4096, max_window_layers=21)),
    # R1-Distill-Qwen-7B ratios (28 / 4), Qwen2.5's rope theta 1e6.
    "r1-qwen-7b": ("qwen2", dict(hidden_size=448, intermediate_size=1216, num_attention_heads=28,
                                 num_key_value_heads=4, num_hidden_layers=1, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # R1-Distill-Llama-8B: 32 / 8 heads, head_dim 128 → 8 / 2 at 32, llama3 rope, odd vocabulary.
    "r1-llama-8b": ("llama", dict(hidden_size=256, intermediate_size=896, num_attention_heads=8,
                                  num_key_value_heads=2, vocab_size=1001, rope_parameters=LLAMA3)),
    # 96 inputs and 344 MLP features: no INT4 group of 64/128 tiles them.
    "ragged-96x344": ("llama", dict(hidden_size=96, intermediate_size=344, num_attention_heads=6,
                                    num_key_value_heads=2, vocab_size=1001)),
    "headdim80-mha-tied": ("qwen2", dict(hidden_size=160, intermediate_size=320, num_attention_heads=2,
                                         num_key_value_heads=2, tie_word_embeddings=True, vocab_size=1001)),
    "headdim112-14heads": ("qwen2", dict(hidden_size=112, intermediate_size=224, num_attention_heads=14,
                                         num_key_value_heads=2, head_dim=112)),
    "headdim256-mqa": ("llama", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256)),
    # Qwen2's sliding window applies to layers >= max_window_layers only (transformers' layer_types).
    "qwen2-sliding-upper": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # Qwen2 always has q/k/v biases, whatever a stray attention_bias says.
    "qwen2-attention-bias-false": ("qwen2", dict(attention_bias=False)),
    # Prompt (14) longer than max_position_embeddings (8), linear rope scaling.
    "llama-linear-short-ctx": ("llama", dict(max_position_embeddings=8, rms_norm_eps=1e-6,
                                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                              "factor": 4.0})),
}


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def ids_for(vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(vocab).integers(0, vocab, 14)]


@pytest.fixture(scope="module")
def sweep_ckpt(dense_checkpoint):
    def get(name):
        family, over = SWEEP[name]
        return dense_checkpoint(name, family, **over)

    return get


def _reference(ckpt, ids, quant_group=None, flavor="cpu"):
    """transformers logits; with ``quant_group``, with every linear fake-quantized the way the flavor stores it
    (INT4 per group — the trt flavor's fallback group where the group doesn't tile — an 8-bit head, the
    embedding table as the graph holds it)."""
    from transformers import AutoModelForCausalLM

    from lineside.build.graph.embedding import embedding_reference
    from lineside.build.quant.rtn import fake_quantize

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        if quant_group is None:
            return model(torch.tensor([ids])).logits[0].numpy()
        spec = QuantSpec(scheme="w4a16", group_size=quant_group)
        sdt = np.float16 if flavor == "trt" else np.float32
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                w = mod.weight.numpy()
                group = spec.trt_group(w.shape[1]) if flavor == "trt" else quant_group
                mod.weight.copy_(torch.from_numpy(fake_quantize(w, 4, group, sdt)))
        head_q = fake_quantize(model.lm_head.weight.detach().numpy().copy(), 8, None, sdt)
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.from_numpy(embedding_reference(emb.numpy().copy(), spec, flavor)))
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
        return hidden @ head_q.T + (model.lm_head.bias.numpy() if model.lm_head.bias is not None else 0)


def _check(bundle, flavor, ids, ref, tol):
    be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0, threads=1)
    pre, dec = compute_logits(be, ids, "prefill"), compute_logits(be, ids, "decode")
    assert pre.shape == ref.shape
    assert rel_err(pre, ref) < tol, (flavor, "prefill", rel_err(pre, ref))
    assert rel_err(dec, ref) < tol, (flavor, "decode", rel_err(dec, ref))


@pytest.mark.parametrize("name", list(SWEEP))
def test_fp32_matches_transformers(sweep_ckpt, tmp_path, name):
    ckpt = sweep_ckpt(name)
    vocab = SWEEP[name][1].get("vocab_size", 300)
    ids = ids_for(vocab)
    ref = _reference(ckpt, ids)
    out = build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu", "trt"), max_seq_len=32))
    bundle = open_bundle(out)
    for flavor in ("cpu", "trt"):
        _check(bundle, flavor, ids, ref, 1e-4)


@pytest.mark.parametrize("name,group,flavors", [
    ("r1-qwen-1.5b", 128, ("cpu", "trt")),  # 192 inputs: cpu takes a ragged group of 64, trt falls back to 64
    ("r1-llama-8b", 128, ("cpu", "trt")),
    ("ragged-96x344", 64, ("cpu",)),  # ragged groups of 32 and 24 on MatMulNBits
    ("headdim80-mha-tied", 64, ("cpu",)),  # the tied 8-bit table shared by embedding and head, 160 inputs
    ("qwen2-sliding-upper", 64, ("cpu", "trt")),
])
def test_w4a16_equals_fake_quantized_reference(sweep_ckpt, tmp_path, name, group, flavors):
    ckpt = sweep_ckpt(name)
    ids = ids_for(SWEEP[name][1].get("vocab_size", 300))
    out = build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="w4a16", flavors=flavors, max_seq_len=32,
                                                          group_size=group, accuracy_level=0))
    bundle = open_bundle(out)
    for flavor in flavors:
        _check(bundle, flavor, ids, _reference(ckpt, ids, group, flavor), 2e-3)


def test_trt_refuses_inputs_no_int4_block_tiles(sweep_ckpt, tmp_path):
    """TensorRT's INT4 blocks are 64 or 128: 96 inputs are refused in one line naming the layer, before any work."""
    with pytest.raises(LinesideError) as e:
        build_bundle(sweep_ckpt("ragged-96x344"), tmp_path / "b",
                     BuildOptions(quant="w4a16", flavors=("trt",), max_seq_len=32, group_size=64))
    msg = str(e.value)
    assert "\n" not in msg and "in_features 96" in msg and "w8a16" in msg
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
