"""Emit one linear layer ``y = x @ W^T + b`` into an ONNX graph, quantized per a QuantSpec and flavor.

cpu flavor: com.microsoft ``MatMulNBits`` (4 or 8 bits, symmetric: codes + 2^(bits-1), the default
zero point; 8-bit layers below accuracy level 4 become float32 weights on the same grid, see
_emit_8bit_cpu). trt flavor: opset-21 ``DequantizeLinear`` of an INT4 ``[K, N]`` weight (axis 0,
``block_size`` 64/128, no zero point) or an INT8 per-channel weight (axis 1), then ``MatMul``.
With ``spec.trt_dtype == "fp16"`` (default) the trt scales are float16, so the dequantized weight and
the MatMul are fp16 (what TensorRT's W4A16 kernels run, and what a strongly typed network honours);
x is cast to fp16 before and y back to float32 after. Float schemes keep float32 activations.
GGUF Q4_0/Q4_1/Q8_0 weights are carried onto MatMulNBits exactly (cpu flavor, quantized schemes; Q4_1 at
accuracy level 4 to within d/32 of its offsets, quant/q4_1.py), and so are ``Int4Grid`` weights (codes + scales a calibrated quantizer such as GPTQ already chose).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import numpy as np
from onnx import TensorProto

from lineside.build.graph import prefill
from lineside.build.graph.builder import MS_DOMAIN, GraphBuilder
from lineside.build.graph.table8 import (
    concat_out_features,
    float_weight,
    grid_to_float,
    int8_table,
    w8_grid,
    weight_shape,
)
from lineside.build.quant import q4_1
from lineside.build.quant.ggml import BLOCK, CARRIED, decode_blocks
from lineside.build.quant.grid import Int4Grid
from lineside.build.quant.pack import pack_int4_kn, pack_matmulnbits
from lineside.build.quant.rtn import quantize_rtn
from lineside.build.quant.spec import FLAVORS, QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.errors import LinesideError

__all__ = ["concat_out_features", "emit_linear", "emit_lm_head", "float_weight", "weight_shape"]

# Per-builder cache of tensors derived from an activation (fp16 casts, GGUF Q4_1 block sums), so
# q/k/v or gate/up reading the same x share one node.
_DERIVED: weakref.WeakKeyDictionary[GraphBuilder, dict[tuple, str]] = weakref.WeakKeyDictionary()


def _derived(gb: GraphBuilder) -> dict[tuple, str]:
    return _DERIVED.setdefault(gb, {})


def cast_fp16(gb: GraphBuilder, x: str) -> str:
    key = ("fp16", x)
    cache = _derived(gb)
    if key not in cache:
        cache[key] = gb.op("Cast", [x], to=TensorProto.FLOAT16, name=gb.fresh("cast_fp16"))
    return cache[key]


def blocksum(gb: GraphBuilder, x: str, in_features: int, block: int, width: int | None = None) -> str:
    """``x [..., K]`` → ``[..., K/block]``, the sum of each block of inputs (any rank of x); with ``width``,
    zero-padded to that many columns.

    One MatMul with a constant 0/1 ``[K, width]`` matrix: a single node (a Reshape + ReduceSum needs
    Shape/Concat for an unknown rank, 4 nodes, ~3 µs each at decode), shared by every layer reading x.
    """
    width = width or in_features // block
    cache = _derived(gb)
    key = ("blocksum", x, block, width)
    if key not in cache:
        ones_key = ("blocksum_ones", in_features, block, width)
        if ones_key not in cache:
            ones = np.zeros((in_features, width), dtype=np.float32)
            ones[np.arange(in_features), np.arange(in_features) // block] = 1.0
            cache[ones_key] = gb.weight(gb.fresh(f"blocksum_ones_{in_features}x{width}"), ones)
        cache[key] = gb.op("MatMul", [x, cache[ones_key]], name=gb.fresh("blocksum"))
    return cache[key]


def with_block_sums(gb: GraphBuilder, x: str, in_features: int, regions: int) -> str:
    """``x' = Concat(x, S, .., S)``: x and ``regions`` copies of its block sums (32 per block, zero-padded to
    whole blocks), the input of a Q4_1 carry's MatMulNBits (quant/q4_1.py); shared by every layer reading x."""
    cache = _derived(gb)
    key = ("with_block_sums", x, regions)
    if key not in cache:
        sums = blocksum(gb, x, in_features, BLOCK, q4_1.sum_width(in_features))
        cache[key] = gb.op("Concat", [x] + [sums] * regions, axis=-1, name=gb.fresh("with_block_sums"))
    return cache[key]


