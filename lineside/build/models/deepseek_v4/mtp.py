"""DeepSeek-V4's multi-token-prediction (MTP) module as a graph of its own, beside the main graph.

The published formula is DeepSeek's reference inference code (``inference/model.py`` of the V4 release,
``class MTPBlock(Block)``), read with vLLM's ``vllm/model_executor/models/deepseek_v4_mtp.py`` and SGLang's
``python/sglang/srt/models/deepseek_v4_nextn.py``. At position p, with h_p the main model's last-layer
hyper-connection streams [hc_mult, D] (after the last block, *before* the hc head and the final norm):

    e = enorm(embed(t[p+1]))                   embed: the main model's embedding (shared, not stored again)
    x = e_proj(e)[None] + h_proj(hnorm(h_p))   hnorm and h_proj per stream; e_proj broadcast over the streams
    x = Block(x)                               a whole V4 block: mHC, attention, MoE; compress ratio 0 (a sliding-
                                               window layer: no compressor, no indexer — SGLang's
                                               COMPRESS_RATIO_NEXTN_LAYER), top-k routing (its layer id is past
                                               every hash layer)
    logits[p] = head(norm(hc_head(x)))         its own hc_head_fn/base/scale and norm; head: the main LM head

and it predicts t[p+2]. A draft after the first feeds the block's own output streams x in place of the h it has
not got (vLLM's recursion when num_speculative_tokens > num_nextn_predict_layers). vLLM also zeroes the
embedding at position 0; DeepSeek's reference and SGLang do not, nor does this graph.

Official checkpoints hold it as ``mtp.0.*`` (DeepSeek-V4-Flash: 1,575 tensors; ``num_nextn_predict_layers`` 1),
named as a layer is plus its own seven (D = hidden, N = hc_mult, H·d = heads × head_dim):
``e_proj.weight`` [D, D], ``h_proj.weight`` [D, D] (FP8 with ``.scale`` in the release), ``enorm.weight``,
``hnorm.weight``, ``norm.weight`` [D], ``hc_head_fn`` [N, N·D], ``hc_head_base`` [N], ``hc_head_scale`` [1];
then ``attn_norm``/``ffn_norm``, ``hc_attn_*``/``hc_ffn_*``, ``attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,
attn_sink}``, ``ffn.gate.{weight,bias}``, ``ffn.experts.E.w{1,2,3}``, ``ffn.shared_experts.w{1,2,3}``.
transformers drops them on load (``_keys_to_ignore_on_load_unexpected = [r"(^|\\.)mtp\\..*"]``), so they are
read here by name. Only ``mtp.0`` is built (V4's releases have one MTP layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from lineside.build.graph.builder import GraphBuilder
from lineside.build.graph.draft import initializer_bytes, node_reads
from lineside.build.models.deepseek_v4.attention import AttentionEmitter, StepCtx, rope_tables
from lineside.build.models.deepseek_v4.blocks import HyperConnection, MoE
from lineside.build.models.deepseek_v4.config import SLIDING, V4Config
from lineside.build.models.deepseek_v4.naming import V4Source, hf_to_official
from lineside.build.models.deepseek_v4.ops import Ops
from lineside.errors import CheckpointError
from lineside.graph_io import StateTensor, StateUpdate

HIDDEN = "hidden_streams"  # main graph output / MTP graph input: last-layer streams [batch, seq, N, D]
MTP_HIDDEN = "mtp_hidden"  # MTP graph output: its block's streams at the logits positions [batch, n_logits, N, D]
MTP_INPUTS = ["input_ids", HIDDEN, "past_lengths", "logits_positions"]
OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
       "hc_head_base", "hc_head_scale")


def mtp_state(cfg: V4Config) -> StateTensor:
    """The block's sliding window (its only state: K = V of the last W positions), one per slot."""
    return StateTensor(input="past.mtp.0.window", output="present.mtp.0.window",
                       shape=["batch", cfg.sliding_window, cfg.head_dim], dtype="float32",
                       update=StateUpdate.REPLACE, seq_axis=1)


def mtp_config(cfg: V4Config) -> V4Config:
    """The main config with the MTP block as one more layer (index ``num_layers``): sliding, top-k MoE."""
    return replace(cfg, num_layers=cfg.num_layers + 1, layer_types=[*cfg.layer_types, SLIDING],
                   mlp_layer_types=[*cfg.mlp_layer_types, "moe"])


