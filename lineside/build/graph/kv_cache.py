"""Quantized KV entries from standard ops (trt flavor, both families): store on write, dequantize on read.

A head vector x (last axis) is stored as round(x / s) on the symmetric grid ±qmax, kept as uint8 (+offset)
because TensorRT 10.3 takes UINT8 network I/O through a Cast at the graph's edge but no INT8/FP8 I/O;
s = amax(x) / qmax per vector (int4: per group of ``fmt.group`` channels), stored in fp16 beside it.
Requantizing a dequantized vector gives it back unchanged (its amax is qmax·s), so fixed-shape states
rewritten every step lose nothing more.

int4 packs two grid values per byte, channel c with channel c + d/2: byte = lo + 16·hi (both + 8, in 1..15).
TensorRT 10.3's parser has no BitShift/BitwiseAnd and no integer Floor, so both directions are float32
arithmetic on values below 256 (exact): pack with Mul/Add and a Cast to UINT8, unpack with a Cast from
UINT8, hi = Floor(b / 16), lo = b − 16·hi, then Concat — every op is in the FP32 column of the tables.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder
from lineside.build.quant.kv import KvFormat

F32 = TensorProto.FLOAT
MIN_SCALE = 2.0 ** -20  # an all-zero vector still gets a finite fp16 (subnormal) scale


def _grouped(g: GraphBuilder, x: str, fmt: KvFormat, rank: int, head_dim: int) -> str:
    """x [..., d] -> [..., d/group, group] (unchanged when one scale covers the vector)."""
    n = fmt.scale_dim(head_dim)
    if n == 1:
        return x
    return g.op("Reshape", [x, g.const([0] * (rank - 1) + [n, head_dim // n])])


def _ungrouped(g: GraphBuilder, x: str, fmt: KvFormat, rank: int, head_dim: int) -> str:
    if fmt.scale_dim(head_dim) == 1:
        return x
    return g.op("Reshape", [x, g.const([0] * (rank - 1) + [head_dim])])


def _scale_view(g: GraphBuilder, s: str, fmt: KvFormat, rank: int, head_dim: int) -> str:
    """scales [..., n] -> [..., n, 1], broadcasting over their group's channels."""
    return s if fmt.scale_dim(head_dim) == 1 else g.op("Unsqueeze", [s, g.const([rank])])


def emit_kv_store(g: GraphBuilder, x: str, fmt: KvFormat, values: str, scales: str, *, rank: int,
                  head_dim: int) -> str:
    """Write x's grid values to ``values`` (uint8; int4: packed) and its scales to ``scales`` (fp16); returns the
    float32 values attention should read (the stored ones, dequantized). ``rank``: x's rank, head_dim last."""
    xg = _grouped(g, x, fmt, rank, head_dim)
    amax = g.op("ReduceMax", [g.op("Abs", [xg]), g.const([-1])], keepdims=1)
    s = g.op("Max", [g.op("Div", [amax, g.const(fmt.qmax, np.float32)]), g.const(MIN_SCALE, np.float32)])
    if fmt.scale_dim(head_dim) == 1:
        s16 = g.op("Cast", [s], outputs=[scales], to=TensorProto.FLOAT16)
    else:
        s16 = g.op("Cast", [s], to=TensorProto.FLOAT16)
        g.op("Squeeze", [s16, g.const([-1])], outputs=[scales])
    s32 = g.op("Cast", [s16], to=F32)
    grid = g.op("Clip", [g.op("Round", [g.op("Div", [xg, s32])]), g.const(-fmt.qmax, np.float32),
                         g.const(fmt.qmax, np.float32)])
    stored = _ungrouped(g, g.op("Add", [grid, g.const(fmt.offset, np.float32)]), fmt, rank, head_dim)
    if fmt.pack == 2:
        half = fmt.stored_dim(head_dim)
        lo, hi = g.op("Split", [stored, g.const([half, half])], n_out=2, axis=-1)
        stored = g.op("Add", [lo, g.op("Mul", [hi, g.const(16.0, np.float32)])])
    g.op("Cast", [stored], outputs=[values], to=TensorProto.UINT8)
    return emit_kv_load(g, values, scales, fmt, rank=rank, head_dim=head_dim)


def emit_kv_load(g: GraphBuilder, values: str, scales: str, fmt: KvFormat, *, rank: int, head_dim: int) -> str:
    """float32 entries from stored uint8 values (int4: unpacked) and their fp16 scales."""
    b = g.op("Cast", [values], to=F32)
    if fmt.pack == 2:
        hi = g.op("Floor", [g.op("Mul", [b, g.const(1.0 / 16.0, np.float32)])])  # b/16 exact: a power of two
        lo = g.op("Sub", [b, g.op("Mul", [hi, g.const(16.0, np.float32)])])
        b = g.op("Concat", [lo, hi], axis=-1)
    centred = _grouped(g, g.op("Sub", [b, g.const(fmt.offset, np.float32)]), fmt, rank, head_dim)
    s32 = _scale_view(g, g.op("Cast", [scales], to=F32), fmt, rank, head_dim)
    return _ungrouped(g, g.op("Mul", [centred, s32]), fmt, rank, head_dim)


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
