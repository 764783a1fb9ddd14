"""benchmarks/gguf_to_hf.py: a small GGUF written like llama.cpp (q/k rows permuted) comes back as the HF
weights it was made from, with SmolLM2's digit-splitting pre-tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gguf_to_hf import gguf_to_hf  # noqa: E402


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """As written in llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_small_gguf_round_trip(tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    rng = np.random.default_rng(1)
    hidden, n_head, n_kv, ffn, vocab = 32, 4, 2, 64, 40
    hd = hidden // n_head
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.norm.weight": rng.standard_normal(hidden),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((n_head * hd, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((n_kv * hd, hidden)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((n_kv * hd, hidden)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((hidden, hidden)),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, ffn)),
    }
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    tokens = [f"t{i}" for i in range(vocab - 2)] + ["<s>", "</s>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            key = name.removeprefix("model.layers.0.").removesuffix(".weight")
            gname = f"blk.0.{names[key]}.weight"
            if key == "self_attn.q_proj":
                t = llamacpp_permute(t, n_head)
            elif key == "self_attn.k_proj":
                t = llamacpp_permute(t, n_kv)
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf")
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(hf)
    for k in hf:
        np.testing.assert_array_equal(back[k], hf[k], err_msg=k)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (4, 2, True)
    tok = json.loads((out / "tokenizer.json").read_text())
    from tokenizers import Tokenizer

    pieces = [p for p, _ in Tokenizer.from_file(str(out / "tokenizer.json")).pre_tokenizer.pre_tokenize_str("a 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]  # SmolLM2's pre-tokenizer splits digits one by one
    assert [a["content"] for a in tok["added_tokens"]] == ["<s>", "</s>"]
