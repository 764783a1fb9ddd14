"""The LoRA variant of a dense graph: the same nodes and the same (INT4) weights, plus a per-row adapter delta.

Every adapted matmul ``y = x W^T`` (a fused q/k/v or gate/up one included) becomes
``y + pad(((x @ A) * mask) split per part @ B_part)``: A ``[in, P·K]`` holds every loaded adapter's columns for
each of the site's P adapted parts side by side (K: the stack's live width — the loaded adapters' ranks summed,
a dynamic dimension), each B_part ``[K, out_part]`` only its own part's outputs (no zero blocks for the other
parts of a fused output), and ``mask [B, 1, P·K]`` is 1 on the columns of the row's slot (``lora_cols.P ==
lora_slots``), 0 elsewhere — so rows with different adapters, and rows with none (slot 0), run in one batch
with standard ops only, and what is read per step is what is loaded (runtime/lora_stack.py packs it). The
variant is a second ``.onnx`` next to the base one, reading the base one's external-data file: no weight is
stored twice, and the base graph stays exactly as it was (its decode speed untouched).
"""

from __future__ import annotations

from collections.abc import Callable
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
        if name not in {c.name for c in consts}:
            consts.append(numpy_helper.from_array(value, name))
        return name

    axes = const("lora/axes_1_2", np.array([1, 2], dtype=np.int64))
    nodes = [helper.make_node("Unsqueeze", [LORA_SLOTS_INPUT, axes], ["lora/slots_b11"], name="lora/slots")]
    inputs = list(gb.inputs) + [helper.make_tensor_value_info(LORA_SLOTS_INPUT, TensorProto.INT64, ["batch"])]
    masks: dict[int, str] = {}
    for p in sorted({len(s.site.parts) for s in sites}):
        inputs.append(helper.make_tensor_value_info(cols_input(p), TensorProto.INT64, [_width_dim(p)]))
        nodes += [helper.make_node("Equal", ["lora/slots_b11", cols_input(p)], [f"lora/eq{p}"], name=f"lora/eq{p}"),
                  helper.make_node("Cast", [f"lora/eq{p}"], [f"lora/mask{p}"], name=f"lora/mask{p}", to=F32)]
        masks[p] = f"lora/mask{p}"
    for s in sites:
        inputs.append(helper.make_tensor_value_info(s.site.a_input, F32, [s.site.in_features,
                                                                          _width_dim(len(s.site.parts))]))
        inputs += [helper.make_tensor_value_info(b, F32, [_width_dim(1), w])
                   for b, w in zip(s.site.b_inputs, s.site.part_widths, strict=True)]
    for node in gb.nodes:
        site = next((by_y[o] for o in node.output if o in by_y), None)
        if site is None:
            nodes.append(node)
            continue
        base = f"{site.y}/without_lora"
        renamed = onnx.NodeProto()
        renamed.CopyFrom(node)
        renamed.output[list(renamed.output).index(site.y)] = base
        nodes.append(renamed)
        delta = _site_delta(site, masks[len(site.site.parts)], nodes, const)
        nodes.append(helper.make_node("Add", [base, delta], [site.y], name=f"lora/{site.site.layer}.{site.site.site}/add"))
    return gb.write_variant(Path(path), nodes=nodes, inputs=inputs, extra_initializers=consts)


def _width_dim(parts: int) -> str:
    """The symbolic width of a P-part site's A: P times the stack's live width K."""
    return "lora_k" if parts == 1 else f"lora_k{parts}"


def _site_delta(site: SiteTensors, mask: str, nodes: list[onnx.NodeProto], const: Callable[[str, np.ndarray], str]) -> str:
    """Append the nodes of one site's masked delta (as wide as its fused output); return its name."""
    s, tag = site.site, f"lora/{site.site.layer}.{site.site.site}"
    nodes += [helper.make_node("MatMul", [site.x, s.a_input], [f"{tag}/xa"], name=f"{tag}/xa"),
              helper.make_node("Mul", [f"{tag}/xa", mask], [f"{tag}/xam"], name=f"{tag}/mask")]
    per_part = [f"{tag}/xam"]
    if len(s.parts) > 1:  # every part's block is K wide: an even split
        per_part = [f"{tag}/xam.{p.value}" for p in s.parts]
        nodes.append(helper.make_node("Split", [f"{tag}/xam"], per_part, name=f"{tag}/split", axis=-1,
                                      num_outputs=len(s.parts)))
    pieces, end = [], 0
    for j, (part, b, offset, width) in enumerate(zip(s.parts, s.b_inputs, s.offsets, s.part_widths, strict=True)):
        d = f"{tag}/delta.{part.value}"
        nodes.append(helper.make_node("MatMul", [per_part[j], b], [d], name=f"{tag}/xab.{part.value}"))
        left = offset - end  # output columns of unadapted parts before this one, and after the last
        right = s.out_features - offset - width if j == len(s.parts) - 1 else 0
        if left or right:
            pads = const(f"lora/pads_{left}_{right}", np.array([0, 0, left, 0, 0, right], dtype=np.int64))
            nodes.append(helper.make_node("Pad", [d, pads], [f"{d}/padded"], name=f"{tag}/pad.{part.value}"))
            d = f"{d}/padded"
        pieces.append(d)
        end = offset + width
    if len(pieces) == 1:
        return pieces[0]
    nodes.append(helper.make_node("Concat", pieces, [f"{tag}/delta"], name=f"{tag}/concat", axis=-1))
    return f"{tag}/delta"
