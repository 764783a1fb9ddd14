"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): config parsing, official/HF naming, graphs, decode state.

The build pipeline uses ``FAMILY`` (the ``ModelFamily`` interface); ``check_tensors`` names a missing tensor
under the checkpoint's own naming (official or HF) and returns the source the graphs read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.models.deepseek_v4.config import CSA, SLIDING, V4Config, parse_config
from lineside.build.models.deepseek_v4.graph import INPUTS, emit_v4_graph
from lineside.build.models.deepseek_v4.mtp import find_mtp
from lineside.build.models.deepseek_v4.naming import V4Source, hf_to_official, official_to_hf
from lineside.build.models.deepseek_v4.state import state_bytes, state_tensors
from lineside.build.models.family import ModelFamily, WeightGetter, WeightSource
from lineside.build.quant.spec import QuantSpec
from lineside.bundle import FlavorEntry
from lineside.config import ModelConfig
from lineside.errors import CheckpointError, LinesideError

__all__ = ["FAMILY", "INPUTS", "V4Config", "V4Source", "check_tensors", "emit_graph", "expected_shapes", "hf_to_official",
           "official_to_hf", "parse_config", "required_tensors", "state_bytes", "state_tensors"]


def _v4(cfg: ModelConfig | V4Config | dict[str, Any]) -> V4Config:
    if isinstance(cfg, V4Config):
        return cfg
    if isinstance(cfg, dict):
        return parse_config(cfg)
    return parse_config(cfg.raw)  # lineside.config.ModelConfig keeps the whole HF dict in .raw


