"""transformers float32 logits with every cached K and V replaced by what a quantized KV cache gives back, written
from README "Quantized KV cache" (not from the graph): the bound a bundle's quantized KV path is held to.

int8: per (token, KV head) s = fp16(amax / 127), values round(x / s) on ±127. int4: per (token, KV head, 16 channels)
m = fp16(min), s = fp16((max − m) / 15), values round((x − m) / s) on 0..15; keys first centred on their calibrated
mean, and a sequence's first 4 entries read from fp16 instead. Both in the Hadamard-rotated basis when head_dim is a
power of two (q·k and the attention output unchanged by the rotation itself).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

MIN_SCALE = 2.0 ** -20
SINK = 4


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def fake_quantize(x: torch.Tensor, kv: str) -> torch.Tensor:
    """x [..., d] -> what the cache stores for it, dequantized (float32)."""
    if kv == "int8":
        s = _fp16(torch.clamp(x.abs().amax(-1, keepdim=True) / 127, min=MIN_SCALE))
        return torch.clamp(torch.round(x / s), -127, 127) * s
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // 16 if d >= 16 else 1, -1)
    lo = _fp16(g.amin(-1, keepdim=True))
    s = _fp16(torch.clamp((g.amax(-1, keepdim=True) - lo) / 15, min=MIN_SCALE))
    return (torch.clamp(torch.round((g - lo) / s), 0, 15) * s + lo).reshape(x.shape)


def hadamard(n: int) -> torch.Tensor | None:
    """Orthonormal Sylvester Hadamard matrix, None unless n is a power of two."""
    if n < 2 or n & (n - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def cached(x: torch.Tensor, kv: str, mean: torch.Tensor | None) -> torch.Tensor:
    """K or V [B, kvh, T, d] post-RoPE -> the float entries attention reads back (in the original basis)."""
    h = hadamard(x.shape[-1])
    y = x - mean if mean is not None else x
    y = y @ h if h is not None else y
    q = fake_quantize(y, kv)
    if kv == "int4":  # the first entries come from the fp16 sink state
        q = torch.cat([_fp16(y[..., :SINK, :]), q[..., SINK:, :]], dim=-2)
    q = q @ h.T if h is not None else q
    return q + mean if mean is not None else q


def quantized_kv_logits(ckpt: Path, ids: list[int], kv: str, monkeypatch: pytest.MonkeyPatch,
                        key_means: np.ndarray | None = None) -> np.ndarray:
    """transformers float32 eager logits [T, vocab] with K and V read through ``kv``'s cache format; ``key_means``
    [layers, kv_heads, head_dim]: int4's key centring (the build's calibrated means)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    mod = importlib.import_module(type(model).__module__)
    eager = mod.eager_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        mean = None if key_means is None else torch.from_numpy(key_means[module.layer_idx])[None, :, None, :]
        return eager(module, query, cached(key, kv, mean), cached(value, kv, None), *args, **kwargs)

    monkeypatch.setattr(mod, "eager_attention_forward", attention)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
