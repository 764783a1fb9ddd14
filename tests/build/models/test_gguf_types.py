"""GGUF tensor types beyond the carried Q4_0/Q4_1/Q8_0: F16, BF16, Q5_0/Q5_1, the K-quants, IQ types and the
per-tensor mixes llama-quantize writes (Q4_K_M: attn_v, ffn_down and output Q6_K beside Q4_K), on llama and qwen2,
tied and untied. Each is dequantized on read; an fp32 build must give transformers' logits for the same GGUF (which
dequantizes with gguf-py too) to float32 rounding, and llama.cpp's (its own C dequantizers, int8 activations for
these types: a few percent) where llama-cpp-python is installed. A w4a16 build quantizes those weights a second time,
as it quantizes any float checkpoint: it must give the logits of the w4a16 build of a Hugging Face directory holding
transformers' dequantized weights (measured: identical). Its distance to the float model is the 4-bit grid's, and on
random blocks that is no measure of the reader (symmetric 4-bit rows of a random Q4_K table: 0.9 of the logits' range).

K-quant and IQ blocks are random codes (gguf-py has no quantizer for them): see ckpt_gguf_writer.synth_blocks.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.bundle import open_bundle
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.build.checkpoint.ckpt_gguf_writer import write_model_gguf
from tests.build.models.test_build_summary import _tokenizer

FP32_TOL, SAME_TOL, LLAMA_CPP_TOL = 1e-4, 1e-5, 0.1
# Q4_K_M as llama-quantize makes it (attn_v and ffn_down one step up, Q6_K output), and Q5_K_M beside it.
Q4_K_M = {"proj": "Q4_K", "v_proj": "Q6_K", "down_proj": "Q6_K", "embed": "Q4_K", "head": "Q6_K"}
Q5_K_M = {"proj": "Q5_K", "v_proj": "Q6_K", "down_proj": "Q6_K", "embed": "Q5_K", "head": "Q6_K"}
CASES = {
    # name: (family, tied, GGML type per tensor kind; norms and biases F32 as llama.cpp writes them)
    "llama-f16": ("llama", False, {"proj": "F16", "embed": "F16", "head": "F16"}),
    "qwen2-bf16-tied": ("qwen2", True, {"proj": "BF16", "embed": "BF16"}),
    "qwen2-q5_0": ("qwen2", False, {"proj": "Q5_0", "embed": "Q5_1", "head": "Q5_0"}),
    "llama-q5_1-tied": ("llama", True, {"proj": "Q5_1", "embed": "Q5_0"}),
    "llama-q2_k": ("llama", False, {"proj": "Q2_K", "embed": "Q3_K", "head": "Q6_K"}),
    "qwen2-q3_k-tied": ("qwen2", True, {"proj": "Q3_K", "embed": "Q4_K"}),
    "llama-q4_k_m": ("llama", False, Q4_K_M),
    "qwen2-q5_k_m-tied": ("qwen2", True, Q5_K_M),
    "llama-iq4_xs-tied": ("llama", True, {"proj": "IQ4_XS", "embed": "IQ4_NL"}),
    "qwen2-iq2_xxs": ("qwen2", False, {"proj": "IQ2_XXS", "q_proj": "IQ3_S", "embed": "Q6_K", "head": "Q4_K"}),
}
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python missing")


def _qtype(name: str, types: dict[str, str]) -> str:
    if name == "model.embed_tokens.weight":
        return types["embed"]
    if name == "lm_head.weight":
        return types["head"]
    if name.endswith("proj.weight"):
        return types.get(name.split(".")[-2], types["proj"])
    return "F32"


def _tokens(vocab: int) -> dict:
    """The byte-level test vocabulary padded to the model's rows (llama.cpp wants one token per row)."""
    tok = _tokenizer()
    extra = vocab - len(tok["tokens"])
    return {**tok, "tokens": tok["tokens"] + [f"<extra_{i}>" for i in range(extra)], "types": tok["types"] + [4] * extra}


@pytest.fixture(scope="module")
def gguf_of(dense_checkpoint, tmp_path_factory):
    """Case name → its GGUF: one layer of 256 wide (K-quant super-blocks), 4/2 heads of 64, Qwen2's theta 1e6."""

    def get(name: str):
        family, tied, types = CASES[name]
        theta = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}} if family == "qwen2" else {}
        ck = dense_checkpoint(f"gguf-types-{family}-{tied}", family, num_hidden_layers=1, hidden_size=256,
                              intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=tied, **theta)
        cfg = json.loads((ck / "config.json").read_text())
        state = load_file(str(ck / "model.safetensors"))
        qtypes = {n: _qtype(n, types) for n in state if not (n == "lm_head.weight" and tied)}
        path = tmp_path_factory.mktemp(name) / "m.gguf"
        write_model_gguf(path, family, cfg, state, qtypes, tokenizer=_tokens(cfg["vocab_size"]))
        return path, ck

    return get


def _transformers(path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


IDS = [5, 17, 200, 42, 99, 3, 260]


def _logits(src, out, quant: str, modes: tuple[str, ...] = ("prefill",)) -> list[np.ndarray]:
    bundle = open_bundle(build_bundle(src, out, BuildOptions(quant=quant, max_seq_len=16)))
    if quant == "w4a16":  # none of these types is carried: every block tensor was dequantized
        assert not bundle.manifest.quantization.get("carried_from_source"), out
    be = OnnxRuntimeBackend(bundle, threads=1)
    return [compute_logits(be, IDS, mode) for mode in modes]


def _dequantized_dir(path, ck, out):
    """A Hugging Face directory of the GGUF's weights as transformers dequantizes them (its q/k rows un-permuted)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    out.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(out / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ck / f, out / f)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_type_builds_match_transformers(gguf_of, tmp_path, name):
    path, ck = gguf_of(name)
    ref = _transformers(path, IDS)
    for mode, got in zip(("prefill", "decode"), _logits(path, tmp_path / "fp32", "fp32", ("prefill", "decode")), strict=True):
        assert _rel(got, ref) < FP32_TOL, (name, mode)
    hf = _dequantized_dir(path, ck, tmp_path / "hf")
    w4, hf_w4 = _logits(path, tmp_path / "w4", "w4a16")[0], _logits(hf, tmp_path / "hf-w4", "w4a16")[0]
    assert _rel(w4, hf_w4) < SAME_TOL, name


@needs_llama_cpp
@pytest.mark.parametrize("name", ["llama-q4_k_m", "qwen2-q5_k_m-tied", "llama-iq4_xs-tied", "qwen2-bf16-tied"])
def test_gguf_type_builds_match_llama_cpp(gguf_of, tmp_path, name):
    """An independent dequantizer: llama.cpp's logits for the same file (its K-quant products round activations to
    8 bits, so a few percent apart; a wrong block layout or q/k row order is of order 1)."""
    from llama_cpp import Llama

    path, _ = gguf_of(name)
    llm = Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=32, n_threads=1)
    llm.eval(IDS)
    ref = np.array(llm.scores[: len(IDS)])
    assert _rel(_logits(path, tmp_path / "b", "fp32")[0], ref) < LLAMA_CPP_TOL
