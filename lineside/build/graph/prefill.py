"""The cpu flavor's prefill variant: the same graph with every linear on int8 weights and int8 activations.

Why: a prompt chunk is hundreds of rows, and onnxruntime's ``MatMulNBits`` at 512 rows runs no faster than a float32
SGEMM (its int8 path does not reach the CPU's int8 dot units), while ``MatMulIntegerToFloat`` (MLAS's u8s8 QGEMM:
AVX-512 VNNI / AVX2 / NEON dot) does the same product 3-3.5x faster (2 threads, 576x3072 at 512 rows: 2.5 vs 9 ms;
``benchmarks/prefill_graph.py``). A decode step (1-8 rows) stays on the 4-bit graph, where bytes decide.

Each linear ``y = x W^T + b`` becomes: x quantized per row (symmetric, 127 steps of the row's largest magnitude,
stored +128 as uint8), W per output channel (127 steps of the channel's largest magnitude, int8), one
``MatMulIntegerToFloat`` on 2-D operands (its per-row scale on 3-D ones took a slow, wrong path in onnxruntime 1.32,
and its bias input was ignored: the bias is an Add). The weights it quantizes are the float values the decode graph
approximates (a GGUF grid dequantized as llama.cpp does, a GPTQ grid exactly, float weights as they are), so the
prompt's cache is within int8 rounding of the decode graph's. The variant is a second ``.onnx`` beside the base one;
its int8 weights go into the same external-data file, and the base graph stays exactly as it was.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from lineside.build.graph.builder import MS_DOMAIN, GraphBuilder
from lineside.build.quant.smooth import InputStats, Int8Form, choose_form, quantize_columns

PREFILL_GRAPH = "prefill_graph"  # the flavor record's key: the variant's file name beside the base graph
PREFILL_FORMS = "prefill_forms"  # ... and how many linears took each int8 form (quant/smooth.Int8Form)


@dataclass
class _Variant:
    """The replacement nodes of each recorded linear (by the base graph's output name) and their weights."""

    replace: dict[str, list[onnx.NodeProto]] = field(default_factory=dict)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    quantized_inputs: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # x -> (q 2-D, scale, lead shape)
    names: set[str] = field(default_factory=set)  # of ``initializers``
    stats: dict[str, InputStats] = field(default_factory=dict)  # linear name -> its input on calibration text
    forms: dict[str, Int8Form] = field(default_factory=dict)  # linear name -> the form it took


_VARIANTS: weakref.WeakKeyDictionary[GraphBuilder, _Variant] = weakref.WeakKeyDictionary()


def enable(gb: GraphBuilder, stats: dict[str, InputStats] | None = None) -> None:
    """Record the linears ``gb`` emits from now on, for ``write_prefill_graph``; ``stats``: by linear name, its
    input on calibration text (quant/smooth.py), which picks each linear's int8 form (a linear without: plain)."""
    _VARIANTS.setdefault(gb, _Variant()).stats.update(stats or {})


def forms(gb: GraphBuilder) -> dict[str, Int8Form]:
    """The int8 form each recorded linear took, by name."""
    variant = _VARIANTS.get(gb)
    return {} if variant is None else dict(variant.forms)


def record_linear(gb: GraphBuilder, x: str, y: str, name: str, weight: Callable[[], np.ndarray],
                  bias: np.ndarray | None) -> None:
    """In the variant, the node that writes ``y`` becomes ``x @ weight()^T (+ bias)`` on int8 (no-op unless enabled).
    ``weight`` is called only then: the float ``[N, K]`` values of the layer."""
    variant = _VARIANTS.get(gb)
    if variant is None:
        return
    w = weight()
    n, k = w.shape
    nodes: list[onnx.NodeProto] = []
    stats = variant.stats.get(name)
    form, s = (Int8Form.PLAIN, None) if stats is None or stats.amax.shape != (k,) else choose_form(stats, w)[:2]
    variant.forms[name] = form
    if form == Int8Form.KEEP_4BIT:
        return  # the variant keeps the base graph's node for this linear
    if s is not None:
        # SmoothQuant (quant/smooth.py): x / s quantized per row, W * s per output channel; its own row quantizer
        w = w * s[None, :]
        inv = _weight(gb, variant, f"{name}.prefill_inv_smooth", (1.0 / s).astype(np.float32))
        q, scale, lead = _quantize_rows(gb, variant, x, k, nodes, smooth=inv)
    else:
        if x not in variant.quantized_inputs:
            variant.quantized_inputs[x] = _quantize_rows(gb, variant, x, k, nodes)
        q, scale, lead = variant.quantized_inputs[x]
    codes, scales = quantize_columns(w)
    cw = _weight(gb, variant, f"{name}.prefill_qweight", codes)
    cs = _weight(gb, variant, f"{name}.prefill_scales", scales)
    zp = _weight(gb, variant, "prefill/zero_point_128", np.array(128, dtype=np.uint8))
    out_n = _weight(gb, variant, f"prefill/out_{n}", np.array([n], dtype=np.int64))
    flat = f"{name}/prefill_mm_out"
    nodes.append(helper.make_node("MatMulIntegerToFloat", [q, cw, scale, cs, zp], [flat], domain=MS_DOMAIN,
                                  name=f"{name}/prefill_MatMulIntegerToFloat"))
    shape = f"{name}/prefill_shape"
    nodes.append(helper.make_node("Concat", [lead, out_n], [shape], axis=0, name=f"{name}/prefill_shape"))
    out = y if bias is None else f"{name}/prefill_nobias"
    nodes.append(helper.make_node("Reshape", [flat, shape], [out], name=f"{name}/prefill_reshape"))
    if bias is not None:
        b = _weight(gb, variant, f"{name}.prefill_bias", np.asarray(bias, dtype=np.float32))
        nodes.append(helper.make_node("Add", [out, b], [y], name=f"{name}/prefill_bias"))
    variant.replace[y] = nodes
    gb.uses_ms_domain = True


def _quantize_rows(gb: GraphBuilder, variant: _Variant, x: str, k: int, nodes: list[onnx.NodeProto],
                   smooth: str | None = None) -> tuple[str, str, str]:
    """Nodes quantizing ``x [..., K]`` per row, times ``smooth [K]`` if given: (uint8 codes ``[rows, K]``, scales
    ``[rows, 1]``, x's leading shape). The smoothing scales the ``[rows, K]`` rows, not ``x``: onnxruntime 1.20-1.23
    infer a GroupQueryAttention output (o_proj's x) as ``[b, s, 0]`` when its packed query's width is not static (a
    prefill linear's Reshape), and refused the graph at a Mul broadcasting that against ``[K]``."""
    p = gb.fresh("prefill/x")

    def const(tag: str, value: np.ndarray) -> str:
        return _weight(gb, variant, f"prefill/{tag}", value)

    def node(op: str, inputs: list[str], tag: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [f"{p}/{tag}"], name=f"{p}/{tag}", **attrs))
        return f"{p}/{tag}"

    x2 = node("Reshape", [x, const(f"rows_{k}", np.array([-1, k], np.int64))], "rows")
    if smooth is not None:
        x2 = node("Mul", [x2, smooth], "smoothed")
    amax = node("ReduceMax", [node("Abs", [x2], "abs"), const("last_axis", np.array([-1], np.int64))], "amax",
                keepdims=0)
    # an all-zero row keeps a positive scale (its codes are all 128): no 0/0
    scale = node("Mul", [node("Max", [amax, const("tiny", np.array(1e-30, np.float32))], "amax_pos"),
                         const("inv127", np.array(1 / 127, np.float32))], "scale")
    zero = node("Expand", [const("u8_128", np.array(128, np.uint8)), node("Shape", [scale], "rows_n")], "zero")
    # one QuantizeLinear per row (axis 0): what Div, Round, Add and Cast did in four passes over x
    q = node("QuantizeLinear", [x2, scale, zero], "codes", axis=0)
    scale2 = node("Unsqueeze", [scale, const("axis_1", np.array([1], np.int64))], "scale_2d")
    lead = node("Shape", [x], "lead", end=-1)
    return q, scale2, lead


def _weight(gb: GraphBuilder, variant: _Variant, name: str, value: np.ndarray) -> str:
    """An initializer of the variant only (large ones into the shared data file), written once by name."""
    if name not in variant.names:
        variant.names.add(name)
        variant.initializers.append(gb.detached_weight(name, value))
    return name


def write_prefill_graph(gb: GraphBuilder, path: Path) -> Path | None:
    """After ``gb.save()``: the variant (None if nothing was recorded), pruned of what it no longer reads."""
    variant = _VARIANTS.get(gb)
    if variant is None or not variant.replace:
        return None
    nodes: list[onnx.NodeProto] = []
    for node in gb.nodes:
        nodes.extend(variant.replace.get(node.output[0], [node]) if node.output else [node])
    needed = {o.name for o in gb.outputs}
    kept: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    kept.reverse()
    inits = [t for t in gb.initializers + variant.initializers if t.name in needed]
    gb.write_graph(path, kept, gb.inputs, inits, name=f"{gb.name}-prefill")
    return path
