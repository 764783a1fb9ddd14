"""Quantized KV entries from standard ops (trt flavor, both families): store on write, dequantize on read.

A head vector x (last axis) is stored as round(x / s) on the symmetric grid ±qmax, kept as uint8 (+offset)
because TensorRT 10.3 takes UINT8 network I/O through a Cast at the graph's edge but no INT8/FP8 I/O;
s = amax(x) / qmax per vector, stored in fp16 beside it. Requantizing a dequantized vector gives it back
unchanged (its amax is qmax·s), so fixed-shape states rewritten every step lose nothing more.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder
from lineside.build.quant.kv import KvFormat

F32 = TensorProto.FLOAT
MIN_SCALE = 2.0 ** -20  # an all-zero vector still gets a finite fp16 (subnormal) scale


def emit_kv_store(g: GraphBuilder, x: str, fmt: KvFormat, values: str, scales: str) -> str:
    """Write x's grid values to ``values`` (uint8) and its scales to ``scales`` (fp16); returns the float32
    values attention should read (the stored ones, dequantized)."""
    amax = g.op("ReduceMax", [g.op("Abs", [x]), g.const([-1])], keepdims=1)
    s = g.op("Max", [g.op("Div", [amax, g.const(fmt.qmax, np.float32)]), g.const(MIN_SCALE, np.float32)])
    g.op("Cast", [s], outputs=[scales], to=TensorProto.FLOAT16)
    s32 = g.op("Cast", [scales], to=F32)
    grid = g.op("Clip", [g.op("Round", [g.op("Div", [x, s32])]), g.const(-fmt.qmax, np.float32),
                         g.const(fmt.qmax, np.float32)])
    g.op("Cast", [g.op("Add", [grid, g.const(fmt.offset, np.float32)])], outputs=[values], to=TensorProto.UINT8)
    return emit_kv_load(g, values, scales, fmt)


def emit_kv_load(g: GraphBuilder, values: str, scales: str, fmt: KvFormat) -> str:
    """float32 entries from stored uint8 values and their fp16 scales."""
    centred = g.op("Sub", [g.op("Cast", [values], to=F32), g.const(fmt.offset, np.float32)])
    return g.op("Mul", [centred, g.op("Cast", [scales], to=F32)])


def scale_name(name: str) -> str:
    """``past_key.3`` → ``past_key_scale.3``; ``past.3.window`` → ``past_scale.3.window``."""
    head, _, tail = name.partition(".")
    return f"{head}_scale.{tail}"


def hadamard(n: int) -> np.ndarray | None:
    """Orthonormal Hadamard matrix of size n (Sylvester; n a power of two), else None.

    Rotating head vectors by it before rounding spreads a few outlier channels over all of them, so the
    per-vector amax (hence the grid step) shrinks; q·k is unchanged when q is rotated too."""
    if n < 2 or n & (n - 1):
        return None
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)
