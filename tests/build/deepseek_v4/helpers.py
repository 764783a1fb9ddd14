"""Tiny random-weight DeepSeek-V4 checkpoints (made with transformers) and an onnxruntime step loop.

The loop plays the runtime's part for V4 graphs: it zero-initialises the decode state, feeds
``input_ids`` / ``past_lengths`` / ``logits_positions`` and swaps in each "replace" state output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lineside.bundle import FlavorEntry

# Two layer schedules: together all three attention types, both MLP types, every scoring function transformers runs
# (its router has no "softmax": ACT2FN lacks it).
SCHEDULES: dict[str, dict[str, Any]] = {
    "a": dict(layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe"], scoring_func="sqrtsoftplus", hc_mult=2),
    "b": dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                           "compressed_sparse_attention"],
              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], scoring_func="sigmoid", hc_mult=3,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "beta_fast": 8, "beta_slow": 1}),
    # The knobs a and b keep fixed: hidden 96 (INT4 groups of 64 don't tile it), 3 heads of 48 with half of
    # each rotated, one hyper-connection copy, tied and odd vocabulary, top-1 routing with a routed scale,
    # window 3, compression rates 2/16, linear rope, a large norm epsilon.
    "c": dict(layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"],
              mlp_layer_types=["moe", "hash_moe", "moe", "moe"], scoring_func="sqrtsoftplus", hc_mult=1,
              hidden_size=96, num_attention_heads=3, o_groups=3, head_dim=48, partial_rotary_factor=0.5,
              index_head_dim=32, index_topk=5, tie_word_embeddings=True, vocab_size=131, sliding_window=3,
              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
              num_experts_per_tok=1, routed_scaling_factor=2.5, swiglu_limit=10.0, rms_norm_eps=1e-2,
              rope_parameters={"rope_type": "linear", "factor": 2.0}),
}
# Variants of a for what real configs vary and a, b, c keep fixed. d: routing and ranks (6 experts, top-4, sigmoid,
# routed scale < 1, q/o LoRA ranks, 4 output groups, 4 hyper-connection copies with one Sinkhorn pass, untied odd
# vocabulary). e: rope (nested yarn on both ropes, separate thetas, the compress one's attention factor derived from
# mscale/mscale_all_dim, the whole head rotated, window 1). f: compression (rates 3 and 5, top-1 indexer, a window
# wider than max_seq, MoE before hash MoE).
_A = SCHEDULES["a"]
SCHEDULES.update(
    d=dict(_A, n_routed_experts=6, num_experts_per_tok=4, scoring_func="sigmoid", routed_scaling_factor=0.7,
           q_lora_rank=48, o_groups=4, o_lora_rank=16, hc_mult=4, hc_sinkhorn_iters=1, vocab_size=150),
    e=dict(_A, head_dim=16, partial_rotary_factor=1.0, index_head_dim=16, sliding_window=1,
           rope_parameters={"main": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16},
                            "compress": {"rope_type": "yarn", "rope_theta": 3000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.5,
                                         "beta_fast": 16, "beta_slow": 2}}),
    f=dict(_A, mlp_layer_types=["moe", "hash_moe", "moe"], index_topk=1, sliding_window=40, num_experts_per_tok=4,
           compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5}),
    # g: one attention head (one output group), 8 experts top-3 with a MoE width no group size tiles, an indexer top-k
    # one below the compressed entries at the end, hc_sinkhorn_iters 0 (transformers runs it as 1), and a flat yarn
    # with "truncate": false, which V4 does not honour (transformers reads it only at rope_parameters' top level).
    g=dict(_A, num_attention_heads=1, o_groups=1, hc_sinkhorn_iters=0, index_topk=6, n_routed_experts=8,
           num_experts_per_tok=3, moe_intermediate_size=40, compress_rope_theta=1000.0,
           rope_parameters={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 8,
                            "beta_slow": 2, "truncate": False}),
)
BASE = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, head_dim=32,
            q_lora_rank=64, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            sliding_window=8, o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=16, index_topk=3,
            hc_sinkhorn_iters=6, max_position_embeddings=64, swiglu_limit=1.0, bos_token_id=1, eos_token_id=2)
SEQ_LEN = 30  # > 3 × the largest compression rate (8) and > the window (8)
MAX_SEQ = 32


def make_model(schedule: str, seed: int = 0) -> Any:
    """A DeepseekV4ForCausalLM with every parameter random (sinks, biases, position biases too)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = {**BASE, **SCHEDULES[schedule]}
    cfg = DeepseekV4Config(num_hidden_layers=len(kw["layer_types"]), **kw)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                        for _ in range(p.shape[0])]
                p.copy_(torch.stack(rows))
            elif "inv_freq" in name:
                continue
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2 and "position_bias" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif p.is_floating_point():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def save_model(model: Any, path: Path) -> Path:
    """save_pretrained plus a small byte-level tokenizer, so bundles built from it can generate text."""
    from tests.tiny_tokenizer import write_byte_tokenizer  # tests/tiny_tokenizer.py, shared by all suites

    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, model.config.vocab_size)
    return path


