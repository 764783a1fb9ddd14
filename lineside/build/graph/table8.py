"""8-bit weight tables in MatMulNBits layout (cpu flavor), shared by a tied embedding and its LM head.

A tied model's embedding and LM head are one matrix: stored once as MatMulNBits' 8-bit ``B``
(uint8 ``[N, K/block, block]``, codes + 128) plus float32 ``scales [N, K/block]``, the head reads it
with MatMulNBits and the embedding with Gather. GGUF Q8_0 tables keep their grid exactly (block 32);
float weights use the w8a16 grid (symmetric per-output-channel int8, the scale repeated per block).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import numpy as np

from lineside.build.graph.builder import GraphBuilder
from lineside.build.quant.ggml import BLOCK, decode_blocks
from lineside.build.quant.grid import Int4Grid, concat_grids
from lineside.build.quant.pack import pack_matmulnbits
from lineside.build.quant.rtn import quantize_rtn
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.errors import LinesideError


@dataclass(frozen=True)
class Table8:
    """Initializer names of a MatMulNBits 8-bit weight and its shape."""

    qweight: str
    scales: str
    block: int
    n: int
    k: int


_TABLES: weakref.WeakKeyDictionary[GraphBuilder, dict[tuple, Table8]] = weakref.WeakKeyDictionary()


def weight_shape(weight: np.ndarray | GGMLBlocks | Int4Grid, name: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of a float array, GGMLBlocks or Int4Grid (LinesideError if not 2-D)."""
    shape = tuple(int(v) for v in (weight.shape if isinstance(weight, (GGMLBlocks, Int4Grid)) else np.shape(weight)))
    if len(shape) != 2 or min(shape) <= 0:
        raise LinesideError(f"weight {name} has shape {shape}; a linear weight must be [out_features, in_features]")
    return shape  # type: ignore[return-value]


def float_weight(weight: np.ndarray | GGMLBlocks | Int4Grid) -> np.ndarray:
    """float32 ``[out, in]`` of any source (GGUF blocks dequantized the llama.cpp way, grids exactly)."""
    if isinstance(weight, (GGMLBlocks, Int4Grid)):
        return weight.dequantize()
    return np.asarray(weight, dtype=np.float32)


def concat_out_features(weights: list[np.ndarray | GGMLBlocks | Int4Grid],
                        name: str = "weights") -> np.ndarray | GGMLBlocks | Int4Grid:
    """Stack linears that read the same x (q/k/v, gate/up) into one ``[sum(out), in]`` weight.

    GGUF blocks of one type stay blocks (rows are whole blocks, so it is a byte concat and the carry is
    unchanged), INT4 grids stay grids; anything else becomes float32. One fused layer + Split saves nodes
    per decode step.
    """
    if not weights:
        raise LinesideError(f"{name}: nothing to concatenate")
    shapes = [weight_shape(w, name) for w in weights]
    if len({k for _, k in shapes}) != 1:
        raise LinesideError(f"{name}: in_features differ ({[k for _, k in shapes]}); only layers sharing an input fuse")
    grids = [w for w in weights if isinstance(w, Int4Grid)]
    if grids:
        if len(grids) != len(weights):
            raise LinesideError(f"{name}: some of its layers are quantized grids and some are not; rebuild")
        return concat_grids(grids, name)
    types = {w.ggml_type if isinstance(w, GGMLBlocks) else None for w in weights}
    if len(types) == 1 and None not in types:
        data = np.concatenate([np.asarray(w.data).reshape(w.shape[0], -1) for w in weights], axis=0)  # type: ignore[union-attr]
        return GGMLBlocks(types.pop(), (sum(n for n, _ in shapes), shapes[0][1]), data)
    return np.concatenate([float_weight(w) for w in weights], axis=0)


def w8_block(in_features: int, spec: QuantSpec) -> int | None:
    """MatMulNBits block for a per-channel 8-bit weight (it also sets accuracy-level-4 activation groups)."""
    return next((g for g in (spec.group_size, 128, 64, 32, 16) if in_features % g == 0), None)


def _offset128(codes: np.ndarray) -> np.ndarray:
    """int8 codes -> uint8 codes + 128 without an int16 temporary (flipping the sign bit adds 128 mod 256)."""
    return np.bitwise_xor(np.ascontiguousarray(codes, dtype=np.int8).view(np.uint8), np.uint8(0x80))


def w8_grid(weight: np.ndarray | GGMLBlocks, spec: QuantSpec, name: str) -> tuple[np.ndarray, np.ndarray, int] | None:
    """``(u uint8 [N, K] = codes + 128, scales float32 [N, K/block], block)``, or None if no block fits."""
    if isinstance(weight, GGMLBlocks):
        if weight.ggml_type != "Q8_0":
            return None
        dec = decode_blocks(weight, name)
        return _offset128(dec.codes), dec.d, BLOCK
    n, k = weight_shape(weight, name)
    block = w8_block(k, spec)
    if block is None:
        return None
    codes, scales = quantize_rtn(float_weight(weight), 8, None)
    return _offset128(codes), np.repeat(scales, k // block, axis=1), block


def grid_to_float(u: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """float32 ``[N, K]`` of an 8-bit grid (exactly the values MatMulNBits would use)."""
    n, k = u.shape
    return ((u.reshape(n, k // block, block).astype(np.float32) - 128) * scales[..., None]).reshape(n, k)


def _content_key(weight: np.ndarray | GGMLBlocks, spec: QuantSpec, shape: tuple[int, int]) -> tuple:
    if isinstance(weight, GGMLBlocks):
        data, kind = np.ascontiguousarray(weight.data), weight.ggml_type
    else:
        data, kind = np.ascontiguousarray(weight, dtype=np.float32), f"f32/{w8_block(shape[1], spec)}"
    return (kind, shape, hashlib.blake2b(data.reshape(-1).view(np.uint8), digest_size=16).hexdigest())


def int8_table(gb: GraphBuilder, name: str, weight: np.ndarray | GGMLBlocks, spec: QuantSpec,
               share: bool = False) -> Table8 | None:
    """The 8-bit table of ``weight`` in ``gb``, written once; None if the weight has no 8-bit grid here.

    ``share=True`` (embeddings, LM heads) registers it by content; other callers look it up only when a
    registered table has their shape, so ordinary layers are never hashed.
    """
    shape = weight_shape(weight, name)
    reg = _TABLES.setdefault(gb, {})
    key = None
    if share or any(k[1] == shape for k in reg):
        key = _content_key(weight, spec, shape)
        if key in reg:
            return reg[key]
    grid = w8_grid(weight, spec, name)
    if grid is None:
        return None
    u, scales, block = grid
    table = Table8(gb.weight(f"{name}.qweight", pack_matmulnbits(u, 8, block)),
                   gb.weight(f"{name}.scales", np.ascontiguousarray(scales, dtype=np.float32)), block, *shape)
    if key is not None:
        reg[key] = table
    return table
