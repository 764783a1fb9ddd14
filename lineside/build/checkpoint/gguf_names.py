"""GGUF ↔ Hugging Face tensor names and llama.cpp's q/k row permutation, for llama and qwen2."""

from __future__ import annotations

import re

import numpy as np

# GGUF `general.architecture` → (HF architectures[0], model_type, q/k rows permuted by the converter).
# llama.cpp's convert_hf_to_gguf.py LlamaModel.modify_tensors permutes q_proj/k_proj (weight and
# bias) so its interleaved RoPE kernel can be used; Qwen2Model inherits from TextModel and does not.
ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp may carry that have no Hugging Face weight (rope_freqs: llama3 scaling factors).
IGNORED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd.*)$")
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name for a GGUF tensor name, or None when it has no mapping."""
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    m = _TOP_RE.match(gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    return None


def permuted_heads(hf: str, n_head: int, n_head_kv: int) -> int | None:
    """Number of heads the converter permuted this tensor's rows with (q: n_head, k: n_kv), else None."""
    if ".self_attn.q_proj." in hf:
        return n_head
    if ".self_attn.k_proj." in hf:
        return n_head_kv
    return None


def permute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute on the leading axis: HF rotate-half order → interleaved pairs."""
    n = rows.shape[0]
    return rows.reshape(n_head, 2, n // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of permute_rows; works on any per-row payload (floats or GGML block bytes)."""
    n = rows.shape[0]
    if n % (2 * n_head):
        raise ValueError(f"{n} rows do not split into {n_head} heads of even size")
    out = rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    return np.ascontiguousarray(out)
