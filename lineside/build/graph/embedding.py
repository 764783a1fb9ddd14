"""Emit a token-embedding lookup that keeps quantized tables quantized and dequantizes only gathered rows.

fp32: Gather on a float32 table; fp16: Gather on float16 then Cast. w8a16/w4a16 keep 8-bit codes even
for w4a16 (Gather can't address nibbles with standard ops, and the embedding is worth the precision);
rows are dequantized with Gather, Cast, (Sub,) Mul (Add for Q4_1's offsets):
- cpu flavor, float or GGUF Q8_0 source: the MatMulNBits 8-bit table (table8.py), shared with an 8-bit
  LM head of the same weight (emit_lm_head), so tied embeddings are stored once;
- other cpu cases: int8 codes + per-block float32 scales; GGUF Q4_0/Q4_1 tables exactly (same arithmetic
  as gguf's dequantize);
- trt flavor: a float16 table (TensorRT 10.3's Gather and Cast take no INT8, its Gather no UINT8).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder
from lineside.build.graph.table8 import Table8, float_weight, grid_to_float, int8_table, w8_grid, weight_shape
from lineside.build.quant.ggml import BLOCK, CARRIED, decode_blocks
from lineside.build.quant.rtn import fake_quantize, quantize_rtn
from lineside.build.quant.spec import FLAVORS, QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.errors import LinesideError


def embedding_block(hidden: int, spec: QuantSpec) -> int | None:
    """Block of the int8 embedding table: the spec's group size if it divides hidden, else a smaller power of two."""
    for g in (spec.group_size, 128, 64, 32, 16):
        if hidden % g == 0:
            return g
    return None  # one scale per row


def _rows(gb: GraphBuilder, ids: str, name: str, codes: np.ndarray, scales: np.ndarray, block: int | None,
          offsets: np.ndarray | None) -> str:
    v, h = codes.shape
    c = gb.op("Gather", [gb.weight(f"{name}.qweight", codes), ids], axis=0, name=f"{name}/gather_codes")
    c = gb.op("Cast", [c], to=TensorProto.FLOAT, name=f"{name}/cast")
    lead = gb.op("Shape", [ids], name=f"{name}/ids_shape")
    if block is not None:
        c = gb.op("Reshape", [c, gb.op("Concat", [lead, gb.const([h // block, block])], axis=0,
                                       name=f"{name}/block_dims")], name=f"{name}/to_blocks")
    sc = gb.op("Gather", [gb.weight(f"{name}.scales", scales), ids], axis=0, name=f"{name}/gather_scales")
    if block is not None:  # [..., H/block] -> [..., H/block, 1]; per-row scales [..., 1] broadcast as they are
        sc = gb.op("Unsqueeze", [sc, gb.const([-1])], name=f"{name}/scales_1")
    y = gb.op("Mul", [c, sc], name=f"{name}/scale")
    if offsets is not None:
        off = gb.op("Gather", [gb.weight(f"{name}.offsets", offsets), ids], axis=0, name=f"{name}/gather_offsets")
        y = gb.op("Add", [y, gb.op("Unsqueeze", [off, gb.const([-1])], name=f"{name}/offsets_1")],
                  name=f"{name}/offset")
    if block is not None:
        y = gb.op("Reshape", [y, gb.op("Concat", [lead, gb.const([h])], axis=0, name=f"{name}/row_dims")],
                  name=f"{name}/to_rows")
    return y


def _rows_table8(gb: GraphBuilder, ids: str, name: str, t: Table8) -> str:
    """Rows of a MatMulNBits 8-bit table (uint8 codes + 128, [V, H/block, block]) shared with the LM head."""
    c = gb.op("Gather", [t.qweight, ids], axis=0, name=f"{name}/gather_codes")  # [..., H/block, block]
    c = gb.op("Sub", [gb.op("Cast", [c], to=TensorProto.FLOAT, name=f"{name}/cast"), gb.const(128.0, np.float32)],
              name=f"{name}/center")
    sc = gb.op("Gather", [t.scales, ids], axis=0, name=f"{name}/gather_scales")
    y = gb.op("Mul", [c, gb.op("Unsqueeze", [sc, gb.const([-1])], name=f"{name}/scales_1")], name=f"{name}/scale")
    lead = gb.op("Shape", [ids], name=f"{name}/ids_shape")
    return gb.op("Reshape", [y, gb.op("Concat", [lead, gb.const([t.k])], axis=0, name=f"{name}/row_dims")],
                 name=f"{name}/to_rows")


def emit_embedding(gb: GraphBuilder, ids: str, weight: np.ndarray | GGMLBlocks, spec: QuantSpec, flavor: str,
                   name: str = "embed_tokens") -> str:
    """``ids`` (int64, any shape) → float32 ``[*ids.shape, hidden]`` rows of ``weight [vocab, hidden]``."""
    spec.check()
    if flavor not in FLAVORS:
        raise LinesideError(f"unknown graph flavor {flavor!r} for {name}; use one of {', '.join(FLAVORS)}")
    v, h = weight_shape(weight, name)
    if flavor == "cpu" and spec.quantized:
        if not isinstance(weight, GGMLBlocks) or weight.ggml_type == "Q8_0":
            table = int8_table(gb, name, weight, spec, share=True)
            if table is not None:
                return _rows_table8(gb, ids, name, table)
        if isinstance(weight, GGMLBlocks) and weight.ggml_type in CARRIED:
            dec = decode_blocks(weight, name)
            codes = dec.codes.astype(np.int8)
            if dec.ggml_type == "Q4_0":
                codes -= 8
            return _rows(gb, ids, name, codes, dec.d, BLOCK, dec.m)
        block = embedding_block(h, spec)
        codes, scales = quantize_rtn(float_weight(weight), 8, block)
        return _rows(gb, ids, name, codes, scales, block, None)
    w = float_weight(weight)
    if spec.scheme == "fp32":
        return gb.op("Gather", [gb.weight(f"{name}.weight", w), ids], axis=0, name=f"{name}/Gather")
    # fp16, and the trt flavor's quantized schemes: TensorRT 10.3 Gathers no INT8/UINT8 (engine/check.py)
    g = gb.op("Gather", [gb.weight(f"{name}.weight", w.astype(np.float16)), ids], axis=0, name=f"{name}/Gather")
    return gb.op("Cast", [g], to=TensorProto.FLOAT, name=f"{name}/cast")


def embedding_reference(weight: np.ndarray | GGMLBlocks, spec: QuantSpec, flavor: str) -> np.ndarray:
    """float32 ``[vocab, hidden]``: exactly the rows ``emit_embedding`` produces (for numerics references)."""
    if flavor == "cpu" and spec.quantized:
        if not isinstance(weight, GGMLBlocks) or weight.ggml_type == "Q8_0":
            grid = w8_grid(weight, spec, "embedding")
            if grid is not None:
                return grid_to_float(*grid)
        if isinstance(weight, GGMLBlocks) and weight.ggml_type in CARRIED:
            return weight.dequantize()
        w = float_weight(weight)
        return fake_quantize(w, 8, embedding_block(w.shape[1], spec))
    w = float_weight(weight)
    return w if spec.scheme == "fp32" else w.astype(np.float16).astype(np.float32)
