"""Write small GGUF files the way llama.cpp's convert_hf_to_gguf.py does (names, q/k permutation)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in HF_TO_GGUF_TOP:
        return f"{HF_TO_GGUF_TOP[base]}.{kind}"
    parts = base.split(".")
    assert parts[:2] == ["model", "layers"], hf
    return f"blk.{parts[2]}.{HF_TO_GGUF_BLOCK['.'.join(parts[3:])]}.{kind}"


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offsets of the float16 super-block scales (d, dmin) of the types gguf-py dequantizes but cannot quantize.
SYNTH_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
                "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ3_S": (0,)}


def synth_blocks(shape: tuple[int, ...], qtype: str, seed: int = 0, peak: float = 0.3) -> np.ndarray:
    """Random blocks of a GGML type gguf-py has no quantizer for (K-quants, IQ): random codes and sub-scales, the
    float16 super-block scales set so the tensor's largest weight is about `peak` (the writer passes the float
    tensor's, so the model keeps its scale). Its values are whatever gguf's dequantize makes of them; readers are
    compared on those."""
    from gguf.quants import dequantize

    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rows, k = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    for at in SYNTH_SCALES[qtype]:
        raw[:, :, at : at + 2] = one
    top = float(np.abs(dequantize(raw.reshape(rows, -1), qt)).max())
    for at in SYNTH_SCALES[qtype]:
        d = (peak / top * rng.uniform(0.5, 1.0, raw.shape[:2])).astype(np.float16)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_model_gguf(
    path: Path, arch: str, cfg: dict, state: dict[str, np.ndarray], qtypes: dict[str, str] | None = None,
    tokenizer: dict | None = None, metadata: dict[str, float | int] | None = None,
) -> None:
    """state: HF names → float32; qtypes: HF name → GGML type name (default F32); metadata: more keys (a float
    as float32, an int as uint32, a str as a string)."""
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        add_tokenizer(w, **tokenizer)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, arr in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        a = np.asarray(arr, dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = llama_permute(a, n_head, n_head)
        elif arch == "llama" and ".k_proj." in name:
            a = llama_permute(a, n_head, n_kv)
        q = qtypes.get(name, "F32")
        if q == "F32":
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
        else:
            qt = gguf.GGMLQuantizationType[q]
            data = synth_blocks(a.shape, q, peak=float(np.abs(a).max())) if q in SYNTH_SCALES else quantize(a, qt)
            w.add_tensor(gguf_name(name), data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_tokenizer(
    w: gguf.GGUFWriter, tokens: list[str], types: list[int], merges: list[str], pre: str,
    bos: int | None = None, eos: int | None = None, add_bos: bool | None = None, chat_template: str | None = None,
    model: str = "gpt2", scores: list[float] | None = None,
) -> None:
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)
