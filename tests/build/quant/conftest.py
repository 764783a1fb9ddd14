"""Helpers: build a one-layer graph with GraphBuilder and run it on onnxruntime CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder


def run_graph(path: Path, feeds: dict[str, np.ndarray], qdq_accuracy: int = 0) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    # onnxruntime fuses DequantizeLinear->MatMul into MatMulNBits at accuracy level 4 unless told otherwise.
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(qdq_accuracy))
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(["y"], feeds)[0]


def build_one(tmp_path: Path, emit, in_features: int | None, out_dims: list, in_type=TensorProto.FLOAT,
              in_shape: list | None = None, name: str = "m") -> Path:
    """``emit(gb, x) -> tensor``; the graph's input is ``x`` and its output ``y``."""
    gb = GraphBuilder(tmp_path / f"{name}.onnx")
    shape = in_shape if in_shape is not None else ["b", "t", in_features]
    x = gb.input("x", in_type, shape)
    y = emit(gb, x)
    gb.op("Identity", [y], outputs=["y"], name="out")
    gb.output("y", TensorProto.FLOAT, out_dims)
    return gb.save()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
