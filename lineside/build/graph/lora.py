"""The LoRA variant of a dense graph: the same nodes and the same (INT4) weights, plus a per-row adapter delta.

Every adapted matmul ``y = x W^T`` (a fused q/k/v or gate/up one included) gets a delta computed with the
adapters' matrices on the left, tokens on the right, so the large operand is read as it lies (onnxruntime's
GEMM repacks its right operand on every call; on the left the stack is not copied — 1.7× faster measured):
``xaT = A^T · x^T`` (a Gemm, ``A^T [P·K, in]``), masked per token, split into the site's P adapted parts,
``deltaT_part = B^T_part · xaT_part`` (``B^T_part [out_part, K]``: only that part's outputs, no zero blocks
for the other parts of a fused output), padded to the fused width, transposed back and added to y. K is the
stack's live width (the loaded adapters' ranks summed, a dynamic dimension; runtime/lora_stack.py packs
it), so a step reads what is loaded. The mask ``[P·K, tokens]`` is 1 where a column's slot
(``lora_cols.P``) is the token's row's slot (``lora_slots``), 0 elsewhere: rows with different adapters and
rows with none (slot 0) run in one batch with standard ops only. The variant is a second ``.onnx`` next to
the base one, reading the base one's external-data file: no weight is stored twice, and the base graph stays
exactly as it was (its decode speed untouched).
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
BSO = "lora/shape_b_s_out"  # [B, S, -1]: a [tokens, out] delta back to y's shape


@dataclass(frozen=True)
class SiteTensors:
    """Where an adapted matmul reads its input and writes its output in the base graph."""

    site: LoraSite
    x: str
    y: str
    x_scale: np.ndarray | None = None  # x is the layer's input divided by this (AWQ's folded scales): undone first


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

    # each token's adapter slot ([tokens]: its row's, repeated over the step's positions), and [B, S, -1]
    one, minus1 = const("lora/axis_1", np.array([1], np.int64)), const("lora/minus_1", np.array([-1], np.int64))
    nodes = [helper.make_node("Shape", ["input_ids"], ["lora/shape_b_s"], name="lora/shape_b_s"),
             helper.make_node("Concat", ["lora/shape_b_s", minus1], [BSO], name="lora/shape_b_s_out", axis=0),
             helper.make_node("Unsqueeze", [LORA_SLOTS_INPUT, one], ["lora/slots_b1"], name="lora/slots_b1"),
             helper.make_node("Expand", ["lora/slots_b1", "lora/shape_b_s"], ["lora/slots_bs"], name="lora/slots_bs"),
             helper.make_node("Reshape", ["lora/slots_bs", minus1], ["lora/slots_tok"], name="lora/slots_tok")]
    inputs = list(gb.inputs) + [helper.make_tensor_value_info(LORA_SLOTS_INPUT, TensorProto.INT64, ["batch"])]
    masks: dict[int, str] = {}
    for p in sorted({len(s.site.parts) for s in sites}):
        inputs.append(helper.make_tensor_value_info(cols_input(p), TensorProto.INT64, [_width_dim(p)]))
        nodes += [helper.make_node("Unsqueeze", [cols_input(p), one], [f"lora/cols{p}_k1"], name=f"lora/cols{p}"),
                  helper.make_node("Equal", [f"lora/cols{p}_k1", "lora/slots_tok"], [f"lora/eq{p}"], name=f"lora/eq{p}"),
                  helper.make_node("Cast", [f"lora/eq{p}"], [f"lora/mask{p}"], name=f"lora/mask{p}", to=F32)]
        masks[p] = f"lora/mask{p}"  # [P·K, tokens]
        if p > 1:  # the sizes a P-part site's Split takes: [K] * P
            nodes += [helper.make_node("Shape", [cols_input(p)], [f"lora/width{p}"], name=f"lora/width{p}"),
                      helper.make_node("Div", [f"lora/width{p}", const(f"lora/parts_{p}", np.array([p], np.int64))],
                                       [f"lora/k{p}"], name=f"lora/k{p}"),
                      helper.make_node("Concat", [f"lora/k{p}"] * p, [_split_sizes(p)], name=_split_sizes(p), axis=0)]
    for s in sites:
        inputs.append(helper.make_tensor_value_info(s.site.a_input, F32, [_width_dim(len(s.site.parts)),
                                                                          s.site.in_features]))
        inputs += [helper.make_tensor_value_info(b, F32, [w, _width_dim(1)])
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


def _split_sizes(parts: int) -> str:
    """[K] * P: the sizes a P-part site's Split takes. Given as an input rather than ``num_outputs``: a step with no
    adapter row binds the stack at width 0, and onnxruntime 1.20-1.23 refuse ``num_outputs`` over an empty
    dimension ("Invalid num_outputs value of 3. Size of dimension being split is 0")."""
    return f"lora/split_sizes{parts}"


def _site_delta(site: SiteTensors, mask: str, nodes: list[onnx.NodeProto], const: Callable[[str, np.ndarray], str]) -> str:
    """Append the nodes of one site's masked delta (shaped like its fused output y); return its name."""
    s, tag = site.site, f"lora/{site.site.layer}.{site.site.site}"
    flat = const(f"lora/shape_tokens_{s.in_features}", np.array([-1, s.in_features], np.int64))
    x = site.x
    if site.x_scale is not None:  # the adapter was trained on the unscaled input: B·A·x, not B·A·(x/s)
        x = f"{tag}/x_unscaled"
        nodes.append(helper.make_node("Mul", [site.x, const(f"{tag}/awq_scale", site.x_scale.astype(np.float32))],
                                      [x], name=f"{tag}/x_unscaled"))
    nodes += [helper.make_node("Reshape", [x, flat], [f"{tag}/x2d"], name=f"{tag}/x2d"),
              helper.make_node("Gemm", [s.a_input, f"{tag}/x2d"], [f"{tag}/xa"], name=f"{tag}/xa", transB=1),
              helper.make_node("Mul", [f"{tag}/xa", mask], [f"{tag}/xam"], name=f"{tag}/mask")]
    per_part = [f"{tag}/xam"]
    if len(s.parts) > 1:  # every part's block is K rows: an even split
        per_part = [f"{tag}/xam.{p.value}" for p in s.parts]
        nodes.append(helper.make_node("Split", [f"{tag}/xam", _split_sizes(len(s.parts))], per_part,
                                      name=f"{tag}/split", axis=0))
    pieces, end = [], 0
    for j, (part, b, offset, width) in enumerate(zip(s.parts, s.b_inputs, s.offsets, s.part_widths, strict=True)):
        d = f"{tag}/delta.{part.value}"
        nodes.append(helper.make_node("MatMul", [b, per_part[j]], [d], name=f"{tag}/xab.{part.value}"))
        left = offset - end  # output rows of unadapted parts before this one, and after the last
        right = s.out_features - offset - width if j == len(s.parts) - 1 else 0
        if left or right:
            pads = const(f"lora/pads_{left}_{right}", np.array([left, 0, right, 0], dtype=np.int64))
            nodes.append(helper.make_node("Pad", [d, pads], [f"{d}/padded"], name=f"{tag}/pad.{part.value}"))
            d = f"{d}/padded"
        pieces.append(d)
        end = offset + width
    delta_t = pieces[0]
    if len(pieces) > 1:
        delta_t = f"{tag}/delta_t"
        nodes.append(helper.make_node("Concat", pieces, [delta_t], name=f"{tag}/concat", axis=0))
    nodes += [helper.make_node("Transpose", [delta_t], [f"{tag}/delta_2d"], name=f"{tag}/transpose", perm=[1, 0]),
              helper.make_node("Reshape", [f"{tag}/delta_2d", BSO], [f"{tag}/delta"], name=f"{tag}/delta")]
    return f"{tag}/delta"
