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

__all__ = ["FAMILY", "INPUTS", "V4Config", "V4Source", "check_tensors", "emit_graph", "hf_to_official",
           "official_to_hf", "parse_config", "required_tensors", "state_bytes", "state_tensors"]


def _v4(cfg: ModelConfig | V4Config | dict[str, Any]) -> V4Config:
    if isinstance(cfg, V4Config):
        return cfg
    if isinstance(cfg, dict):
        return parse_config(cfg)
    return parse_config(cfg.raw)  # lineside.config.ModelConfig keeps the whole HF dict in .raw


def required_tensors(cfg: ModelConfig | V4Config | dict[str, Any]) -> list[str]:
    """Every HF tensor name the graph reads (experts as their stacked HF tensors)."""
    c = _v4(cfg)
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.hc_head.hc_fn", "model.hc_head.hc_base",
             "model.hc_head.hc_scale"]
    if not c.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.{hc}.{k}" for hc in ("attn_hc", "ffn_hc") for k in ("fn", "base", "scale")]
        a = f"{p}.self_attn"
        names += [f"{a}.{k}.weight" for k in ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj",
                                               "o_b_proj")] + [f"{a}.sinks"]
        if c.layer_types[i] != SLIDING:
            names += [f"{a}.compressor.{k}" for k in ("kv_proj.weight", "gate_proj.weight", "position_bias",
                                                     "kv_norm.weight")]
        if c.layer_types[i] == CSA:
            ip = f"{a}.compressor.indexer"
            names += [f"{ip}.{k}" for k in ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight",
                                            "q_b_proj.weight", "scorer.weights_proj.weight")]
        m = f"{p}.mlp"
        names += [f"{m}.gate.weight", f"{m}.experts.gate_up_proj", f"{m}.experts.down_proj"]
        names.append(f"{m}.gate.tid2eid" if c.mlp_layer_types[i] == "hash_moe" else f"{m}.gate.e_score_correction_bias")
        names += [f"{m}.shared_experts.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")]
    return names


def check_tensors(cfg: ModelConfig | V4Config | dict[str, Any], ckpt: CheckpointReader | V4Source) -> V4Source:
    """Wrap a reader and raise one CheckpointError naming the first missing tensor (in the file's naming)."""
    c = _v4(cfg)
    src = ckpt if isinstance(ckpt, V4Source) else V4Source(ckpt)
    missing = src.missing(required_tensors(c), {i: c.n_routed_experts for i in range(c.num_layers)})
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]!r} is missing from the checkpoint{more}; "
                              "the checkpoint is incomplete or not a DeepSeek-V4 model")
    return src


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