def _matmulnbits(gb: GraphBuilder, x: str, name: str, b: str, s: str, n: int, k: int, bits: int, block: int,
                 accuracy_level: int, bias: np.ndarray | None, zero_points: str = "") -> str:
    inputs = [x, b, s] + ([zero_points] if zero_points else [])
    if bias is not None:
        inputs += [""] * (5 - len(inputs)) + [gb.weight(f"{name}.bias", bias)]
    return gb.op("MatMulNBits", inputs, domain=MS_DOMAIN, name=f"{name}/MatMulNBits",
                 K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level)


def _matmulnbits4(gb: GraphBuilder, x: str, name: str, u: np.ndarray, scales: np.ndarray, block: int,
                  accuracy_level: int, bias: np.ndarray | None) -> str:
    n, k = u.shape
    if k % block:  # ragged last block: MatMulNBits reads ceil(K/block) blocks; pad with the zero code 8
        padded = np.full((n, -(-k // block) * block), 8, dtype=np.uint8)
        padded[:, :k] = u
        u = padded
    b = gb.weight(f"{name}.qweight", pack_matmulnbits(u, 4, block))
    s = gb.weight(f"{name}.scales", np.ascontiguousarray(scales, dtype=np.float32))
    return _matmulnbits(gb, x, name, b, s, n, k, 4, block, accuracy_level, bias)


def _emit_8bit_cpu(gb: GraphBuilder, x: str, name: str, weight: np.ndarray | GGMLBlocks, spec: QuantSpec,
                   bias: np.ndarray | None, share: bool) -> str | None:
    """8-bit grid (w8a16 or GGUF Q8_0) on MatMulNBits; None if no MatMulNBits block divides in_features."""
    if spec.accuracy_level < 4:
        # onnxruntime 1.32 has no fast 8-bit kernel for float activations (30-60x slower than a float32
        # MatMul, benchmarks/quant_linear.py): the same grid values go in as a float32 weight instead.
        grid = w8_grid(weight, spec, name)
        if grid is None:
            return None
        wt = gb.weight(f"{name}.weight", np.ascontiguousarray(grid_to_float(*grid).T))
        y = gb.op("MatMul", [x, wt], name=f"{name}/MatMul")
        return y if bias is None else gb.op("Add", [y, gb.weight(f"{name}.bias", bias)], name=f"{name}/bias")
    t = int8_table(gb, name, weight, spec, share=share)
    if t is None:
        return None
    return _matmulnbits(gb, x, name, t.qweight, t.scales, t.n, t.k, 8, t.block, spec.accuracy_level, bias)


def _emit_ggml_cpu(gb: GraphBuilder, x: str, name: str, weight: GGMLBlocks, spec: QuantSpec,
                   bias: np.ndarray | None, share: bool) -> str:
    """GGUF grid kept: Q4_0/Q8_0 straight onto MatMulNBits; Q4_1 at accuracy level 4 on one MatMulNBits (an
    integer zero point plus its residual's digits over the block sums, quant/q4_1.py: every m within d/32 of the
    GGUF's), below level 4 exactly (default zero point plus float32 block offsets)."""
    if weight.ggml_type == "Q8_0":
        y8 = _emit_8bit_cpu(gb, x, name, weight, spec, bias, share)
        assert y8 is not None  # block 32 always fits a Q8_0 weight
        return y8
    dec = decode_blocks(weight, name)
    n, k = dec.codes.shape
    if dec.m is not None and spec.accuracy_level == 4:
        # int8 activations (the kernel rounds each block of x, block sums included, as llama.cpp's Q4_1 x Q8_1
        # dot does): one MatMulNBits, no float32 offsets read per token nor MatMul + Add per layer.
        carry = q4_1.carry_q4_1(dec)
        b = gb.weight(f"{name}.qweight", pack_matmulnbits(carry.codes, 4, BLOCK))
        s = gb.weight(f"{name}.scales", carry.scales)
        zp = gb.weight(f"{name}.zero_points", q4_1.pack_zero_points(carry.zero_points))
        return _matmulnbits(gb, with_block_sums(gb, x, k, carry.digits), name, b, s, n, carry.k, 4, BLOCK,
                            spec.accuracy_level, bias, zp)
    y = _matmulnbits4(gb, x, name, dec.codes, dec.d, BLOCK, spec.accuracy_level, bias)
    if dec.m is None:
        return y
    # Q4_1: w = d*u + m = d*(u-8) + (8d+m), so y += blocksum(x) @ C with C [K/32, N] = (8d+m)^T.
    corr = np.ascontiguousarray((np.float32(8) * dec.d + dec.m).T)
    c = gb.op("MatMul", [blocksum(gb, x, k, BLOCK), gb.weight(f"{name}.block_offset", corr)],
              name=f"{name}/q4_1_offset")
    return gb.op("Add", [y, c], name=f"{name}/q4_1_add")


def _emit_cpu(gb: GraphBuilder, x: str, name: str, w: np.ndarray, spec: QuantSpec, bias: np.ndarray | None,
              share: bool) -> tuple[str, bool]:
    """MatMulNBits for w4a16 / w8a16 from a float32 weight ``w``."""
    n, k = w.shape
    if spec.scheme == "w4a16":
        codes, scales = quantize_rtn(w, 4, spec.group_size)
        u = (codes + 8).view(np.uint8)
        return _matmulnbits4(gb, x, name, u, scales, spec.group_size, spec.accuracy_level, bias), True
    y = _emit_8bit_cpu(gb, x, name, w, spec, bias, share)
    if y is not None:
        return y, True
    # no power-of-two block divides in_features: per-channel int8 DequantizeLinear -> MatMul
    codes, scales = quantize_rtn(w, 8, None)
    qw = gb.weight(f"{name}.qweight", np.ascontiguousarray(codes.T))
    wd = gb.op("DequantizeLinear", [qw, gb.weight(f"{name}.scales", scales[:, 0].copy())], axis=1,
               name=f"{name}/DequantizeLinear")
    return gb.op("MatMul", [x, wd], name=f"{name}/MatMul"), False


def _grid_trt(name: str, grid: Int4Grid, gs: int, sdt: type) -> tuple[np.ndarray, np.ndarray]:
    """A precomputed grid's codes and scales for the trt flavor (its groups must be the layer's trt block)."""
    if grid.group_size != gs:
        raise LinesideError(f"{name} was quantized in groups of {grid.group_size} but the trt flavor needs {gs}; "
                           "rebuild the bundle with both flavors in one build")
    scales = grid.scales.astype(sdt)
    if not np.isfinite(scales).all():
        raise LinesideError(f"{name}: a scale overflows {np.dtype(sdt).name}; quantize with float32 scales")
    return grid.codes, scales


def _emit_trt(gb: GraphBuilder, x: str, name: str, w: np.ndarray | Int4Grid, spec: QuantSpec) -> str:
    n, k = w.shape
    sdt = np.float16 if spec.trt_dtype == "fp16" else np.float32
    pad = 0
    if spec.scheme == "w4a16":
        gs = spec.trt_group(k)
        # TensorRT packs INT4 in pairs along the last dimension and refuses an odd one: an odd number of
        # outputs (e.g. a 32001-token head) gets one zero output column, sliced off after the MatMul.
        pad = n % 2
        if isinstance(w, Int4Grid):
            codes, scales = _grid_trt(name, w, gs, sdt)
            if pad:
                codes = np.concatenate([codes, np.zeros((pad, k), np.int8)])
                scales = np.concatenate([scales, np.ones((pad, scales.shape[1]), sdt)])
        else:
            wq = np.concatenate([w, np.zeros((pad, k), w.dtype)]) if pad else w
            codes, scales = quantize_rtn(wq, 4, gs, sdt)
        qw = gb.raw_weight(f"{name}.qweight", TensorProto.INT4, [k, n + pad], pack_int4_kn(codes))
        sc = gb.weight(f"{name}.scales", np.ascontiguousarray(scales.T))  # [K/gs, N]
        wd = gb.op("DequantizeLinear", [qw, sc], axis=0, block_size=gs, name=f"{name}/DequantizeLinear")
    else:
        codes, scales = quantize_rtn(w, 8, None, sdt)
        qw = gb.weight(f"{name}.qweight", np.ascontiguousarray(codes.T))  # int8 [K, N]
        wd = gb.op("DequantizeLinear", [qw, gb.weight(f"{name}.scales", scales[:, 0].copy())], axis=1,
                   name=f"{name}/DequantizeLinear")
    if sdt == np.float16:
        y = gb.op("MatMul", [cast_fp16(gb, x), wd], name=f"{name}/MatMul")
    else:
        y = gb.op("MatMul", [x, wd], name=f"{name}/MatMul")
    if pad:
        y = gb.op("Slice", [y, gb.const([0]), gb.const([n]), gb.const([-1])], name=f"{name}/drop_pad")
    if sdt == np.float16:
        return gb.op("Cast", [y], to=TensorProto.FLOAT, name=f"{name}/cast_fp32")
    return y


def emit_linear(gb: GraphBuilder, x: str, name: str, weight: np.ndarray | GGMLBlocks | Int4Grid, spec: QuantSpec,
                flavor: str, bias: np.ndarray | None = None, awq_scale: np.ndarray | None = None) -> str:
    """Append ``x [..., in] @ W^T (+ bias)`` to ``gb``; returns the float32 output ``[..., out]``.

    ``weight`` is float ``[out, in]`` (HF layout), GGMLBlocks or an Int4Grid (written as it is). ``awq_scale``
    s (from ``awq_search``): the graph computes ``(x * 1/s) @ Q(W diag(s))^T``. GGUF blocks with awq_scale
    are re-quantized.
    """
    return _emit(gb, x, name, weight, spec, flavor, bias, awq_scale, share=False)


def _emit(gb: GraphBuilder, x: str, name: str, weight: np.ndarray | GGMLBlocks | Int4Grid, spec: QuantSpec,
          flavor: str, bias: np.ndarray | None, awq_scale: np.ndarray | None, share: bool) -> str:
    y = _emit_decode(gb, x, name, weight, spec, flavor, bias, awq_scale, share)
    if flavor == "cpu" and spec.quantized and not share:  # the LM head reads a row or two: it keeps its grid
        bias_f = None if bias is None else np.asarray(bias, dtype=np.float32).reshape(-1)
        prefill.record_linear(gb, x, y, name, lambda: float_weight(weight), bias_f)
    return y


def _emit_decode(gb: GraphBuilder, x: str, name: str, weight: np.ndarray | GGMLBlocks | Int4Grid, spec: QuantSpec,
                 flavor: str, bias: np.ndarray | None, awq_scale: np.ndarray | None, share: bool) -> str:
    spec.check()
    if flavor not in FLAVORS:
        raise LinesideError(f"unknown graph flavor {flavor!r} for {name}; use one of {', '.join(FLAVORS)}")
    n, k = weight_shape(weight, name)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float32).reshape(-1)
        if bias.size != n:
            raise LinesideError(f"bias of {name} has {bias.size} values but the layer has {n} outputs")
    s = None
    if awq_scale is not None:
        s = np.asarray(awq_scale, dtype=np.float32).reshape(-1)
        if s.size != k or not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise LinesideError(f"AWQ scale of {name} must be {k} positive finite values; rerun the AWQ search")
        x = gb.op("Mul", [x, gb.weight(f"{name}.awq_inv_scale", (1.0 / s).astype(np.float32))],
                  name=f"{name}/awq_mul")
    if (isinstance(weight, GGMLBlocks) and weight.ggml_type in CARRIED and flavor == "cpu"
            and spec.quantized and s is None):
        return _emit_ggml_cpu(gb, x, name, weight, spec, bias, share)
    spec.validate(k, name, flavor)
    if isinstance(weight, Int4Grid) and spec.scheme == "w4a16":
        if s is not None:
            raise LinesideError(f"{name}: an AWQ scale can't apply to an already quantized INT4 grid")
        return _emit_grid(gb, x, name, weight, spec, flavor, bias)
    w = float_weight(weight)
    if s is not None:
        w = w * s
    has_bias = False
    if spec.scheme in ("fp32", "fp16"):
        wt = gb.weight(f"{name}.weight", np.ascontiguousarray(w.T, dtype=np.float32 if spec.scheme == "fp32" else np.float16))
        if spec.scheme == "fp16":
            wt = gb.op("Cast", [wt], to=TensorProto.FLOAT, name=f"{name}/cast_weight")
        y = gb.op("MatMul", [x, wt], name=f"{name}/MatMul")
    elif flavor == "cpu":
        y, has_bias = _emit_cpu(gb, x, name, w, spec, bias, share)
    else:
        y = _emit_trt(gb, x, name, w, spec)
    if bias is not None and not has_bias:
        y = gb.op("Add", [y, gb.weight(f"{name}.bias", bias)], name=f"{name}/bias")
    return y


def _emit_grid(gb: GraphBuilder, x: str, name: str, grid: Int4Grid, spec: QuantSpec, flavor: str,
               bias: np.ndarray | None) -> str:
    """An INT4 grid written as it is: MatMulNBits with the grid's block (cpu) or INT4 DequantizeLinear (trt)."""
    if flavor == "cpu":
        u = (grid.codes + 8).view(np.uint8)
        return _matmulnbits4(gb, x, name, u, grid.scales.astype(np.float32), grid.group_size, spec.accuracy_level,
                             bias)
    y = _emit_trt(gb, x, name, grid, spec)
    return y if bias is None else gb.op("Add", [y, gb.weight(f"{name}.bias", bias)], name=f"{name}/bias")


def emit_lm_head(gb: GraphBuilder, x: str, weight: np.ndarray | GGMLBlocks, spec: QuantSpec, flavor: str,
                 name: str = "lm_head", bias: np.ndarray | None = None, keep_8bit: bool = True) -> str:
    """The LM head (for tied embeddings, the embedding matrix): w4a16 builds keep it at 8 bits by default.

    Logits are the most quantization-sensitive output; GGUF blocks are carried as they are (Q8_0 stays 8-bit).
    On the cpu flavor (accuracy level 4) an 8-bit head shares its table with ``emit_embedding`` of the same
    weight, so a tied model stores the matrix once.
    """
    if keep_8bit and spec.scheme == "w4a16":
        spec = replace(spec, scheme="w8a16")
    return _emit(gb, x, name, weight, spec, flavor, bias, None, share=True)
