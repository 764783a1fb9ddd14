"""Small graph-building helpers over GraphBuilder: standard ONNX ops only (both flavors, TRT 10.3's parser).

Every helper takes and returns tensor names; constants are de-duplicated by the builder.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder
from lineside.build.graph.embedding import emit_embedding
from lineside.build.graph.linear import emit_linear, emit_lm_head
from lineside.build.graph.table8 import w8_block
from lineside.build.quant.rtn import fake_quantize
from lineside.build.quant.spec import QuantSpec

# Masked logits / gates: exp() underflows to exactly 0 in float32; finite, so a row with nothing
# valid (a candidate window not yet open) yields uniform weights instead of NaN.
NEG = -1e30
ELEM_FLOAT = TensorProto.FLOAT
ELEM_INT64 = TensorProto.INT64


class Ops:
    """Thin named wrappers so emitters read like the reference's math."""

    def __init__(self, gb: GraphBuilder, spec: QuantSpec, flavor: str) -> None:
        self.gb, self.spec, self.flavor = gb, spec, flavor
        self._scalars: dict[tuple[str, bytes], str] = {}

    # ---- constants -----------------------------------------------------------------------
    def _const(self, v: Any, dtype: Any) -> str:
        arr = np.asarray(v, dtype=dtype)
        if arr.ndim:
            return self.gb.const(arr, dtype)
        # GraphBuilder.weight's ascontiguousarray turns 0-d into [1]; Range/Gather need true scalars.
        key = (arr.dtype.str, arr.tobytes())
        if key not in self._scalars:
            elem = ELEM_INT64 if arr.dtype == np.int64 else ELEM_FLOAT
            self._scalars[key] = self.gb.raw_weight(self.gb.fresh("scalar"), elem, [], arr.tobytes())
        return self._scalars[key]

    def i64(self, v: Any) -> str:
        return self._const(v, np.int64)

    def f32(self, v: Any) -> str:
        return self._const(v, np.float32)

    def w(self, name: str, arr: np.ndarray) -> str:
        return self.gb.weight(name, np.ascontiguousarray(arr, dtype=np.float32))

    # ---- elementwise ---------------------------------------------------------------------
    def op(self, t: str, *ins: str, **attrs: Any) -> str:
        return self.gb.op(t, list(ins), **attrs)

    def add(self, a: str, b: str) -> str:
        return self.op("Add", a, b)

    def sub(self, a: str, b: str) -> str:
        return self.op("Sub", a, b)

    def mul(self, a: str, b: str) -> str:
        return self.op("Mul", a, b)

    def div(self, a: str, b: str) -> str:
        return self.op("Div", a, b)

    def matmul(self, a: str, b: str) -> str:
        return self.op("MatMul", a, b)

    def where(self, c: str, a: str, b: str) -> str:
        return self.op("Where", c, a, b)

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", x, to=to)

    def and_(self, a: str, b: str) -> str:
        return self.op("And", a, b)

    # ---- shape ---------------------------------------------------------------------------
    def reshape(self, x: str, shape: list[int] | str) -> str:
        return self.op("Reshape", x, shape if isinstance(shape, str) else self.i64(shape))

    def transpose(self, x: str, perm: list[int]) -> str:
        return self.op("Transpose", x, perm=perm)

    def concat(self, xs: list[str], axis: int) -> str:
        return self.gb.op("Concat", xs, axis=axis)

    def slice(self, x: str, start: int | str, end: int | str, axis: int) -> str:
        s = start if isinstance(start, str) else self.i64([start])
        e = end if isinstance(end, str) else self.i64([end])
        return self.op("Slice", x, s, e, self.i64([axis]))

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        return self.op("Unsqueeze", x, self.i64(axes))

    def squeeze(self, x: str, axes: list[int]) -> str:
        return self.op("Squeeze", x, self.i64(axes))

    def gather(self, x: str, idx: str, axis: int) -> str:
        return self.op("Gather", x, idx, axis=axis)

    def pick(self, x: str, i: int, axis: int) -> str:
        """x[..., i, ...] with the axis dropped."""
        return self.gather(x, self.i64(i), axis)

    def dim(self, x: str, axis: int) -> str:
        """Scalar int64 size of one axis."""
        return self.pick(self.op("Shape", x), axis, 0)

    def reduce(self, kind: str, x: str, axis: int, keep: bool = True) -> str:
        return self.op(kind, x, self.i64([axis]), keepdims=int(keep))

    # ---- math blocks ---------------------------------------------------------------------
    def rmsnorm(self, x: str, weight: np.ndarray | None, eps: float, name: str) -> str:
        """x / sqrt(mean(x²) + eps) (× weight): DeepseekV4RMSNorm / UnweightedRMSNorm."""
        var = self.reduce("ReduceMean", self.mul(x, x), -1)
        y = self.div(x, self.op("Sqrt", self.add(var, self.f32(eps))))
        return y if weight is None else self.mul(self.w(name, weight), y)

    def silu(self, x: str) -> str:
        return self.mul(x, self.op("Sigmoid", x))

    def clip(self, x: str, lo: float | None, hi: float | None) -> str:
        return self.op("Clip", x, self.f32(lo) if lo is not None else "", self.f32(hi) if hi is not None else "")

    def rope(self, x: str, cos: str, sin: str, rope_dim: int, head_dim: int) -> str:
        """Interleaved RoPE on the trailing ``rope_dim`` channels; cos/sin broadcast to x[..., rope_dim/2]."""
        nope = self.slice(x, 0, head_dim - rope_dim, -1)
        rot = self.slice(x, head_dim - rope_dim, head_dim, -1)
        pairs = self.reshape(rot, self._pair_shape(x))
        x0, x1 = self.pick(pairs, 0, -1), self.pick(pairs, 1, -1)
        o0 = self.sub(self.mul(x0, cos), self.mul(x1, sin))
        o1 = self.add(self.mul(x1, cos), self.mul(x0, sin))
        out = self.concat([self.unsqueeze(o0, [-1]), self.unsqueeze(o1, [-1])], -1)
        out = self.reshape(out, self.op("Shape", rot))
        return self.concat([nope, out], -1) if head_dim > rope_dim else out

    def _pair_shape(self, x: str) -> str:
        shp = self.op("Shape", x)
        lead = self.slice(shp, 0, -1, 0)
        return self.concat([lead, self.i64([-1, 2])], 0)

    # ---- linear layers -------------------------------------------------------------------
    def linear(self, x: str, name: str, weight: np.ndarray, quantize: bool = True, branch: bool = False) -> str:
        """y = x @ weight.T; large weights use the build's quant scheme, small routing ones stay fp32.

        ``branch``: the node sits in an ``If`` branch. A W8A16 weight no MatMulNBits block divides would be an INT8
        DequantizeLinear there, on an outer-scope initializer, which onnxruntime's MatMulNBits fusion cannot find
        (the graph fails to load); it goes in as float32 weights on the same per-channel INT8 grid instead.
        """
        spec = self.spec if quantize and self.spec is not None else QuantSpec(scheme="fp32")
        w = np.asarray(weight, dtype=np.float32)
        if branch and self.flavor == "cpu" and spec.scheme == "w8a16" and w8_block(w.shape[1], spec) is None:
            return emit_linear(self.gb, x, name, fake_quantize(w, 8, None), QuantSpec(scheme="fp32"), self.flavor)
        return emit_linear(self.gb, x, name, w, spec, self.flavor)

    def embedding(self, ids: str, weight: np.ndarray) -> str:
        """Embedding rows (8-bit on the cpu flavor, fp16 on trt for quantized builds; exact for fp32)."""
        spec = self.spec if self.spec is not None else QuantSpec(scheme="fp32")
        return emit_embedding(self.gb, ids, np.asarray(weight, dtype=np.float32), spec, self.flavor)

    def lm_head(self, x: str, weight: np.ndarray) -> str:
        spec = self.spec if self.spec is not None else QuantSpec(scheme="fp32")
        return emit_lm_head(self.gb, x, np.asarray(weight, dtype=np.float32), spec, self.flavor)

