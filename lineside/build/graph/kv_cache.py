"""Quantized KV entries from standard ops (trt flavor, both families): store on write, dequantize on read.

A head vector x (last axis) is stored as grid values kept as uint8, because TensorRT 10.3 takes UINT8 network
I/O through a Cast at the graph's edge but no INT8/FP8 I/O, with fp16 numbers beside it per group of
``fmt.group`` channels (int8: the whole vector):

- symmetric (int8): round(x / s) on the grid ±qmax, stored + offset, s = amax(x) / qmax;
- asymmetric (int4, ``fmt.zero``): round((x − m) / s) on 0..qmax, m = min(x) and s = (max(x) − m) / qmax, both
  fp16 (the scale state holds (s, m) pairs): all 16 levels cover the group's own range, where a symmetric grid
  has 15 over ±amax and spends half of them on a side the group may barely reach.

Requantizing a dequantized vector gives it back unchanged (its extremes sit on the grid), so fixed-shape
states rewritten every step (DeepSeek-V4's window) lose nothing more. Attention reads the new entries as the
grid values times their stored scales — the same floats the cache gives back on the next step — without a
round trip through the packed bytes.

int4 packs two grid values per byte, channel c with channel c + d/2: byte = lo + 16·hi (both in 0..15).
TensorRT 10.3's parser has no BitShift/BitwiseAnd and no integer Floor, so both directions are float32
arithmetic on values below 256 (exact): pack with one MatMul by a 0/1/16 matrix and a Cast to UINT8, unpack
with a Cast from UINT8, hi = Floor(b / 16), lo = b − 16·hi, then Concat — every op is in the FP32 column of the
tables.

Dense models store K and V of a layer through one set of ops (``emit_kv_pair``: the two concatenated along the
head axis) and join the new entries' bytes to the past's before dequantizing. What onnxruntime's CPU pays for a
short-context step is mostly the passes over the dequantized past, not the node count (a small node costs
~0.5-1 us there, a pass over SmolLM2's 6 x 128 x 64 floats ~7 us), so the past is read for K and V apart (no
Concat and Split of the whole dequantized past per layer), K transposed from its bytes (``_dequantize_kt``: its
scales then broadcast along T) and V's group scales spread to every channel by a MatMul (``_dequantize``).
int4 (with its sink entries) reads K by V's ops instead and leaves it untransposed: attention's Transpose next to
q·kᵀ's MatMul is folded into it (FusedMatMul), so no pass transposes K, its bytes or its scales.
``python benchmarks/kv_dtype_cpu.py --short-side-by-side --profile`` prints the per-op table.
"""

from __future__ import annotations

from typing import Any

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


def _f(g: GraphBuilder, v: float) -> str:
    return g.const(v, np.float32)


def _quantize(g: GraphBuilder, x: str, fmt: KvFormat, *, rank: int, head_dim: int,
              dequantize: bool = True) -> tuple[str, str, str | None]:
    """x [..., d] float32 -> (stored bytes as float32 [..., d/pack], fp16 scale state [..., scale_state_dim],
    float32 dequantized [..., d] or None)."""
    grouped = fmt.scale_dim(head_dim) > 1
    xg = _grouped(g, x, fmt, rank, head_dim)
    if fmt.zero:
        lo16 = g.op("Cast", [g.op("ReduceMin", [xg, g.const([-1])], keepdims=1)], to=TensorProto.FLOAT16)
        lo = g.op("Cast", [lo16], to=F32)
        hi = g.op("ReduceMax", [xg, g.const([-1])], keepdims=1)
        s16 = g.op("Cast", [g.op("Max", [g.op("Div", [g.op("Sub", [hi, lo]), _f(g, fmt.qmax)]), _f(g, MIN_SCALE)])],
                   to=TensorProto.FLOAT16)
        s = g.op("Cast", [s16], to=F32)
        grid = g.op("Clip", [g.op("Round", [g.op("Div", [g.op("Sub", [xg, lo]), s])]), _f(g, 0.0), _f(g, fmt.qmax)])
        deq = g.op("Add", [g.op("Mul", [grid, s]), lo]) if dequantize else None
        sc = g.op("Concat", [s16, lo16], axis=-1)  # [..., n, 2]: (scale, minimum) per group
        if grouped:
            sc = g.op("Reshape", [sc, g.const([0] * (rank - 1) + [fmt.scale_state_dim(head_dim)])])
    else:
        amax = g.op("ReduceMax", [g.op("Abs", [xg]), g.const([-1])], keepdims=1)
        s16 = g.op("Cast", [g.op("Max", [g.op("Div", [amax, _f(g, fmt.qmax)]), _f(g, MIN_SCALE)])],
                   to=TensorProto.FLOAT16)
        s = g.op("Cast", [s16], to=F32)
        grid = g.op("Clip", [g.op("Round", [g.op("Div", [xg, s])]), _f(g, -fmt.qmax), _f(g, fmt.qmax)])
        deq = g.op("Mul", [grid, s]) if dequantize else None
        sc = g.op("Squeeze", [s16, g.const([-1])]) if grouped else s16
    stored = _ungrouped(g, g.op("Add", [grid, _f(g, fmt.offset)]) if fmt.offset else grid, fmt, rank, head_dim)
    if fmt.pack == 2:  # lo + 16·hi by one MatMul (``_packing``) instead of a Split, a Mul and an Add
        stored = g.op("MatMul", [stored, g.const(_packing(head_dim), np.float32)])
    return stored, sc, None if deq is None else _ungrouped(g, deq, fmt, rank, head_dim)


