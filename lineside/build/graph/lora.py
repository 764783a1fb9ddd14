"""The LoRA variant of a dense graph: the same nodes and the same (INT4) weights, plus a per-row adapter delta.

Every adapted matmul ``y = x W^T`` becomes ``y + ((x @ A) * mask) @ B`` where A ``[in, K]`` and B ``[K, out]``
are graph inputs holding every adapter slot side by side (K = slots × rank × parts, slot-major), and
``mask [B, 1, K]`` is 1 on the columns of the row's slot (``lora_cols.P == lora_slots``), 0 elsewhere — so
rows with different adapters, and rows with none (slot 0), run in one batch with standard ops only, and the
whole stack is read once per step whatever the mix (no per-row gather of weights). The variant is a second
``.onnx`` next to the base one, reading the base one's external-data file: no weight is stored twice, and
the base graph stays exactly as it was (its decode speed untouched).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from lineside.build.graph.builder import GraphBuilder
from lineside.lora import LORA_SLOTS_INPUT, LoraSite, cols_input

F32 = TensorProto.FLOAT


@dataclass(frozen=True)
class SiteTensors:
    """Where an adapted matmul reads its input and writes its output in the base graph."""

    site: LoraSite
    x: str
    y: str


def write_lora_graph(gb: GraphBuilder, sites: list[SiteTensors], path: Path) -> Path:
    """Write the LoRA variant of ``gb``'s (already saved) graph to ``path`` in the same directory."""
    if Path(path).parent != gb.onnx_path.parent:
        raise ValueError("the LoRA graph must sit beside the base graph (it reads the same external data)")
    by_y = {s.y: s for s in sites}
    consts: list[onnx.TensorProto] = []

    def const(name: str, value: np.ndarray) -> str:
        consts.append(numpy_helper.from_array(value, name))
        return name

    axes = const("lora/axes_1_2", np.array([1, 2], dtype=np.int64))
    nodes = [helper.make_node("Unsqueeze", [LORA_SLOTS_INPUT, axes], ["lora/slots_b11"], name="lora/slots")]
    inputs = list(gb.inputs) + [helper.make_tensor_value_info(LORA_SLOTS_INPUT, TensorProto.INT64, ["batch"])]
    masks: dict[int, str] = {}
    for p in sorted({len(s.site.parts) for s in sites}):
        k = f"lora_k{p}"
        inputs.append(helper.make_tensor_value_info(cols_input(p), TensorProto.INT64, [k]))
        nodes += [helper.make_node("Equal", ["lora/slots_b11", cols_input(p)], [f"lora/eq{p}"], name=f"lora/eq{p}"),
                  helper.make_node("Cast", [f"lora/eq{p}"], [f"lora/mask{p}"], name=f"lora/mask{p}", to=F32)]
        masks[p] = f"lora/mask{p}"
    for s in sites:
        k = f"lora_k{len(s.site.parts)}"
        inputs += [helper.make_tensor_value_info(s.site.a_input, F32, [s.site.in_features, k]),
                   helper.make_tensor_value_info(s.site.b_input, F32, [k, s.site.out_features])]
    for node in gb.nodes:
        site = next((by_y[o] for o in node.output if o in by_y), None)
        if site is None:
            nodes.append(node)
            continue
        base = f"{site.y}/without_lora"
        renamed = onnx.NodeProto()
        renamed.CopyFrom(node)
        renamed.output[list(renamed.output).index(site.y)] = base
        tag = f"lora/{site.site.layer}.{site.site.site}"
        nodes += [renamed,
                  helper.make_node("MatMul", [site.x, site.site.a_input], [f"{tag}/xa"], name=f"{tag}/xa"),
                  helper.make_node("Mul", [f"{tag}/xa", masks[len(site.site.parts)]], [f"{tag}/xam"],
                                   name=f"{tag}/mask"),
                  helper.make_node("MatMul", [f"{tag}/xam", site.site.b_input], [f"{tag}/delta"], name=f"{tag}/xab"),
                  helper.make_node("Add", [base, f"{tag}/delta"], [site.y], name=f"{tag}/add")]
    return gb.write_variant(Path(path), nodes=nodes, inputs=inputs, extra_initializers=consts)
