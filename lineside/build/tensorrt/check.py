"""`lineside check`: will this ONNX graph parse in a given TensorRT? Runs anywhere (no TensorRT needed).

Every node's op, domain and data types are compared with the op-support table of that TensorRT
release (derived from onnx-tensorrt's docs/operators.md, see optable.py), plus the restrictions
that can be checked statically (constant inputs, symmetric INT4 DequantizeLinear, TopK limits).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from lineside.build.tensorrt.optable import load_table, resolve_version
from lineside.errors import BundleError

DTYPE_NAMES = {
    TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
    TensorProto.DOUBLE: "DOUBLE", TensorProto.INT32: "INT32", TensorProto.INT64: "INT64",
    TensorProto.INT8: "INT8", TensorProto.UINT8: "UINT8", TensorProto.BOOL: "BOOL",
    TensorProto.INT16: "INT16", TensorProto.UINT16: "UINT16", TensorProto.UINT32: "UINT32",
    TensorProto.UINT64: "UINT64", TensorProto.STRING: "STRING", TensorProto.INT4: "INT4",
    TensorProto.UINT4: "UINT4", TensorProto.FLOAT8E4M3FN: "FP8", TensorProto.FLOAT8E5M2: "FP8E5M2",
    TensorProto.COMPLEX64: "COMPLEX64", TensorProto.COMPLEX128: "COMPLEX128",
}
if hasattr(TensorProto, "FLOAT4E2M1"):
    DTYPE_NAMES[TensorProto.FLOAT4E2M1] = "FP4"

QUANTIZED = {"INT8", "INT4", "FP8", "FP4"}  # only behind (De)QuantizeLinear or as Constant data
DEFAULT_DOMAINS = ("", "ai.onnx")

# Which inputs/outputs carry the "data" whose type the table's "Supported Types" column describes
# (index, shape and condition inputs are int64/bool by the ONNX spec and are not listed there).
_ALL = "all"
_DATA_IO: dict[str, tuple[Any, Any]] = {
    **{op: (_ALL, (0,)) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Sum", "Mean",
                                   "And", "Or", "Xor", "Concat", "MatMul", "Gemm", "Einsum", "PRelu")},
    **{op: (_ALL, ()) for op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Range")},
    **{op: ((0,), ()) for op in ("ArgMax", "ArgMin", "IsNaN", "IsInf", "Shape", "Size", "NonZero",
                                 "DequantizeLinear", "QuantizeLinear")},
    "Where": ((1, 2), (0,)),
    "Constant": ((), (0,)),
    "ConstantOfShape": ((), (0,)),
    "ScatterND": ((0, 2), (0,)),
    "ScatterElements": ((0, 2), (0,)),
    "Scatter": ((0, 2), (0,)),
    "TensorScatter": ((0, 1), (0,)),
    "If": ((), ()),
    "Loop": ((), ()),
    "Scan": ((), ()),
}


@dataclass
class Offender:
    node: str
    op: str
    dtypes: str
    reason: str


@dataclass
class CheckReport:
    trt_version: str
    graph: str
    nodes: int = 0
    op_counts: Counter = field(default_factory=Counter)
    offenders: list[Offender] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.offenders

    def summary(self) -> str:
        if self.ok:
            return f"{self.graph}: all {self.nodes} nodes parse in TensorRT {self.trt_version}"
        return (f"{self.graph}: {len(self.offenders)} of {self.nodes} nodes would fail in TensorRT "
                f"{self.trt_version}")


class _Graphs:
    """Constness and dtype facts for a model (and its subgraphs)."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None):
        self.base_dir = base_dir
        self.types: dict[str, int] = {}
        self.inits: dict[str, TensorProto] = {}
        self.const_nodes: dict[str, TensorProto] = {}
        self.graph_inputs: set[str] = set()
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # inference is best effort; dtypes of graph I/O and weights still count
            inferred = model
        self._collect(inferred.graph)
        self.constant: set[str] = set(self.inits) | set(self.const_nodes)
        self.folded = self._fold(inferred.graph)

    def _collect(self, g: onnx.GraphProto) -> None:
        for vi in list(g.value_info) + list(g.input) + list(g.output):
            if vi.type.HasField("tensor_type"):
                self.types[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            self.inits[t.name] = t
            self.types[t.name] = t.data_type
        self.graph_inputs.update(i.name for i in g.input if i.name not in self.inits)
        for n in g.node:
            if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS:
                for a in n.attribute:
                    if a.name == "value":
                        self.const_nodes[n.output[0]] = a.t
                        self.types[n.output[0]] = a.t.data_type
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    self._collect(a.g)
                for sg in a.graphs:
                    self._collect(sg)

    def _fold(self, g: onnx.GraphProto) -> set[str]:
        """Names computable at build time (from constants only; Shape of a static input counts too)."""
        folded = set(self.constant)
        for n in g.node:
            ins = [i for i in n.input if i]
            if n.op_type == "Shape" or all(i in folded for i in ins):
                folded.update(o for o in n.output if o)
        return folded

    def value(self, name: str) -> np.ndarray | None:
        t = self.inits.get(name) or self.const_nodes.get(name)
        if t is None:
            return None
        try:
            return numpy_helper.to_array(t, base_dir=str(self.base_dir or ""))
        except Exception:
            return None


def _dtype(g: _Graphs, name: str) -> str | None:
    et = g.types.get(name)
    if not et:
        return None
    return DTYPE_NAMES.get(et, TensorProto.DataType.Name(et))


def _data_names(node: onnx.NodeProto) -> tuple[list[str], list[str]]:
    ins_rule, outs_rule = _DATA_IO.get(node.op_type, ((0,), (0,)))
    ins = list(node.input) if ins_rule == _ALL else [node.input[i] for i in ins_rule if i < len(node.input)]
    outs = list(node.output) if outs_rule == _ALL else [node.output[i] for i in outs_rule if i < len(node.output)]
    if node.op_type in ("Cast", "CastLike"):
        ins, outs = [node.input[0]], [node.output[0]]
    return [i for i in ins if i], [o for o in outs if o]


def _input_index(node: onnx.NodeProto, name: str, opset: int) -> int | None:
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except Exception:
        return None
    for i, fi in enumerate(schema.inputs):
        if fi.name == name:
            return i
    return None


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _check_node(node: onnx.NodeProto, g: _Graphs, table: dict[str, Any], opset: int, ver: str,
                rep: CheckReport) -> None:
    name = node.name or f"<unnamed {node.op_type}>"
    ins, outs = _data_names(node)
    seen = {n: _dtype(g, n) for n in ins + outs}
    dts = ", ".join(sorted({d for d in seen.values() if d})) or "?"

    def bad(reason: str, dtypes: str = dts) -> None:
        rep.offenders.append(Offender(name, f"{node.domain + '::' if node.domain else ''}{node.op_type}", dtypes, reason))

    if node.domain not in DEFAULT_DOMAINS:
        bad(f"custom op in domain {node.domain!r}: TensorRT's ONNX parser has no importer for it (needs a plugin)")
        return
    entry = table["ops"].get(node.op_type)
    if entry is None:
        bad(f"{node.op_type} is not in TensorRT {ver}'s ONNX operator table")
        return
    if not entry["supported"]:
        bad(f"{node.op_type} is not supported by TensorRT {ver}'s ONNX parser")
        return
    allowed = set(entry["types"])
    flagged: set[str] = set()
    for tname, dt in seen.items():
        if dt is None or dt in allowed:
            continue
        if dt == "UINT8" and node.op_type in ("Cast", "Identity"):
            continue  # UINT8 graph I/O is converted on entry/exit
        flagged.add(tname)
        bad(f"{'input' if tname in ins else 'output'} {tname!r} is {dt}; TensorRT {ver} takes "
            f"{', '.join(entry['types'])} for {node.op_type}", dt)
    # quantized tensors reach only (De)QuantizeLinear
    if node.op_type not in ("DequantizeLinear", "QuantizeLinear", "Constant", "Identity"):
        for i in node.input:
            dt = _dtype(g, i) if i else None
            if dt in QUANTIZED and i not in flagged:
                bad(f"input {i!r} is {dt}: TensorRT takes {dt} only through DequantizeLinear", dt)
    _check_restrictions(node, g, entry, opset, bad)


def _check_restrictions(node: onnx.NodeProto, g: _Graphs, entry: dict[str, Any], opset: int, bad: Any) -> None:
    text = entry.get("restrictions", "")
    for rule in entry.get("const_inputs", []):
        idx = _input_index(node, rule["input"], opset)
        if idx is None or idx >= len(node.input) or not node.input[idx]:
            continue
        src = node.input[idx]
        const = src in g.constant if rule["kind"] == "an initializer" else src in g.folded
        if not const:
            bad(f"input {rule['input']!r} ({src}) must be {rule['kind']}")
    if node.op_type == "DequantizeLinear":
        x_dt = _dtype(g, node.input[0])
        if "zero" in text and len(node.input) > 2 and node.input[2]:
            zp = g.value(node.input[2])
            if zp is None and node.input[2] not in g.constant:
                bad(f"x_zero_point {node.input[2]!r} must be a constant zero")
            elif zp is not None and np.any(zp.astype(np.int64) != 0):
                bad(f"x_zero_point {node.input[2]!r} is not zero (TensorRT quantization is symmetric only)")
        if x_dt in ("INT4", "UINT4"):
            bs = int(_attr(node, "block_size", 0) or 0)
            if x_dt == "UINT4":
                bad("UINT4 weights: TensorRT takes signed INT4 with a zero point of 0", x_dt)
            if bs not in (64, 128):
                bad(f"{x_dt} block_size {bs}: TensorRT's INT4 weight-only path takes block 64 or 128", x_dt)
            if node.input[0] not in g.constant:
                bad("INT4 DequantizeLinear input must be a constant weight", x_dt)
            dims = list(g.inits[node.input[0]].dims) if node.input[0] in g.inits else []
            if dims and dims[-1] % 2:  # onnx-tensorrt: "Quantization to INT4 is not supported ... odd last dimension"
                bad(f"INT4 weight {node.input[0]!r} has an odd last dimension {dims[-1]} (TensorRT packs INT4 "
                    "in pairs; rebuild with this lineside, which pads it)", x_dt)
            axis = int(_attr(node, "axis", 1) or 0) % max(len(dims), 1)
            if dims and bs and dims[axis] % bs:
                bad(f"INT4 weight {node.input[0]!r}: {dims[axis]} along axis {axis} is not a whole number of "
                    f"blocks of {bs}", x_dt)
    if node.op_type == "TopK":
        if "`sorted` must be 1" in text and int(_attr(node, "sorted", 1)) != 1:
            bad("TopK sorted=0 is not supported (must be 1)")
        m = re.search(r"`K` input must be less than (\d+)", text)
        k = g.value(node.input[1]) if len(node.input) > 1 else None
        if m and k is not None and int(np.asarray(k).reshape(-1)[0]) >= int(m.group(1)):
            bad(f"TopK K={int(np.asarray(k).reshape(-1)[0])} must be less than {m.group(1)}")
        if "initializer" in text and node.input[1] not in g.constant:
            bad("TopK K must be an initializer")
    if node.op_type == "ScatterND" and "reduction" in text and _attr(node, "reduction", b"none") not in (b"none", "none"):
        bad("ScatterND reduction other than 'none' is not supported")


def _walk(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk(a.g)
            for sg in a.graphs:
                yield from _walk(sg)


def check_model(model: onnx.ModelProto, trt: str = "10.3", graph_name: str = "model",
                base_dir: Path | None = None) -> CheckReport:
    """Check every node of ``model`` against TensorRT ``trt``'s ONNX parser support table."""
    ver = resolve_version(trt)
    table = load_table(ver)
    rep = CheckReport(trt_version=ver, graph=graph_name)
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if table.get("opset_max") and opset > table["opset_max"]:
        note = (f"graph opset {opset} is above the documented range {table['opset_min']}-{table['opset_max']} "
                f"of this table")
        if opset == 21:
            note += "; opset 21 is what INT4 DequantizeLinear (block_size) needs, which TensorRT parses since 10.0"
        rep.notes.append(note)
    g = _Graphs(model, base_dir)
    graph_types = set(table.get("graph_types") or []) | {"INT4"}
    for vi in list(model.graph.input) + list(model.graph.output):
        dt = _dtype(g, vi.name)
        if vi.name in g.inits:
            continue
        if dt and (dt not in graph_types or dt in QUANTIZED):
            kind = "input" if vi in model.graph.input else "output"
            rep.offenders.append(Offender(f"graph {kind} {vi.name}", "-", dt,
                                          f"{dt} is not a TensorRT {ver} network {kind} type"))
    for t in model.graph.initializer:
        dt = DTYPE_NAMES.get(t.data_type, str(t.data_type))
        if dt not in graph_types and dt != "UINT4":  # UINT4 is reported at its DequantizeLinear
            rep.offenders.append(Offender(f"initializer {t.name}", "-", dt, f"{dt} weights are not a TensorRT type"))
    for node in _walk(model.graph):
        rep.nodes += 1
        rep.op_counts[f"{node.domain + '::' if node.domain else ''}{node.op_type}"] += 1
        _check_node(node, g, table, opset, ver, rep)
    return rep


def check_onnx_file(path: Path, trt: str = "10.3") -> CheckReport:
    """Load the graph structure only (weights stay on disk) and check it."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"{path}: ONNX graph not found; rebuild the bundle with --flavors trt")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a truncated or non-ONNX file
        raise BundleError(f"{path}: not a readable ONNX graph ({type(e).__name__}); rebuild the bundle") from None
    return check_model(model, trt, graph_name=path.name, base_dir=path.parent)


def check_bundle(bundle: Any, trt: str = "10.3", flavor: str = "trt") -> CheckReport:
    """Check a bundle's ``trt`` graph (its path comes from the manifest)."""
    fl = bundle.flavor(flavor)
    return check_onnx_file(bundle.file(fl.graph), trt)


def check_bundle_graphs(bundle: Any, trt: str = "10.3", flavor: str = "trt") -> list[CheckReport]:
    """The ``trt`` graph and, when the bundle was built with --max-lora-rank, its LoRA graph."""
    fl = bundle.flavor(flavor)
    return [check_bundle(bundle, trt, flavor)] + ([check_onnx_file(bundle.file(fl.lora_graph), trt)]
                                                 if fl.lora_graph else [])
