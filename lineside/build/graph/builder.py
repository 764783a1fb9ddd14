"""A small ONNX graph builder that streams weights straight to the external-data file.

Graphs are emitted from weights (no tracing). Each weight is written to ``<model>.onnx.data``
as soon as it is added, so a model is never held whole in memory while building.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

MS_DOMAIN = "com.microsoft"
OPSET = 21  # INT4 DequantizeLinear with block_size (REFERENCE.md: ONNX)
_ALIGN = 64

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}


class GraphBuilder:
    """Accumulates nodes, inputs and outputs; weights go to disk immediately (external data)."""

    def __init__(self, onnx_path: Path, name: str = "lineside", opset: int = OPSET, small_inline: int = 1024):
        self.onnx_path = Path(onnx_path)
        self.onnx_path.parent.mkdir(parents=True, exist_ok=True)
        self.data_name = self.onnx_path.name + ".data"
        self._data = open(self.onnx_path.parent / self.data_name, "wb")  # noqa: SIM115 (closed in save)
        self._offset = 0
        self.name = name
        self.opset = opset
        self.small_inline = small_inline
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._ids = itertools.count()
        self._const_cache: dict[tuple[Any, ...], str] = {}
        self.uses_ms_domain = False

    # ---- names -------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._ids)}"

    # ---- graph I/O ---------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: list[int | str | None]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list[int | str | None]) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    # ---- weights -----------------------------------------------------------------------
    def weight(self, name: str, array: np.ndarray) -> str:
        """Add a numpy initializer; large ones are appended to the external-data file now."""
        array = np.asarray(array, order="C")  # (ascontiguousarray would turn a 0-d scalar into shape [1])
        dt = NP_TO_ONNX[array.dtype]
        return self.raw_weight(name, dt, list(array.shape), array.tobytes())

    def raw_weight(self, name: str, elem_type: int, dims: list[int], raw: bytes) -> str:
        """Add an initializer from raw little-endian bytes (used for packed INT4/UINT4)."""
        t = TensorProto()
        t.name = name
        t.data_type = elem_type
        t.dims.extend(dims)
        if len(raw) <= self.small_inline:
            t.raw_data = raw
        else:
            pad = (-self._offset) % _ALIGN
            if pad:
                self._data.write(b"\0" * pad)
                self._offset += pad
            self._data.write(raw)
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.data_name), ("offset", str(self._offset)), ("length", str(len(raw)))):
                e = t.external_data.add()
                e.key, e.value = k, v
            self._offset += len(raw)
        self.initializers.append(t)
        return name

    def detached_weight(self, name: str, array: np.ndarray) -> TensorProto:
        """An initializer written as ``weight`` writes one (large ones into the data file), left out of this graph:
        a variant's own weight (graph/prefill.py)."""
        self.weight(name, array)
        return self.initializers.pop()

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small constant (shape vectors, scalars), de-duplicated."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_cache:
            self._const_cache[key] = self.weight(self.fresh("const"), arr)
        return self._const_cache[key]

    # ---- nodes -------------------------------------------------------------------------
    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
           outputs: list[str] | None = None, **attrs: Any) -> Any:
        """Append a node; returns its output name (or a list when n_out > 1)."""
        node_name = name or self.fresh(op_type)
        outs = outputs or [f"{node_name}_out{i}" for i in range(n_out)]
        if domain == MS_DOMAIN:
            self.uses_ms_domain = True
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=node_name, domain=domain or None, **attrs))
        return outs[0] if len(outs) == 1 else outs

    # ---- save --------------------------------------------------------------------------
    def save(self) -> Path:
        """Write the .onnx (structure) next to the already-written .onnx.data and check it."""
        self._data.close()
        self.write_graph(self.onnx_path, self.nodes, self.inputs, self.initializers)
        if self._offset == 0:
            (self.onnx_path.parent / self.data_name).unlink(missing_ok=True)
        return self.onnx_path

    def write_variant(self, path: Path, *, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
                      extra_initializers: list[onnx.TensorProto]) -> Path:
        """After ``save``: another graph over the same initializers (and so the same external-data file)."""
        self.write_graph(path, nodes, inputs, self.initializers + extra_initializers)
        return path

    def opset_imports(self) -> list[onnx.OperatorSetIdProto]:
        """The opsets its graphs declare (the default domain, plus com.microsoft when a node uses it)."""
        opsets = [helper.make_opsetid("", self.opset)]
        if self.uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        return opsets

    def write_graph(self, path: Path, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
                    initializers: list[onnx.TensorProto], *, name: str | None = None,
                    outputs: list[onnx.ValueInfoProto] | None = None) -> None:
        """Write and check a graph with this builder's opsets: its own, or another over its weight file (a variant,
        a draft cut, the MTP graph; ``name`` and ``outputs`` default to its own)."""
        graph = helper.make_graph(nodes, self.name if name is None else name, inputs,
                                  self.outputs if outputs is None else outputs, initializers)
        model = helper.make_model(graph, opset_imports=self.opset_imports(), producer_name="lineside")
        model.ir_version = 10
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        onnx.checker.check_model(str(path))
