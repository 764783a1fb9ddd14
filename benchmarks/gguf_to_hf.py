"""Write a Hugging Face Llama directory (safetensors + config.json + tokenizer) from a llama GGUF file.

onnxruntime-genai's model builder reads only HF directories, so the side-by-side benchmark
turns the same GGUF that llama.cpp and trtedge use into one: weights dequantized with the
`gguf` package, llama.cpp's q/k row permutation undone, tokenizer rebuilt from the GGUF's
vocabulary and merges with SmolLM2's real pre-tokenizer (digits split one by one, then byte-level).

Usage: python benchmarks/gguf_to_hf.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

# GGUF tensor name (per layer, after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
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

# Pre-tokenizers llama.cpp knows by name that we can express with `tokenizers` (REFERENCE.md: the trap).
_PRE_TOKENIZERS = {
    "smollm": [{"type": "Digits", "individual_digits": True}],
    "gpt2": [],
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's `permute` (interleaved -> half-split rotary rows) on a [out, in] weight."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, n_head: int, n_kv_head: int) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name."""
    from gguf import quants

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF shapes are reversed (ne0 first); dequantize already returns rows x cols in numpy order.
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        name = t.name
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            out["model.norm.weight"] = w
        elif name == "output.weight":
            out["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, layer, kind, _ = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                raise SystemExit(f"unexpected GGUF tensor {name}: this converter handles llama only")
            if kind == "attn_q":
                w = unpermute_qk(w, n_head)
            elif kind == "attn_k":
                w = unpermute_qk(w, n_kv_head)
            out[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = w
        elif name == "rope_freqs.weight":
            continue
        else:
            raise SystemExit(f"unexpected GGUF tensor {name}: this converter handles llama only")
    return out


def write_tokenizer(reader, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json from the GGUF vocabulary, merges and chat template."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = list(_field(reader, "tokenizer.ggml.merges"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    pre_name = _field(reader, "tokenizer.ggml.pre", "gpt2")
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or pre_name not in _PRE_TOKENIZERS:
        raise SystemExit(f"tokenizer {pre_name!r} is not handled by this converter")
    specials = [i for i, ty in enumerate(types) if ty == 3]  # 3 = CONTROL
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": _PRE_TOKENIZERS[pre_name]
            + [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id", eos)
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad],
        "unk_token": tokens[_field(reader, "tokenizer.ggml.unknown_token_id", 0)],
        "add_prefix_space": False, "model_max_length": int(_field(reader, "llama.context_length")),
        "clean_up_tokenization_spaces": False,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama-architecture GGUF into an HF directory (float32 safetensors); returns out_dir."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    if _field(reader, "general.architecture") != "llama":
        raise SystemExit(f"{gguf_path}: only llama-architecture GGUF files are handled")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    hidden = int(_field(reader, "llama.embedding_length"))
    weights = read_weights(reader, n_head, n_kv)
    tied = "lm_head.weight" not in weights
    head_dim = hidden // n_head
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": tied,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    write_tokenizer(reader, out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    print(gguf_to_hf(Path(sys.argv[1]), Path(sys.argv[2])))