def _packing(head_dim: int) -> np.ndarray:
    """0/1/16 matrix [d, d/2] taking a head vector's grid values (0..15) to its int4 bytes: byte c = q[c] + 16·q[c + d/2].
    ``grid @ it`` is exact: two products of small integers by 1 and 16 per byte, the rest by 0 (all below 256)."""
    half = head_dim // 2
    m = np.zeros((head_dim, half), np.float32)
    m[np.arange(half), np.arange(half)] = 1.0
    m[half + np.arange(half), np.arange(half)] = 16.0
    return m


def _spread(fmt: KvFormat, head_dim: int, which: int) -> np.ndarray:
    """0/1 matrix [scale_state_dim, d] taking a head vector's scale state to one number per channel: the scale
    (``which`` 0) or the minimum (1) of the channel's group. ``state @ it`` is exact: one product by 1 per channel,
    the rest by 0 — unless a scale is inf or NaN, when the whole vector is (a group's is in any case)."""
    n, per = fmt.scale_dim(head_dim), fmt.per_group
    m = np.zeros((n * per, head_dim), np.float32)
    m[per * (np.arange(head_dim) // (head_dim // n)) + which, np.arange(head_dim)] = 1.0
    return m


def _unpacked(g: GraphBuilder, b: str, fmt: KvFormat, *, axis: int) -> str:
    """Stored bytes as float grid values: int4's two nibbles per byte split along ``axis`` (low ones first), the
    format's offset taken off."""
    if fmt.pack == 2:
        hi = g.op("Floor", [g.op("Mul", [b, _f(g, 1.0 / 16.0)])])  # b/16 exact: a power of two
        lo = g.op("Sub", [b, g.op("Mul", [hi, _f(g, 16.0)])])
        b = g.op("Concat", [lo, hi], axis=axis)
    return g.op("Sub", [b, _f(g, fmt.offset)]) if fmt.offset else b


def _dequantize(g: GraphBuilder, b: str, scales: str, fmt: KvFormat, *, rank: int, head_dim: int) -> str:
    """stored bytes b (float32 [..., d/pack]) and their fp16 scale state -> float32 entries [..., d].

    Grouped scales are spread to every channel by a MatMul with a 0/1 matrix (``_spread``) before one same-shape
    Mul (and Add): onnxruntime's CPU Mul/Add broadcasting a scale over its 16 channels run one short span per group
    (SmolLM2, 6 heads x 124 entries: 78 us against 37 us for the MatMuls, Mul and Add, the same floats)."""
    b = _unpacked(g, b, fmt, axis=-1)
    sc = g.op("Cast", [scales], to=F32)
    if fmt.scale_dim(head_dim) > 1:  # one number per channel from the group's: [..., d]
        s = g.op("MatMul", [sc, g.const(_spread(fmt, head_dim, 0), np.float32)])
        out = g.op("Mul", [b, s])
        return g.op("Add", [out, g.op("MatMul", [sc, g.const(_spread(fmt, head_dim, 1), np.float32)])]) \
            if fmt.zero else out
    if fmt.zero:
        s, lo = g.op("Split", [sc, g.const([1, 1])], n_out=2, axis=-1)
        return g.op("Add", [g.op("Mul", [b, s]), lo])
    return g.op("Mul", [b, sc])


def emit_kv_store(g: GraphBuilder, x: str, fmt: KvFormat, values: str, scales: str, *, rank: int,
                  head_dim: int) -> str:
    """Write x's grid values to ``values`` (uint8; int4: packed) and its scales to ``scales`` (fp16); returns the
    float32 values attention should read (the stored ones, dequantized). ``rank``: x's rank, head_dim last."""
    stored, sc, deq = _quantize(g, x, fmt, rank=rank, head_dim=head_dim)
    g.op("Cast", [stored], outputs=[values], to=TensorProto.UINT8)
    g.op("Identity", [sc], outputs=[scales])
    assert deq is not None
    return deq


def emit_kv_load(g: GraphBuilder, values: str, scales: str, fmt: KvFormat, *, rank: int, head_dim: int) -> str:
    """float32 entries from stored uint8 values (int4: unpacked) and their fp16 scales."""
    return _dequantize(g, g.op("Cast", [values], to=F32), scales, fmt, rank=rank, head_dim=head_dim)


def _dequantize_kt(g: GraphBuilder, b: str, scales: str, fmt: KvFormat, *, head_dim: int) -> str:
    """Stored bytes b (float32 [B, H, T, d/pack]) and their fp16 scale state [B, H, T, scale_state_dim] -> the
    dequantized entries transposed, [B, H, d, T] (K as q·kᵀ reads it): the same floats as ``_dequantize`` then a
    Transpose, but the bytes are transposed instead (int4: half the size of the values), and with T last a scale
    broadcasts along T (one span per channel row, not one per token and group)."""
    bt = _unpacked(g, g.op("Transpose", [b], perm=[0, 1, 3, 2]), fmt, axis=2)  # [B, H, d/pack, T] -> [B, H, d, T]
    n = fmt.scale_dim(head_dim)
    sc = g.op("Cast", [scales], to=F32)
    if n == 1 and not fmt.zero:  # one scale per vector: a [T, 1] column is a [1, T] row by a Reshape
        return g.op("Mul", [bt, g.op("Reshape", [sc, g.const([0, 0, 1, -1])])])
    sc = g.op("Transpose", [sc], perm=[0, 1, 3, 2])  # [B, H, scale_state_dim, T]
    bt = g.op("Reshape", [bt, g.const([0, 0, n, head_dim // n, -1])])  # [B, H, n, group, T]
    if fmt.zero:  # (scale, minimum) pairs
        s, lo_ = g.op("Split", [g.op("Reshape", [sc, g.const([0, 0, n, 2, -1])]), g.const([1, 1])], n_out=2, axis=3)
        out = g.op("Add", [g.op("Mul", [bt, s]), lo_])
    else:
        out = g.op("Mul", [bt, g.op("Unsqueeze", [sc, g.const([3])])])
    return g.op("Reshape", [out, g.const([0, 0, head_dim, -1])])


def emit_kv_pair(g: GraphBuilder, kv: str, fmt: KvFormat, *, past: tuple[str, str], past_scales: tuple[str, str],
                 present: tuple[str, str], present_scales: tuple[str, str], heads: int, head_dim: int,
                 sink: bool = False) -> tuple[Any, str]:
    """K and V of a layer: store the new entries ``kv`` [B, 2·heads, S, d] (K's heads, then V's) to ``present`` /
    ``present_scales`` (K's, V's) through one set of ops, and return past and new entries dequantized, K
    transposed, [B, heads, d, T], and V, [B, heads, T, d]: the new ones' stored bytes and scales join the past's
    before the dequantization, so attention reads the same floats for them now as the cache gives back on later
    steps.

    The past is read for K and V apart, K's bytes transposed before it is dequantized (``_dequantize_kt``): on
    onnxruntime's CPU, reading both through one set of ops cost a Concat and a Split of the whole dequantized past
    per layer, and the scales broadcast over 64 (int8) or 16 (int4) channels of each token.

    ``sink`` (int4's fp16 sink entries): returns ((K's and V's whole past dequantized, [B, heads, P, d] each: K by
    V's ops and not transposed, since attention transposes it where onnxruntime folds that into q·kᵀ's MatMul),
    and the new entries [B, 2·heads, S, d] as their grid values times their scales — the
    same floats, without a round trip through the packed bytes), so the caller puts the sink entries in front with
    one float Concat each; attention masks the cache's own copies of the sink positions."""
    stored, sc, deq = _quantize(g, kv, fmt, rank=4, head_dim=head_dim, dequantize=sink)
    halves = g.const([heads, heads])
    new = g.op("Split", [stored, halves], n_out=2, axis=1)
    for f, out in zip(new, present, strict=True):  # TensorRT 10.3 splits no UINT8: split the floats, then cast
        g.op("Cast", [f], outputs=[out], to=TensorProto.UINT8)
    g.op("Split", [sc, halves], outputs=list(present_scales), axis=1)
    if sink:
        kb, vb = (g.op("Cast", [p], to=F32) for p in past)
        assert deq is not None  # the new entries as grid x scale + minimum: the floats their bytes give back
        return (_dequantize(g, kb, past_scales[0], fmt, rank=4, head_dim=head_dim),
                _dequantize(g, vb, past_scales[1], fmt, rank=4, head_dim=head_dim)), deq
    (kb, vb), (ks, vs) = ([g.op("Concat", [p, n], axis=2) for p, n in zip(ps, ns, strict=True)] for ps, ns in
                          (([g.op("Cast", [p], to=F32) for p in past], new), (past_scales, present_scales)))
    return _dequantize_kt(g, kb, ks, fmt, head_dim=head_dim), _dequantize(g, vb, vs, fmt, rank=4, head_dim=head_dim)


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