class MtpSource:
    """The ``mtp.0.*`` tensors seen under the HF names of layer ``num_layers`` (so the main graph's block emitter
    reads them as it reads a layer); its own tensors by their official names (``own``)."""

    def __init__(self, src: V4Source, cfg: V4Config, prefix: str) -> None:
        self.src, self.layer, self.prefix = src, cfg.num_layers, prefix

    def source_name(self, hf_name: str) -> str:
        return mtp_source_name(hf_name, self.layer, self.prefix)

    def get(self, hf_name: str) -> np.ndarray:
        return self.src.read_source(self.source_name(hf_name))

    def own(self, name: str) -> np.ndarray:
        return self.src.read_source(self.prefix + name)

    def expert(self, layer: int, e: int, inter: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate w1, up w3, down w2) of routed expert ``e``, always stored one by one under mtp.0."""
        p = f"{self.prefix}ffn.experts.{e}"
        return tuple(self.src.read_source(f"{p}.{w}.weight") for w in ("w1", "w3", "w2"))  # type: ignore[return-value]


def mtp_source_name(hf_name: str, layer: int, prefix: str) -> str:
    """``model.layers.{layer}.self_attn.q_a_proj.weight`` → ``mtp.0.attn.wq_a.weight`` (the official renames)."""
    inner = hf_name[len(f"model.layers.{layer}."):]
    return prefix + hf_to_official("model.layers.0." + inner)[len("layers.0."):]


def required_names(cfg: V4Config, prefix: str) -> list[str]:
    """Every on-disk name the MTP graph reads."""
    from lineside.build.models.deepseek_v4 import required_tensors

    layer = mtp_config(cfg)
    hf = [n for n in required_tensors(layer) if n.startswith(f"model.layers.{cfg.num_layers}.")
          and not n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    names = [prefix + n for n in OWN] + [mtp_source_name(n, cfg.num_layers, prefix) for n in hf]
    names += [f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts) for w in ("w1", "w3", "w2")]
    return names


def find_mtp(src: V4Source, cfg: V4Config) -> MtpSource | None:
    """The checkpoint's MTP module (None when the config names none or the file holds no ``mtp.0.*``: then the
    bundle is built without it); one line naming the first missing tensor of an incomplete one."""
    if cfg.mtp_layers < 1:
        return None
    names = src.source_names()
    prefix = next((p for p in ("mtp.0.", "model.mtp.0.") if any(n.startswith(p) for n in names)), None)
    if prefix is None:
        return None
    missing = [n for n in required_names(cfg, prefix) if n not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]!r} of the MTP module is missing from the checkpoint{more}; "
                              "the checkpoint is incomplete (or drop its mtp.* tensors to build without MTP)")
    return MtpSource(src, cfg, prefix)


@dataclass(frozen=True)
class NodeRange:
    """Nodes ``gb.nodes[start:end]`` of the main graph that turn tensor ``entry`` into ``out`` (the embedding, the
    LM head): the MTP graph runs the very same nodes on the very same initializers, so those weights are stored
    once."""

    start: int
    end: int
    entry: str
    out: str


@dataclass
class MtpGraph:
    """The emitted MTP graph, written (``write``) once the main graph has closed the shared weight file."""

    nodes: list[onnx.NodeProto]
    inputs: list[onnx.ValueInfoProto]
    outputs: list[onnx.ValueInfoProto]
    initializers: list[onnx.TensorProto]
    state: StateTensor
    hidden_shape: list[int]
    weight_fraction: float
    name: str = "deepseek_v4_mtp"

    def write(self, gb: GraphBuilder, path: Path) -> dict[str, Any]:
        """Save beside ``gb``'s graph (it reads ``model.onnx.data`` by relative name); its manifest record."""
        gb.write_graph(path, self.nodes, self.inputs, self.initializers, name=self.name, outputs=self.outputs)
        return {"graph": path.name, "inputs": list(MTP_INPUTS), "state": [self.state.to_dict()], "hidden": HIDDEN,
                "hidden_shape": self.hidden_shape, "weight_fraction": self.weight_fraction}