def token_ids(seed: int = 3, n: int = SEQ_LEN, vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, vocab, size=n).astype(np.int64)


def reference(model: Any, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers' float32 logits [T, vocab] and the smallest relative gap at any indexer top-k cut."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

    gaps: list[float] = []
    k = model.config.index_topk
    m = model.config.compress_rates["compressed_sparse_attention"]

    def hook(_mod: Any, _inp: Any, out: Any) -> None:
        s = out[0].detach().double().numpy()  # [S, T]
        for q in range(s.shape[0]):
            n_valid = min((q + 1) // m, s.shape[1])
            if n_valid > k:
                v = np.sort(s[q, :n_valid])[::-1]
                gaps.append(float((v[k - 1] - v[k]) / (abs(v[k - 1]) + 1e-12)))

    hs = [mod.register_forward_hook(hook) for mod in model.modules() if isinstance(mod, mdl.DeepseekV4IndexerScorer)]
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)[None]).logits[0].float().numpy()
    for h in hs:
        h.remove()
    return logits, (min(gaps) if gaps else float("inf"))


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


class V4Runner:
    """Feeds a V4 graph the way the runtime will: prefill (batch 1) and decode (seq 1) with replace-state."""

    def __init__(self, onnx_path: Path, entry: FlavorEntry, max_seq: int = MAX_SEQ) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.log_severity_level = 3
        # onnxruntime fuses the trt flavor's DequantizeLinear → MatMul into MatMulNBits at accuracy level 4
        # (int8 activations) unless told otherwise; TensorRT keeps float activations, so check at level 0.
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.entry, self.max_seq = entry, max_seq

    def zero_state(self, batch: int = 1) -> dict[str, np.ndarray]:
        from lineside.graph_io import STORAGE_DTYPE, resolve_shape

        return {s.input: np.zeros(resolve_shape(s.shape, {"batch": batch, "max_seq": self.max_seq}),
                                  STORAGE_DTYPE.get(s.dtype, s.dtype)) for s in self.entry.state}

    def step(self, ids: np.ndarray, past: np.ndarray, state: dict[str, np.ndarray],
             positions: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        feeds = {"input_ids": ids, "past_lengths": past, "logits_positions": positions, **state}
        outs = ["logits"] + [s.output for s in self.entry.state]
        res = self.sess.run(outs, feeds)
        return res[0], {s.input: v for s, v in zip(self.entry.state, res[1:], strict=True)}

    def prefill(self, ids: np.ndarray, state: dict[str, np.ndarray] | None = None, past: int = 0):
        state = state or self.zero_state()
        n = len(ids)
        return self.step(ids[None], np.array([past], np.int64), state, np.arange(n, dtype=np.int64)[None])

    def decode(self, ids: np.ndarray, state: dict[str, np.ndarray] | None = None, past: int = 0) -> tuple[np.ndarray, dict]:
        state = state or self.zero_state()
        rows = []
        for t, tok in enumerate(ids):
            lg, state = self.step(np.array([[tok]], np.int64), np.array([past + t], np.int64), state,
                                  np.zeros((1, 1), np.int64))
            rows.append(lg[0, 0])
        return np.stack(rows), state


def write_official(model: Any, src_dir: Path, dst_dir: Path, fp8: str | None = None, mxfp4: bool = False) -> Path:
    """Save ``model`` (config from ``src_dir``) under DeepSeek's official names, optionally as FP8/MXFP4.

    fp8: None (float32), "ue8m0" or "float" block scales for every 2-D non-expert linear weight;
    mxfp4: routed experts as packed e2m1 with ue8m0 scales per 32 inputs.
    """
    import torch
    from safetensors.torch import save_file

    from lineside.build.checkpoint.fp8_mxfp4 import quantize_fp8_blocks, quantize_mxfp4
    from lineside.build.models.deepseek_v4 import hf_to_official

    dst_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if "inv_freq" not in k}
    out: dict[str, torch.Tensor] = {}

    def put(name: str, w: torch.Tensor, linear: bool, expert: bool = False) -> None:
        a = w.float().numpy()
        if expert and mxfp4:
            q, s = quantize_mxfp4(a)
            out[name] = torch.from_numpy(q)
            out[name[: -len(".weight")] + ".scale"] = torch.from_numpy(s.view(np.uint8)).view(torch.float8_e8m0fnu)
        elif linear and fp8 is not None:
            q, s = quantize_fp8_blocks(a, 128, ue8m0=fp8 == "ue8m0")
            out[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            out[name[: -len(".weight")] + ".scale"] = (torch.from_numpy(s.view(np.uint8)).view(torch.float8_e8m0fnu)
                                                       if fp8 == "ue8m0" else torch.from_numpy(s))
        else:
            out[name] = w.contiguous()

    for name, w in sd.items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            layer = name.split(".")[2]
            inter = w.shape[1] // 2 if name.endswith("gate_up_proj") else w.shape[2]
            for e in range(w.shape[0]):
                p = f"layers.{layer}.ffn.experts.{e}"
                if name.endswith("gate_up_proj"):
                    put(f"{p}.w1.weight", w[e, :inter], True, True)
                    put(f"{p}.w3.weight", w[e, inter:], True, True)
                else:
                    put(f"{p}.w2.weight", w[e], True, True)
            continue
        off = hf_to_official(name)
        linear = w.ndim == 2 and off.endswith(".weight") and not off.startswith(("embed", "head")) \
            and ".compressor." not in off and "weights_proj" not in off and ".gate.weight" not in off
        put(off, w, linear)
    save_file(out, str(dst_dir / "model.safetensors"))
    cfg = json.loads((src_dir / "config.json").read_text())
    (dst_dir / "config.json").write_text(json.dumps(cfg))
    return dst_dir


def dequantized_reference_model(official_dir: Path, schedule: str) -> Any:
    """The transformers model holding exactly the dequantized official weights (the FP8/MXFP4 reference)."""
    import torch

    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.models.deepseek_v4 import V4Source

    model = make_model(schedule)
    src = V4Source(open_checkpoint(official_dir))
    sd = model.state_dict()
    new = {}
    for name, t in sd.items():
        if "inv_freq" in name:
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = int(name.split(".")[2])
            inter = model.config.moe_intermediate_size
            ws = [src.expert(layer, e, inter) for e in range(t.shape[0])]
            arr = np.stack([np.concatenate([g, u]) for g, u, _ in ws]) if name.endswith("gate_up_proj") \
                else np.stack([d for _, _, d in ws])
        elif name.endswith("tid2eid"):
            arr = src.get_int(name)
        else:
            arr = src.get(name)
        new[name] = torch.from_numpy(np.array(arr)).to(t.dtype)
    model.load_state_dict(new, strict=False)
    return model


# Linear weights a W4A16 build quantizes (routers, indexer weights_proj and the embedding stay float).
QUANTIZED = ("q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "gate_proj.weight", "o_a_proj.weight",
             "o_b_proj.weight", "up_proj.weight", "down_proj.weight", "experts.gate_up_proj", "experts.down_proj")


def fake_quant_model(schedule: str, group_size: int, flavor: str, scale_dtype: type = np.float32,
                     bits: int = 4) -> Any:
    """transformers' model with every weight a W4A16 (bits 4) or W8A16 (bits 8, per channel) build quantizes
    replaced by its RTN round trip."""
    import torch

    from lineside.build.graph.embedding import embedding_reference
    from lineside.build.quant.rtn import fake_quantize
    from lineside.build.quant.spec import QuantSpec

    model = make_model(schedule)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.embed_tokens.weight":  # exactly the rows emit_embedding stores (cpu 8-bit, trt fp16)
                spec = QuantSpec(scheme=f"w{bits}a16", group_size=group_size)
                p.copy_(torch.from_numpy(embedding_reference(p.numpy().copy(), spec, flavor)))
            elif name == "lm_head.weight":  # the LM head stays 8-bit per channel (emit_lm_head)
                p.copy_(torch.from_numpy(fake_quantize(p.numpy(), 8, None, scale_dtype)))
            elif name.endswith(QUANTIZED):
                w = p.numpy()
                gs = group_size if bits == 4 else None
                q = (np.stack([fake_quantize(x, bits, gs, scale_dtype) for x in w]) if w.ndim == 3
                     else fake_quantize(w, bits, gs, scale_dtype))
                p.copy_(torch.from_numpy(q))
    return model
