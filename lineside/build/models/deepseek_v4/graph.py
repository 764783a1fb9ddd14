"""The whole DeepSeek-V4 graph: embedding → layers (mHC + attention + MoE) → hyper head → norm → logits.

One graph serves prefill (batch 1, the whole prompt) and decode (seq 1): it takes ``input_ids``,
``past_lengths`` and ``logits_positions`` plus the decode state (state.py) and returns ``logits`` and
the new state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder
from lineside.build.graph.draft import LayerMark, write_streams_draft_graph
from lineside.build.models.deepseek_v4.attention import AttentionEmitter, StepCtx, rope_tables
from lineside.build.models.deepseek_v4.blocks import HyperConnection, MoE
from lineside.build.models.deepseek_v4.config import CSA, SLIDING, V4Config
from lineside.build.models.deepseek_v4.mtp import HIDDEN, MtpSource, NodeRange, emit_mtp
from lineside.build.models.deepseek_v4.naming import V4Source
from lineside.build.models.deepseek_v4.ops import Ops
from lineside.build.models.deepseek_v4.state import layer_state, state_names, state_tensors
from lineside.build.models.rope import rope_inv_freq
from lineside.build.quant.spec import QuantSpec
from lineside.bundle import DRAFT_GRAPHS, MTP_GRAPH, FlavorEntry
from lineside.errors import CheckpointError, LinesideError
from lineside.graph_io import StateTensor

INPUTS = ["input_ids", "past_lengths", "logits_positions"]


def _attn_weights(src: V4Source, cfg: V4Config, i: int) -> dict[str, Any]:
    p = f"model.layers.{i}.self_attn"
    w: dict[str, Any] = {k: src.get(f"{p}.{k}.weight") for k in
                         ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj")}
    w["sinks"] = src.get(f"{p}.sinks")
    if cfg.layer_types[i] != SLIDING:
        cp = f"{p}.compressor"
        w["compressor"] = {"kv_proj": src.get(f"{cp}.kv_proj.weight"), "gate_proj": src.get(f"{cp}.gate_proj.weight"),
                           "position_bias": src.get(f"{cp}.position_bias"), "kv_norm": src.get(f"{cp}.kv_norm.weight")}
    if cfg.layer_types[i] == CSA:
        ip = f"{p}.compressor.indexer"
        w["indexer"] = {"kv_proj": src.get(f"{ip}.kv_proj.weight"), "gate_proj": src.get(f"{ip}.gate_proj.weight"),
                        "position_bias": src.get(f"{ip}.position_bias"), "kv_norm": src.get(f"{ip}.kv_norm.weight"),
                        "q_b_proj": src.get(f"{ip}.q_b_proj.weight"),
                        "weights_proj": src.get(f"{ip}.scorer.weights_proj.weight")}
    return w


def _mlp_weights(src: V4Source, cfg: V4Config, i: int) -> dict[str, Any]:
    p = f"model.layers.{i}.mlp"
    w: dict[str, Any] = {"gate": src.get(f"{p}.gate.weight"),
                         "shared_gate": src.get(f"{p}.shared_experts.gate_proj.weight"),
                         "shared_up": src.get(f"{p}.shared_experts.up_proj.weight"),
                         "shared_down": src.get(f"{p}.shared_experts.down_proj.weight")}
    if cfg.mlp_layer_types[i] == "hash_moe":
        t = src.get_int(f"{p}.gate.tid2eid")
        if t.shape != (cfg.vocab_size, cfg.num_experts_per_tok) or t.min() < 0 or t.max() >= cfg.n_routed_experts:
            raise CheckpointError(
                f"tensor {src.source_name(p + '.gate.tid2eid')!r}: expected expert ids in [0, {cfg.n_routed_experts}) "
                f"with shape [{cfg.vocab_size}, {cfg.num_experts_per_tok}], got shape {list(t.shape)}"
            )
        w["tid2eid"] = t
    else:
        w["bias"] = src.get(f"{p}.gate.e_score_correction_bias")
    return w


def rope_frequencies(cfg: V4Config) -> dict[str, tuple[np.ndarray, float]]:
    """label ("main" / "compress") → (inverse frequencies float32 [rope_dim/2], attention factor on cos/sin)."""
    out = {}
    for label, p in cfg.rope.items():
        kind = p.get("rope_type", "default")
        scaling = None if kind == "default" else dict(p)
        inv, factor = rope_inv_freq(cfg.rope_dim, float(p["rope_theta"]), scaling, cfg.max_position_embeddings)
        if kind == "default":  # transformers computes these in float32
            inv = 1.0 / (np.float32(p["rope_theta"]) ** (np.arange(0, cfg.rope_dim, 2, dtype=np.float32) / np.float32(cfg.rope_dim)))
        out[label] = (np.asarray(inv, np.float32), float(factor))
    return out


def _rope_consts(o: Ops, cfg: V4Config) -> dict[str, tuple[str, float]]:
    return {label: (o.w(f"rope.{label}.inv_freq", inv), factor) for label, (inv, factor) in rope_frequencies(cfg).items()}


def emit_v4_graph(cfg: V4Config, src: V4Source, spec: QuantSpec, flavor: str, onnx_path: Path, max_seq_len: int,
                  progress: Callable[[int], None] | None = None, draft_layers: tuple[int, ...] = (),
                  mtp: MtpSource | None = None) -> FlavorEntry:
    """Write the graph; returns its manifest entry (inputs, state, activation dtype; the pipeline adds the path).

    ``mtp`` (an ``mtp.MtpSource``): also write the MTP graph beside it (``mtp.onnx``, recorded as ``MTP_GRAPH``),
    and give the main graph the output it reads (``HIDDEN``, the last layer's streams). ``draft_layers``:
    layerskip drafts to write beside it (``draft-N.onnx``, reading the same weight data)."""
    if flavor not in ("cpu", "trt"):
        raise LinesideError(f"unknown graph flavor {flavor!r} for DeepSeek-V4; use cpu or trt")
    gb = GraphBuilder(onnx_path, name=f"deepseek_v4_{flavor}")
    o = Ops(gb, spec, flavor)
    ids = gb.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    past = gb.input("past_lengths", TensorProto.INT64, ["batch"])
    lpos = gb.input("logits_positions", TensorProto.INT64, ["batch", "n_logits"])
    from lineside.build.graph.kv_cache import emit_kv_load, emit_kv_store, scale_name
    from lineside.build.models.deepseek_v4.state import QUANTIZABLE
    from lineside.build.quant.kv import FORMATS, KvDtype
    from lineside.graph_io import PACKED_INT4

    fmt = FORMATS.get(KvDtype(spec.kv_dtype))
    states = state_tensors(cfg, max_seq_len, fmt=fmt)
    onnx_type = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "uint8": TensorProto.UINT8,
                 PACKED_INT4: TensorProto.UINT8}
    kv_args = dict(rank=3, head_dim=cfg.head_dim)  # window and comp entries: [batch, N, head_dim]
    for st in states:
        gb.input(st.input, onnx_type[st.dtype], st.shape)

    seq = o.dim(ids, 1)
    pos = o.add(o.unsqueeze(past, [1]), o.unsqueeze(o.op("Range", o.i64(0), seq, o.i64(1)), [0]))
    pos_f = o.cast(pos, TensorProto.FLOAT)
    inv = _rope_consts(o, cfg)
    ctx = StepCtx(past=past, pos=pos, seq=seq, total=o.add(past, seq),
                  rope={k: rope_tables(o, pos_f, v[0], v[1]) for k, v in inv.items()}, rope_inv=inv)
    attn, hc, moe = AttentionEmitter(o, cfg, ctx, max_seq_len), HyperConnection(o, cfg), MoE(o, cfg)

    emb_start = len(gb.nodes)
    emb = o.embedding(ids, src.get("model.embed_tokens.weight"))  # [B, S, D]
    embedding = NodeRange(emb_start, len(gb.nodes), "input_ids", emb)
    u = o.unsqueeze(emb, [2])
    x = o.concat([u] * cfg.hc_mult, 2) if cfg.hc_mult > 1 else u  # [B, S, N, D]
    outputs: dict[str, str] = {}
    marks: list[LayerMark] = []
    for i in range(cfg.num_layers):
        st = {k: state_names(i, k) for k in layer_state(cfg, i, max_seq_len)}
        if fmt is not None:  # attention reads the stored entries dequantized
            st.update({k: (emit_kv_load(gb, a, scale_name(a), fmt, **kv_args), b) for k, (a, b) in st.items()
                       if k in QUANTIZABLE})
        x, new = emit_block(o, cfg, src, i, x, ids, st, (attn, hc, moe))
        for k, v in new.items():
            outputs[st[k][1]] = v
        marks.append(LayerMark(len(gb.nodes), x, None, sum(1 for s in states if _state_layer(s) <= i)))
        if progress:
            progress(1)

    # Only the requested positions go through the head.
    tail_start = len(gb.nodes)
    xs = gather_positions(o, cfg, x, ids, seq, lpos)  # [B, K, N, D]
    head = {k: src.get(f"model.hc_head.{k}") for k in ("hc_fn", "hc_base", "hc_scale")}
    h = o.rmsnorm(hc.head(xs, head), src.get("model.norm.weight"), cfg.rms_norm_eps, "norm")
    lm = src.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    head_start = len(gb.nodes)
    lm_out = o.lm_head(h, lm)
    lm_head = NodeRange(head_start, len(gb.nodes), h, lm_out)
    gb.op("Identity", [lm_out], outputs=["logits"])
    gb.output("logits", TensorProto.FLOAT, ["batch", "n_logits", cfg.vocab_size])
    for stt in states:
        if stt.output in outputs:
            if fmt is not None and stt.dtype == fmt.element:  # its scale output is written here too
                emit_kv_store(gb, outputs[stt.output], fmt, stt.output, scale_name(stt.output), **kv_args)
            else:
                gb.op("Identity", [outputs[stt.output]], outputs=[stt.output])
        gb.output(stt.output, onnx_type[stt.dtype], stt.shape)
    extra: dict[str, Any] = {}
    mtp_graph = None
    if mtp is not None:  # the MTP block reads the last layer's streams: the main graph hands them out
        gb.op("Identity", [x], outputs=[HIDDEN])
        gb.output(HIDDEN, TensorProto.FLOAT, ["batch", "seq", cfg.hc_mult, cfg.hidden_size])
        mtp_graph = emit_mtp(o, cfg, mtp, max_seq_len, rope_inv=inv, embedding=embedding, lm_head=lm_head)
    gb.save()
    if mtp_graph is not None:
        extra[MTP_GRAPH] = mtp_graph.write(gb, onnx_path.with_name("mtp.onnx"))
    # Layerskip drafts: the first N layers, then the same head collapse, norm and LM head on their streams.
    drafts = {str(n): write_streams_draft_graph(gb, gb.onnx_path.with_name(f"draft-{n}.onnx"), marks[n - 1], x,
                                                tail_start, states, INPUTS) for n in sorted(set(draft_layers))}
    if drafts:
        extra[DRAFT_GRAPHS] = drafts
    return FlavorEntry(inputs=list(INPUTS), state=states, activation_dtype="float32", extra=extra)


def emit_block(o: Ops, cfg: V4Config, src: Any, i: int, x: str, ids: str, st: dict[str, tuple[str, str]],
               parts: tuple[AttentionEmitter, HyperConnection, MoE]) -> tuple[str, dict[str, str]]:
    """One V4 block on streams x [B, S, N, D] (DeepSeek's ``Block.forward``): hc_pre → attn_norm → attention →
    hc_post, then hc_pre → ffn_norm → MoE → hc_post. Returns the new streams and {state key: new value}."""
    attn, hc, moe = parts
    pfx = f"model.layers.{i}"
    aw = _attn_weights(src, cfg, i)
    hcw = {k: src.get(f"{pfx}.attn_hc.{k}") for k in ("fn", "base", "scale")}
    post, comb, col = hc.pre(x, hcw, f"layers.{i}.hc_attn")
    normed = o.rmsnorm(col, src.get(f"{pfx}.input_layernorm.weight"), cfg.rms_norm_eps, f"layers.{i}.attn_norm")
    a_out, new = attn.emit(i, normed, aw, st)
    x = hc.post(x, a_out, post, comb)
    hcw = {k: src.get(f"{pfx}.ffn_hc.{k}") for k in ("fn", "base", "scale")}
    post, comb, col = hc.pre(x, hcw, f"layers.{i}.hc_ffn")
    normed = o.rmsnorm(col, src.get(f"{pfx}.post_attention_layernorm.weight"), cfg.rms_norm_eps, f"layers.{i}.ffn_norm")
    m_out = moe.emit(normed, i, _mlp_weights(src, cfg, i), ids, lambda e: src.expert(i, e, cfg.moe_intermediate_size))
    return hc.post(x, m_out, post, comb), new


def gather_positions(o: Ops, cfg: V4Config, x: str, ids: str, seq: str, lpos: str) -> str:
    """Streams [B, S, N, D] at the requested positions: flatten (B, S) and gather b·S + position → [B, K, N, D]."""
    bidx = o.op("Range", o.i64(0), o.dim(ids, 0), o.i64(1))
    flat_idx = o.add(lpos, o.unsqueeze(o.mul(bidx, seq), [1]))
    return o.gather(o.reshape(x, [-1, cfg.hc_mult, cfg.hidden_size]), flat_idx, 0)


def _state_layer(st: StateTensor) -> int:
    """``past.3.window`` / ``past_scale.3.window`` → 3."""
    return int(st.input.split(".")[1])