def emit_mtp(o: Ops, cfg: V4Config, mtp: MtpSource, max_seq: int, *, rope_inv: dict[str, tuple[str, float]],
             embedding: NodeRange, lm_head: NodeRange) -> MtpGraph:
    """Emit the MTP graph into ``o``'s builder (its weights go to the same data file) without touching the main
    graph's nodes, inputs, outputs or initializers, which are put back as they were."""
    from lineside.build.models.deepseek_v4.graph import emit_block, gather_positions

    gb = o.gb
    main_nodes, main_inputs, main_outputs, main_inits = gb.nodes, gb.inputs, gb.outputs, list(gb.initializers)
    gb.nodes, gb.inputs, gb.outputs = [], [], []
    n, d = cfg.hc_mult, cfg.hidden_size
    mcfg, st = mtp_config(cfg), mtp_state(cfg)
    try:
        ids = gb.input("input_ids", TensorProto.INT64, ["batch", "seq"])
        hid = gb.input(HIDDEN, TensorProto.FLOAT, ["batch", "seq", n, d])
        past = gb.input("past_lengths", TensorProto.INT64, ["batch"])
        lpos = gb.input("logits_positions", TensorProto.INT64, ["batch", "n_logits"])
        gb.input(st.input, TensorProto.FLOAT, st.shape)
        seq = o.dim(ids, 1)
        pos = o.add(o.unsqueeze(past, [1]), o.unsqueeze(o.op("Range", o.i64(0), seq, o.i64(1)), [0]))
        inv, factor = rope_inv["main"]  # a sliding layer rotates with the main rope
        ctx = StepCtx(past=past, pos=pos, seq=seq, total=o.add(past, seq),
                      rope={"main": rope_tables(o, o.cast(pos, TensorProto.FLOAT), inv, factor)}, rope_inv=rope_inv)
        gb.nodes.extend(_copied(main_nodes, embedding, main_inits))
        e = o.rmsnorm(embedding.out, mtp.own("enorm.weight"), cfg.rms_norm_eps, "mtp.enorm")
        hn = o.rmsnorm(hid, mtp.own("hnorm.weight"), cfg.rms_norm_eps, "mtp.hnorm")
        hp = o.reshape(o.linear(o.reshape(hn, [0, -1, d]), "mtp.h_proj", mtp.own("h_proj.weight")), o.op("Shape", hid))
        x = o.add(o.unsqueeze(o.linear(e, "mtp.e_proj", mtp.own("e_proj.weight")), [2]), hp)  # [B, S, N, D]
        hc = HyperConnection(o, mcfg)
        x, new = emit_block(o, mcfg, mtp, cfg.num_layers, x, ids, {"window": (st.input, st.output)},
                            (AttentionEmitter(o, mcfg, ctx, max_seq), hc, MoE(o, mcfg)))
        xs = gather_positions(o, mcfg, x, ids, seq, lpos)  # [B, K, N, D]
        gb.op("Identity", [xs], outputs=[MTP_HIDDEN])
        head = {"hc_fn": mtp.own("hc_head_fn"), "hc_base": mtp.own("hc_head_base"), "hc_scale": mtp.own("hc_head_scale")}
        h = o.rmsnorm(hc.head(xs, head, name="mtp.hc_head"), mtp.own("norm.weight"), cfg.rms_norm_eps, "mtp.norm")
        gb.op("Identity", [h], outputs=[lm_head.entry])  # the main LM head's nodes read it by that name
        gb.nodes.extend(_copied(main_nodes, lm_head, main_inits))
        gb.op("Identity", [lm_head.out], outputs=["logits"])
        gb.op("Identity", [new["window"]], outputs=[st.output])
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "n_logits", cfg.vocab_size]),
                   helper.make_tensor_value_info(MTP_HIDDEN, TensorProto.FLOAT, ["batch", "n_logits", n, d]),
                   helper.make_tensor_value_info(st.output, TensorProto.FLOAT, st.shape)]
        nodes, inputs = gb.nodes, gb.inputs
        used = {name for node in nodes for name in node_reads(node)}
        inits = [t for t in gb.initializers if t.name in used]
        main_used = {name for node in main_nodes for name in node_reads(node)}
        fraction = initializer_bytes(inits) / max(1, initializer_bytes([t for t in main_inits if t.name in main_used]))
    finally:
        gb.nodes, gb.inputs, gb.outputs, gb.initializers = main_nodes, main_inputs, main_outputs, main_inits
    if len({t.name for t in inits}) != len(inits):
        raise CheckpointError("the MTP graph names one initializer twice; this is a lineside bug, please report it")
    return MtpGraph(nodes, inputs, outputs, inits, st, [n, d], round(fraction, 4))


def _copied(nodes: list[onnx.NodeProto], r: NodeRange, inits: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """The range's nodes, checked to read nothing but the entry, initializers and each other."""
    part = nodes[r.start:r.end]
    known = {r.entry} | {t.name for t in inits} | {o for n in part for o in n.output}
    stray = [i for n in part for i in n.input if i and i not in known]
    assert not stray, f"shared nodes read {stray[0]} from outside their range"
    return part