def expected_shapes(cfg: ModelConfig | V4Config | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the graph reads (experts as their stacked HF tensors) → the shape config.json implies."""
    c = _v4(cfg)
    D, V, N, H, d, Q = c.hidden_size, c.vocab_size, c.hc_mult, c.num_heads, c.head_dim, c.q_lora_rank
    E, inter, hc = c.n_routed_experts, c.moe_intermediate_size, (2 + c.hc_mult) * c.hc_mult
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
                                       "model.hc_head.hc_fn": (N, N * D), "model.hc_head.hc_base": (N,),
                                       "model.hc_head.hc_scale": (1,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        out.update({f"{p}.input_layernorm.weight": (D,), f"{p}.post_attention_layernorm.weight": (D,)})
        for h in ("attn_hc", "ffn_hc"):
            out.update({f"{p}.{h}.fn": (hc, N * D), f"{p}.{h}.base": (hc,), f"{p}.{h}.scale": (3,)})
        a = f"{p}.self_attn"
        g = c.o_groups
        out.update({f"{a}.q_a_proj.weight": (Q, D), f"{a}.q_a_norm.weight": (Q,), f"{a}.q_b_proj.weight": (H * d, Q),
                    f"{a}.kv_proj.weight": (d, D), f"{a}.kv_norm.weight": (d,),
                    f"{a}.o_a_proj.weight": (g * c.o_lora_rank, H * d // g), f"{a}.o_b_proj.weight": (D, g * c.o_lora_rank),
                    f"{a}.sinks": (H,)})
        if c.layer_types[i] != SLIDING:
            m, w = c.rate(i), (2 * d if c.layer_types[i] == CSA else d)  # CSA: two overlapping series
            cp = f"{a}.compressor"
            out.update({f"{cp}.kv_proj.weight": (w, D), f"{cp}.gate_proj.weight": (w, D), f"{cp}.position_bias": (m, w),
                        f"{cp}.kv_norm.weight": (d,)})
        if c.layer_types[i] == CSA:
            ip, di, hi = f"{a}.compressor.indexer", c.index_head_dim, c.index_n_heads
            out.update({f"{ip}.kv_proj.weight": (2 * di, D), f"{ip}.gate_proj.weight": (2 * di, D),
                        f"{ip}.position_bias": (c.rate(i), 2 * di), f"{ip}.kv_norm.weight": (di,),
                        f"{ip}.q_b_proj.weight": (hi * di, Q), f"{ip}.scorer.weights_proj.weight": (hi, D)})
        m = f"{p}.mlp"
        out.update({f"{m}.gate.weight": (E, D), f"{m}.experts.gate_up_proj": (E, 2 * inter, D),
                    f"{m}.experts.down_proj": (E, D, inter)})
        if c.mlp_layer_types[i] == "hash_moe":
            out[f"{m}.gate.tid2eid"] = (V, c.num_experts_per_tok)
        else:
            out[f"{m}.gate.e_score_correction_bias"] = (E,)
        out.update({f"{m}.shared_experts.gate_proj.weight": (inter, D), f"{m}.shared_experts.up_proj.weight": (inter, D),
                    f"{m}.shared_experts.down_proj.weight": (D, inter)})
    return out


def required_tensors(cfg: ModelConfig | V4Config | dict[str, Any]) -> list[str]:
    """Every HF tensor name the graph reads (experts as their stacked HF tensors)."""
    return list(expected_shapes(cfg))


def check_tensors(cfg: ModelConfig | V4Config | dict[str, Any], ckpt: CheckpointReader | V4Source) -> V4Source:
    """Wrap a reader and raise one CheckpointError naming the first missing tensor (in the file's naming), or the
    first whose shape is not the one config.json implies (a graph built from it would be wrong or would not run)."""
    c = _v4(cfg)
    src = ckpt if isinstance(ckpt, V4Source) else V4Source(ckpt)
    missing = src.missing(required_tensors(c), {i: c.n_routed_experts for i in range(c.num_layers)})
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]!r} is missing from the checkpoint{more}; "
                              "the checkpoint is incomplete or not a DeepSeek-V4 model")
    for name, want in expected_shapes(c).items():
        stacked = name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
        if stacked and src.official:  # one tensor per routed expert: w1, w3 [I, D] and w2 [D, I]
            layer, inter, hidden = int(name.split(".")[2]), c.moe_intermediate_size, c.hidden_size
            for e in range(c.n_routed_experts):
                g, u, dn = src.expert_names(layer, e)
                for n, w in ({dn: (hidden, inter)} if name.endswith("down_proj") else {g: (inter, hidden),
                                                                                        u: (inter, hidden)}).items():
                    _check_shape(src, n, w)
        else:
            _check_shape(src, src.source_name(name), want)
    return src


def _check_shape(src: V4Source, name: str, want: tuple[int, ...]) -> None:
    got = src.logical_shape(name)
    if got != want:
        raise CheckpointError(f"tensor {name!r} has shape {list(got)} but config.json implies {list(want)}; "
                              "the checkpoint and its config.json disagree")


def emit_graph(cfg: ModelConfig | V4Config | dict[str, Any], ckpt: CheckpointReader | V4Source, spec: QuantSpec, flavor: str, onnx_path: Path, max_seq_len: int,
               progress: Callable[[int], None] | None = None,
               awq_scales: dict[str, np.ndarray] | None = None, draft_layers: tuple[int, ...] = ()) -> FlavorEntry:
    """Write the ``flavor`` graph (and its ``draft_layers`` layerskip drafts) to ``onnx_path``; returns its
    manifest entry."""
    c = _v4(cfg)
    if awq_scales is not None:
        raise LinesideError("AWQ is not supported for DeepSeek-V4 yet; build with --method rtn")
    bad = [n for n in draft_layers if not 1 <= n < c.num_layers]
    if bad:
        raise LinesideError(f"--draft-layers {bad[0]}: a draft needs 1 to {c.num_layers - 1} of the model's "
                            f"{c.num_layers} layers")
    src = check_tensors(c, ckpt)
    # The MTP proposer runs on onnxruntime: its graph goes beside the cpu flavor's (the trt graph stays as it was).
    mtp = find_mtp(src, c) if flavor == "cpu" else None
    return emit_v4_graph(c, src, spec, flavor, Path(onnx_path), int(max_seq_len), progress, tuple(draft_layers), mtp=mtp)


class DeepseekV4Family(ModelFamily):
    """DeepSeek-V4: its config parsed from the HF dict kept in ``ModelConfig.raw``; official or HF names."""

    draft_graphs = True  # emits layerskip drafts (`build --draft-layers N`)

    def check_config(self, cfg: ModelConfig, flavors: tuple[str, ...]) -> None:
        _v4(cfg)  # parsing refuses what the graphs cannot compute (one line)

    def required_tensors(self, cfg: ModelConfig) -> list[str]:
        return required_tensors(cfg)

    def open_weights(self, cfg: ModelConfig, ckpt: CheckpointReader, where: str) -> V4Source:
        return check_tensors(cfg, ckpt)

    def emit_graph(self, cfg: ModelConfig, weights: WeightGetter | WeightSource, spec: QuantSpec, flavor: str,
                   onnx_path: Path, max_seq_len: int, *, progress: Callable[[int], None] | None = None,
                   awq_scales: dict[str, np.ndarray] | None = None, draft_layers: tuple[int, ...] = ()) -> FlavorEntry:
        return emit_graph(cfg, weights, spec, flavor, onnx_path, max_seq_len, progress, awq_scales, draft_layers)


FAMILY = DeepseekV4Family()
